"""The GPU pipelines (CUDA, ROCm, Metal): TVM's build passes with dlight scheduling every kernel.

Linears arrive in their GPU forms (nn/qweight.py: a `dequantize` block feeding one reduction over
K; routed experts blockized, kernels/gpu.py). Rules, first match wins: Matmul (prefill and
verify, symbolic token counts), GEMV (static one-token decode, the blockized experts),
LowBatchGEMV, HandGEMV (the linears GEMV cannot analyse: IQ2_XXS), Reduction and GeneralReduction
(norms, softmax, pooling), Fallback for everything else, so that every PrimFunc is scheduled (GPU
memory verification rejects an unscheduled one). `ds4-compile --report` lists which rule took each
kernel. ROCm and Metal narrow indices to int32 (the AMDGPU warp shuffles take i32 lane indices;
Metal has no 64-bit thread indices).

Before scheduling, the elementwise chains are fused (schedules/fusion.py: FuseOps + FuseTIR with
every in-place state writer opaque and ordered after the kernels that read the rows it writes).
On CUDA, functions with static shapes (decode), and the copies per width of those called with
1..max_verify rows (verify), take recorded arguments (schedules/graphs.py: the position as a
device tensor, every argument static) so that RewriteCUDAGraph captures each in one CUDA graph,
which the VM then replays.
"""

from __future__ import annotations

import tvm


def rules():
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), _OrNext(_epilogue_room(dl.gpu.GEMV())), dl.gpu.LowBatchGEMV(4), _hand_gemv(),
            _OrNext(dl.gpu.Reduction()), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


WARP = 32
EPILOGUE_ROOM = 4096   # bytes of shared memory kept for a GEMV's epilogue stage


def _epilogue_room(rule):
    """dlight's GEMV with EPILOGUE_ROOM less shared memory than the target has: it stages the input
    vector in shared memory when the vector alone fits, then puts the output rows a broadcast
    epilogue (hc_post) reads there too, uncounted. GLM-5.3's dense FFN down projection (K = 12288
    floats, exactly 48 KiB) + hc_post then failed in ptxas (0xc040 bytes of shared data, 0xc000 max);
    with the room, such a vector is read from global memory (through L1) instead."""
    from tvm.s_tir.dlight.analysis.common_analysis import get_max_shared_memory_per_block
    from tvm.s_tir.dlight.base import ScheduleRule

    def apply(func, target, tunable):
        config = {k: v for k, v in target.export().items()}
        config["max_shared_memory_per_block"] = get_max_shared_memory_per_block(target) - EPILOGUE_ROOM
        return rule.apply(func, tvm.target.Target(config), tunable)

    wrapped = ScheduleRule.from_callable(type(rule).__name__)(apply)
    wrapped.ds4_name = type(rule).__name__
    return wrapped


def _hand_gemv():
    """The linears dlight's GEMV cannot read (IQ2_XXS: its grid and sign tables are gathered by
    the weight's own codes, which its analysis rejects), in nn/qweight.py's GPU form (a `dequantize`
    block inlined into one `matmul` reduction over K): one thread block per output element (token,
    row), its 32 threads a warp striding over K so that neighbouring threads read neighbouring
    weights, partial sums in registers, then summed across the warp by shuffles; an elementwise
    epilogue (the routed experts' SwiGLU) then in the same block."""
    from tvm import s_tir
    from tvm.s_tir.dlight.base import ScheduleRule

    def apply(func, target, tunable):
        sch = s_tir.Schedule(func)
        try:
            mm, deq = sch.get_sblock("matmul"), sch.get_sblock("dequantize")
        except Exception:  # noqa: BLE001 - not one of the linears
            return None
        k = sch.get_loops(mm)[-1]
        extent = sch.get(k).extent
        if not hasattr(extent, "value") or extent.value % WARP:
            return None
        try:
            epilogue = _one_epilogue(sch, mm, deq)
        except s_tir.ScheduleError:
            return None
        if epilogue is False:
            return None
        sch.compute_inline(deq)
        _, lane = sch.split(k, [None, WARP])
        partial = sch.rfactor(lane, 0)
        row = sch.fuse(*sch.get_loops(mm)[:-1])
        sch.bind(row, "blockIdx.x")
        sch.bind(sch.get_loops(mm)[-1], "threadIdx.x")
        sch.compute_at(partial, row)
        sch.bind(sch.get_loops(partial)[-2], "threadIdx.x")
        sch.set_scope(partial, 0, "local")
        if epilogue is not None:   # after the warp's sum, in the same block
            sch.set_scope(mm, 0, "shared")
            sch.reverse_compute_at(epilogue, row)
        return sch

    rule = ScheduleRule.from_callable("HandGEMV")(apply)
    rule.ds4_name = "HandGEMV"
    return rule


def _one_epilogue(sch, mm, deq):
    """The other blocks of a linear's PrimFunc (its fused elementwise epilogue: the experts'
    SwiGLU, a residual add, hc_post, and their elementwise inputs) inlined into one block after
    `mm`: that block, None when there are none, False when they do not reduce to one."""
    root = sch.get_sblock("root")
    names = {sch.get(b).name_hint for b in (mm, deq)}
    for block in sch.get_child_blocks(root):
        if sch.get(block).name_hint not in names and sch.get_consumers(block):
            sch.compute_inline(block)   # an intermediate: into what reads it
    rest = [b for b in sch.get_child_blocks(root) if sch.get(b).name_hint not in names]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 and len(sch.get_consumers(mm)) == 1 else False


def _OrNext(rule):
    """The rule, passing a PrimFunc on to the next rules when its analysis fails on it instead of
    declining: dlight's Reduction asserts (an access region wider than one element per block
    variable) on two of GLM-5.3's real-size expert kernels (blocks expert_partial / expert_matmul),
    and its GEMV on IQ2_XXS linears (tables gathered by the weight's codes), which the next rules
    schedule; its GEMV also fails (a loop fuse of no loops, ValueError) on some fused GEMVs whose
    epilogue reshapes the output (Qwen3.8's), which LowBatchGEMV or the reduction rules then take."""
    from tvm.s_tir.dlight.base import ScheduleRule

    def apply(func, target, tunable):
        try:
            return rule.apply(func, target, tunable)
        except (AssertionError, ValueError):
            return None

    wrapped = ScheduleRule.from_callable(f"{_rule_name(rule)}OrNext")(apply)
    wrapped.ds4_name = _rule_name(rule)
    return wrapped


def apply_rules(rule_list, log: dict | None = None):
    """dlight's ApplyDefaultSchedule (the first rule that takes a PrimFunc schedules it; written
    scheduled ones are left alone), noting in `log` which rule took each kernel (schedules/report.py)."""
    from tvm import s_tir

    @tvm.transform.module_pass(opt_level=0, name="ApplyRules")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=False)
        for gv, func in _unscheduled(mod):
            for rule in rule_list:
                space = rule.apply(func, target, False)
                if space is None:
                    continue
                sch = space if isinstance(space, s_tir.Schedule) else space[0]
                mod[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                if log is not None:
                    log[gv.name_hint] = _rule_name(rule)
                break
        return mod

    return _pass


def _unscheduled(mod):
    """(GlobalVar, PrimFunc) of the kernels no rule or hand has scheduled yet."""
    from tvm import tirx

    return [(gv, f) for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc) and not (f.attrs is not None and f.attrs.get("tirx.is_scheduled"))]


LOW_BATCH = ((2, 2), (8, 4))   # (widest token count, LowBatchGEMV's batch tile) per branch


def low_batch_specialize(log: dict | None = None):
    """Verify widths on the GEMV path: each linear in its GPU form (blocks `dequantize` + `matmul`)
    whose only symbolic dimension is the token count becomes `n <= 2`: LowBatchGEMV(2), `n <= 8`:
    LowBatchGEMV(4), else Matmul (prefill chunks), branching on n inside one kernel, as MLC-LLM's
    LowBatchGemvSpecialize does. Others are left to the rules."""
    from tvm import s_tir, tirx
    from tvm.s_tir import dlight as dl

    def scheduled(func, rule, target):
        sch = rule.apply(func, target, False)
        sch = sch[0] if isinstance(sch, list) else sch
        return None if sch is None else sch.mod["main"]

    @tvm.transform.module_pass(opt_level=0, name="LowBatchSpecialize")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=False)
        for gv, func in _unscheduled(mod):
            sym = _token_var(func)
            if sym is None:
                continue
            try:
                low = [scheduled(func, dl.gpu.LowBatchGEMV(tile), target) for _, tile in LOW_BATCH]
                wide = scheduled(func, dl.gpu.Matmul(), target)
            except AssertionError:
                continue
            if wide is None or any(f is None for f in low):
                continue
            n, body = sym, wide.body
            for (limit, _), f in reversed(list(zip(LOW_BATCH, low))):
                body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n <= limit), f.body, body)
            body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
            mod[gv] = func.with_body(body).with_attr("tirx.is_scheduled", True).with_attr(
                "tirx.HoistIfThenElseExprWithBlock", 1)
            if log is not None:
                log[gv.name_hint] = "LowBatchGEMV|Matmul"
        return mod

    return _pass


def _token_var(func):
    """The symbolic token count of a linear in its GPU form (blocks `dequantize` and `matmul`, the
    latter's only symbolic loop extent), or None for any other kernel."""
    from tvm import s_tir, tirx

    try:
        sch = s_tir.Schedule(func)
        sch.get_sblock("dequantize")
        mm = sch.get_sblock("matmul")
    except Exception:  # noqa: BLE001 - not one of the linears
        return None
    sym = {e for e in (sch.get(loop).extent for loop in sch.get_loops(mm)) if isinstance(e, tirx.Var)}
    return sym.pop() if len(sym) == 1 else None


def _rule_name(rule) -> str:
    return getattr(rule, "ds4_name", None) or type(rule).__name__


def pipeline(target: tvm.target.Target, device: str, log: dict | None = None, recorded: list | None = None,
             widths: dict | None = None):
    """log: filled with the rule that scheduled each kernel (ds4-compile --report). recorded: on
    CUDA, filled with the functions rewritten for CUDA graphs (schedules/graphs.py), whose
    callers must pass the same argument tensors on every call. widths: on CUDA, function ->
    the token counts at which a copy of it is recorded (graphs.width_copies)."""
    from tvm.relax import backend, transform

    from .fusion import fusion_passes
    from .graphs import finish_recorded, record_arguments, trim_outside_graphs, width_copies
    from .report import note_weights_only

    graphs = device == "cuda"

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": graphs}):
            passes = [backend.DispatchSampling(), backend.DispatchSortScan(), transform.LegalizeOps(),
                      *([width_copies(widths or {}), record_arguments([] if recorded is None else recorded)]
                        if graphs else []),
                      *fusion_passes(), low_batch_specialize(log), apply_rules(rules(), log),
                      *([finish_recorded()] if graphs else [])]
            if device in ("rocm", "metal"):
                passes.append(tvm.tirx.transform.ForceNarrowIndexToInt32())
            passes += [transform.RewriteDataflowReshape(), *([note_weights_only(log)] if log is not None else []),
                       transform.ToNonDataflow(),
                       transform.RemovePurityChecking(), transform.CallTIRRewrite(),
                       transform.StaticPlanBlockMemory(), *([transform.RewriteCUDAGraph()] if graphs else []),
                       transform.LowerAllocTensor(), transform.KillAfterLastUse(),
                       transform.LowerRuntimeBuiltin(), transform.ComputePrimValue(), transform.VMShapeLower(),
                       transform.AttachGlobalSymbol(), *([trim_outside_graphs()] if graphs else [])]
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
