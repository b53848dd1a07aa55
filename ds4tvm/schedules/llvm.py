"""The CPU (llvm) pipeline: TVM's default CPU build passes, spelled out so that schedules and
tuning records have their place in it.

Measured on the 127M-parameter benchmark model (2 cores): parallelising every kernel's outer
spatial loops made decode slower (19 -> 15 tok/s; hundreds of tiny kernels per token pay the
thread-pool launch), so the kernels run as written until per-format GEMV schedules land.
Operator fusion is left out on purpose: FuseTIR fails on these kernels (RenewDefs), and TVM's own
CPU default omits it because it may drop side-effecting calls."""

from __future__ import annotations

import tvm


def pipeline(target: tvm.target.Target):
    from tvm.relax import backend, transform

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential([
                backend.DispatchSampling(), backend.DispatchSortScan(), transform.LegalizeOps(),
                transform.RewriteDataflowReshape(), transform.ToNonDataflow(), transform.RemovePurityChecking(),
                transform.CallTIRRewrite(), transform.StaticPlanBlockMemory(), transform.LowerAllocTensor(),
                transform.KillAfterLastUse(), transform.LowerRuntimeBuiltin(), transform.ComputePrimValue(),
                transform.VMShapeLower(), transform.AttachGlobalSymbol()])
            return seq(mod)

    return _pipeline
