"""The CPU (llvm) pipeline: TVM's default CPU build passes, spelled out so that schedules and
tuning records have their place in it.

Quantized linears are scheduled so that every weight row is dequantized once per call and reused
by all the call's tokens (verify and prefill cost about one decode in weight traffic). Measured on
the 127M-parameter benchmark model (2 cores): parallelising every kernel's outer spatial loops made
decode slower (19 -> 15 tok/s; hundreds of tiny kernels per token pay the thread-pool launch), so
the rest runs as written until per-format GEMV schedules land.
Operator fusion is left out on purpose: FuseTIR fails on these kernels (RenewDefs), and TVM's own
CPU default omits it because it may drop side-effecting calls."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ..errors import Ds4Error
from ..nn.qweight import DEQUANT_ROW, ROW_MATMUL


def _schedule_row_matmul(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """Quantized linears written as (dequantize W) -> (x @ W^T): put the token loop inside the
    output-row loop and compute each dequantized row there, so W is read and dequantized once per
    call whatever the number of tokens, into a buffer of one row, never a whole fp32 weight."""
    sch = s_tir.Schedule(func)
    try:
        mm = sch.get_sblock(ROW_MATMUL)
        deq = sch.get_sblock(DEQUANT_ROW)
    except Exception:  # noqa: BLE001 - not one of ours
        return None
    loops = sch.get_loops(mm)           # t, (g,) n, k
    t, rows = loops[0], loops[1:-1]
    sch.reorder(*rows, t, loops[-1])
    sch.compute_at(deq, rows[-1])
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="ScheduleRowMatmul")
def schedule_row_matmul(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        try:
            new = _schedule_row_matmul(func)
        except Exception as e:  # noqa: BLE001 - unscheduled, this kernel would write a whole fp32 weight
            raise Ds4Error(f"could not schedule {gv.name_hint}: {e}") from None
        if new is not None:
            mod[gv] = new
    return mod


def pipeline(target: tvm.target.Target):
    from tvm.relax import backend, transform

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential([
                backend.DispatchSampling(), backend.DispatchSortScan(), transform.LegalizeOps(),
                schedule_row_matmul, transform.RewriteDataflowReshape(), transform.ToNonDataflow(), transform.RemovePurityChecking(),
                transform.CallTIRRewrite(), transform.StaticPlanBlockMemory(), transform.LowerAllocTensor(),
                transform.KillAfterLastUse(), transform.LowerRuntimeBuiltin(), transform.ComputePrimValue(),
                transform.VMShapeLower(), transform.AttachGlobalSymbol()])
            return seq(mod)

    return _pipeline
