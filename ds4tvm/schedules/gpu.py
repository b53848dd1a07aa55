"""The GPU pipelines (CUDA, ROCm, Metal): TVM's build passes with dlight scheduling every kernel.

Rules, first match wins: Matmul (prefill, tensor cores where the types allow), GEMV (static
one-token decode), LowBatchGEMV (verify: a few tokens), Reduction and GeneralReduction (norms,
softmax, pooling), Fallback for everything else, so that every PrimFunc is scheduled (GPU memory
verification rejects an unscheduled one). ROCm and Metal narrow indices to int32 (the AMDGPU
warp shuffles take i32 lane indices; Metal has no 64-bit thread indices).

Operator fusion stays off, as on the CPU (schedules/llvm.py): the KV rings are written in place
after every read of their old rows, and fusing a read into a later consumer would move it past
the write. The dequantization of every plane format is already inside each linear's kernel (the
weight is read as planes in the same PrimFunc that multiplies), so fusion is not needed for it.
"""

from __future__ import annotations

import tvm


def rules():
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(4), _OrNext(dl.gpu.Reduction()),
            dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def _OrNext(rule):
    """The rule, passing a PrimFunc on to the next rules when its analysis fails on it instead of
    declining: dlight's Reduction asserts (an access region wider than one element per block
    variable) on two of GLM-5.3's real-size expert kernels (blocks expert_partial / expert_matmul),
    which the next rules schedule."""
    from tvm.s_tir.dlight.base import ScheduleRule

    def apply(func, target, tunable):
        try:
            return rule.apply(func, target, tunable)
        except AssertionError:
            return None

    return ScheduleRule.from_callable(f"{type(rule).__name__}OrNext")(apply)


def pipeline(target: tvm.target.Target, device: str):
    from tvm.relax import backend, transform
    from tvm.s_tir import dlight as dl

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            passes = [backend.DispatchSampling(), backend.DispatchSortScan(), transform.LegalizeOps(),
                      transform.AnnotateTIROpPattern(), dl.ApplyDefaultSchedule(*rules())]
            if device in ("rocm", "metal"):
                passes.append(tvm.tirx.transform.ForceNarrowIndexToInt32())
            passes += [transform.RewriteDataflowReshape(), transform.ToNonDataflow(),
                       transform.RemovePurityChecking(), transform.CallTIRRewrite(),
                       transform.StaticPlanBlockMemory(), transform.LowerAllocTensor(), transform.KillAfterLastUse(),
                       transform.LowerRuntimeBuiltin(), transform.ComputePrimValue(), transform.VMShapeLower(),
                       transform.AttachGlobalSymbol()]
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
