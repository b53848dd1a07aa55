"""The CPU (llvm) pipeline: TVM's default CPU build passes, spelled out so that tuning records and
schedules have their place in it.

Linears arrive already written as register-blocked TIR kernels (kernels/cpu.py, chosen when
the module is exported for a CPU target). The TE kernels of shapes those kernels do not take (and
of modules exported without a CPU target) are scheduled here: dense ones dequantize
each weight row once per call into a one-row buffer shared by all the call's tokens; dense and
expert products keep 16 partial sums per output in one AVX-512 vector (the reduction split into
strided lanes) and sum them at the end. On a Q8_0 4096x4096 GEMV this took one core from 0.59 to
9.4 GB/s. Expert products reading at least PARALLEL_MIN_WEIGHTS, and dense ones doing at least
FEW_TOKENS_MIN_WORK products (or of a run-time number of tokens), split their rows over the cores;
parallelising every kernel's outer loops made decode slower (hundreds of tiny kernels per token pay
the thread-pool launch). Attention (softmax with sinks) computes q.k as 16-lane partial sums and
p.v with the key slot outside the channel loop. The kernels' loops over a run-time number of rows
(prefill chunks, verify) run on the cores when their iterations touch only their own rows (norms,
elementwise, attention: _rows_on_cores), verify's only where a row does enough work to pay for the
launch (its own copies of the kernels: few_rows_copies); decode's one-row kernels run as written.
Tuning records (schedules/tuning.py) are applied first; the hand schedules skip what they schedule.
Operator fusion is left out on purpose: TVM's own CPU default omits it because it may drop
side-effecting calls (the in-place state writes here), and the schedules below match unfused kernels."""

from __future__ import annotations

import contextlib

import tvm
from tvm import s_tir, tirx

from ..artifact import batch_name
from ..errors import Ds4Error
from ..kernels.tags import DEQUANT_ROW, EXPERT_MATMUL, EXPERT_PARTIAL, GATHER, ROW_MATMUL, ROW_PARTIAL


# A linear reading fewer weights than this runs on one core: below it the thread pool's launch
# costs more than the second core saves (measured on the 127M benchmark model, BENCHMARKS.md).
PARALLEL_MIN_WEIGHTS = 1 << 18
# A static few tokens' linear (decode, a batched decode) goes on the cores from this many products: the HC
# mixes (24 x 2048 per token, 24 us a call in a batched decode of 8 on one core): a decode 0.97x its time,
# a batched decode of 8 0.95x.
FEW_TOKENS_MIN_WORK = 1 << 15
# Verify's run-time number of rows goes on the cores where each row does at least this many iterations
# (_rows_on_cores, few_rows_copies): below it the pool's launch costs its few rows more than the second
# core saves (verify(2) 0.77x, verify(6) 0.88x the time; the same threshold for prefill: 1.08-1.15x slower).
MIN_ROW_WORK = 16384


def _extent(sch, loop) -> int | None:
    e = sch.get(loop).extent
    return int(e.value) if hasattr(e, "value") else None


def _lanes(sch, part) -> int:
    """The number of partial sums a ROW_PARTIAL / EXPERT_PARTIAL block keeps per output."""
    spatial = [v for v in sch.get(part).iter_vars if v.iter_type == tirx.IterVar.DataPar]
    return int(spatial[-1].dom.extent)


def _schedule_row_matmul(func: tirx.PrimFunc, threads: int) -> s_tir.Schedule | None:
    """Quantized linears written as (dequantize W) -> (x @ W^T): put the token loop inside the
    output-row loop and compute each dequantized row there, so W is read and dequantized once per
    call whatever the number of tokens, into a buffer of one row, never a whole fp32 weight. Those
    of FEW_TOKENS_MIN_WORK products or more, and any called with a run-time number of tokens,
    split their rows over the cores. One token, or a run-time number of them, takes the rows in
    blocks (_row_block): each step of k advances the partial sums of a block's rows together."""
    sch = s_tir.Schedule(func)
    try:
        mm = sch.get_sblock(ROW_MATMUL)
        part = sch.get_sblock(ROW_PARTIAL)
        deq = sch.get_sblock(DEQUANT_ROW)
    except Exception:  # noqa: BLE001 - not one of ours
        return None
    loops = sch.get_loops(mm)           # t, (g,) n, lane
    t, rows, lane = loops[0], loops[1:-1], loops[-1]
    tokens = _extent(sch, t)            # None: a prefill chunk or a verify, known only at run time
    row = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    lanes = _lanes(sch, part)           # (1: a row of fewer than 32 weights sums in one lane)
    block = _row_block(_extent(sch, row) or 0, threads) if tokens in (None, 1) and lanes > 1 else 1
    if block > 1:
        row, inner = sch.split(row, [None, block])
        sch.reorder(row, t, inner, lane)
        sch.compute_at(part, t)         # per block of rows and token: their partial sums ...
    else:
        inner = None
        sch.reorder(row, t, lane)
        sch.compute_at(part, row)       # per output row: the partial sums of every token ...
    sch.compute_at(deq, row)            # ... from the rows, dequantized once
    if lanes > 1:
        pl = sch.get_loops(part)        # row, t, (row in block,) lane, ko
        if inner is not None:           # a step of k for the block's rows: independent chains of adds
            sch.reorder(pl[-1], pl[-3], pl[-2])
        else:
            sch.reorder(pl[-1], pl[-2])     # lanes innermost: one vector of partial sums
            if (tokens or 1) > 1:           # a constant few tokens (a batched decode's rows): each
                sch.reorder(pl[-1], pl[1])  # step of k for all of them, independent chains of adds
        sch.vectorize(sch.get_loops(part)[-1])
    dl = sch.get_loops(deq)[-1]
    k = _extent(sch, dl) or 0
    if k % 16 == 0:
        sch.vectorize(sch.split(dl, [None, 16])[1])
    # any one called with a run-time number of tokens (the HC mixes: 24 x 2048 at 256 tokens took
    # 1.4 ms on one core), or a static few tokens' whose products outweigh a launch
    work = (_extent(sch, row) or 0) * block * k * (tokens or 1)
    if threads > 1 and (tokens is None or work >= FEW_TOKENS_MIN_WORK):
        sch.parallel(row)
    return sch


def _row_block(rows: int, threads: int) -> int:
    """Output rows whose partial sums advance together (one vector each, the input's vector read
    once for all): the largest of 8, 4, 2 dividing the rows that leaves every core blocks to do."""
    return next((b for b in (8, 4, 2) if rows % b == 0 and rows // b >= threads), 1)


def _schedule_expert_matmul(func: tirx.PrimFunc, threads: int) -> s_tir.Schedule | None:
    """Routed experts: the partial sums of one output row in a vector, the lanes innermost; the
    (token, expert slot, row) loop split over the cores when each expert is large."""
    sch = s_tir.Schedule(func)
    try:
        mm = sch.get_sblock(EXPERT_MATMUL)
        part = sch.get_sblock(EXPERT_PARTIAL)
    except Exception:  # noqa: BLE001 - not one of ours
        return None
    t, j, n = sch.get_loops(mm)[:3]
    rows = _extent(sch, n) or 0
    outer = sch.fuse(t, j, n)
    sch.compute_at(part, outer)
    pl = sch.get_loops(part)                     # (t, j, n), lane, ko
    k = (_extent(sch, pl[-1]) or 0) * (_extent(sch, pl[-2]) or 0)
    if _lanes(sch, part) > 1:
        sch.reorder(pl[-1], pl[-2])
        sch.vectorize(sch.get_loops(part)[-1])
    if threads > 1 and rows * k >= PARALLEL_MIN_WEIGHTS:
        sch.parallel(outer)
    return sch


def _lane_rfactor(sch, block):
    """The block's innermost (reduction) loop split into 16 lanes and rfactored: the block of 16
    partial sums along contiguous elements, the lane its last axis; None where that loop is not a
    multiple of 16 (the block left as it was)."""
    k = sch.get_loops(block)[-1]
    if (_extent(sch, k) or 0) % 16:
        return None
    _, ki = sch.split(k, [None, 16])
    return sch.rfactor(ki, len(sch.get(block).writes[0].region))


def _lane_partial_sums(sch, block) -> None:
    """A dot product over the block's innermost (reduction) loop, kept as 16 partial sums along
    contiguous elements (rfactor) so that the inner loop vectorizes."""
    rf = _lane_rfactor(sch, block)
    if rf is None:
        return
    # rfactor leaves the rf block's loops (..., k outer, lane): the lane innermost, 16 contiguous
    # elements that LLVM makes one vector. (Until 2026-12-07 a reorder here put the lane outside,
    # 16 scalar chains of strided loads: the same sums, bit for bit, at a third of the speed.)
    # The zeroing goes before the k loop, so no test of k == 0 is left inside the vector loop.
    sch.decompose_reduction(rf, sch.get_loops(rf)[-2])


def _root_blocks(func: tirx.PrimFunc) -> tuple[s_tir.Schedule, list]:
    """A schedule of func and its root block's children as (name, block), in order (none where it
    has no root block)."""
    sch = s_tir.Schedule(func)
    try:
        return sch, [(sch.get(b).name_hint, b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 - no root block
        return sch, []


def _schedule_attention(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """Softmax-with-sinks attention (nn/attention.py attend_with_sinks): q.k as 16-lane partial sums;
    p.v with the key slot outside the channel loop, so that each value row is read once,
    contiguously."""
    sch, blocks = _root_blocks(func)
    by_suffix = {name.rsplit("_", 1)[-1]: b for name, b in blocks}
    if not {"qk", "masked", "pv"} <= set(by_suffix):
        return None
    sch.compute_inline(by_suffix["masked"])
    pv = by_suffix["pv"]
    *_, d, a = sch.get_loops(pv)
    sch.reorder(a, d)
    sch.decompose_reduction(pv, a)
    _lane_partial_sums(sch, by_suffix["qk"])
    return sch


def _schedule_lane_sums(func: tirx.PrimFunc, picks) -> s_tir.Schedule | None:
    """The one root block whose name picks(name) accepts, its dot product as 16-lane partial sums
    (_lane_partial_sums); None where no block, or several, match."""
    sch, named = _root_blocks(func)
    blocks = [b for name, b in named if picks(name)]
    if len(blocks) != 1:
        return None
    _lane_partial_sums(sch, blocks[0])
    return sch


def _schedule_hadamard(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """The Hadamard transform and FP4 rounding (nn/rounding.py hadamard_fp4), one row (of one head)
    at a time: its dense x . h products as 16-lane partial sums (_lane_partial_sums' sums, bit for
    bit), a lane's partial sums of every output advancing together (h read by its row, the
    input's element broadcast), then the lanes added in order, the outputs a vector; the row's
    block maxima and rounding right after, from the cache. Each stage over all rows apart (their
    partial sums 64x the input) made a prefill chunk's indexer queries (256 x 16 heads x 64) take
    5.9 ms, 23 us for a decode's (now 1.1 ms and 9 us)."""
    sch, named = _root_blocks(func)
    blocks = dict(named)
    stems = [n[:-2] for n in blocks if n.startswith("hadamard") and n.endswith("_h")]
    if len(stems) != 1 or not {stems[0], stems[0] + "_amax"} <= set(blocks):
        return None
    out, h, amax = (blocks[stems[0] + suffix] for suffix in ("", "_h", "_amax"))
    if (_extent(sch, sch.get_loops(h)[-2]) or 0) % 16:   # the outputs: whole vectors
        return None
    rf = _lane_rfactor(sch, h)   # _lane_partial_sums' sums
    if rf is None:
        return None
    sch.transform_layout(rf, ("write", 0), lambda *i: (*i[:-2], i[-1], i[-2]))   # [..., lane, output]
    row = sch.get_loops(out)[-2]                  # one row of the output: the stages under it
    for producer in (amax, h, rf):
        sch.compute_at(producer, row)
    rki, rn, rko = sch.get_loops(rf)[-3:]         # (compute_at's order: lanes, outputs, k steps)
    sch.reorder(rki, rko, rn)                     # per lane: its k steps over every output
    sch.decompose_reduction(rf, rko)              # (the outputs innermost, contiguous: LLVM's vectors)
    sch.decompose_reduction(h, sch.get_loops(h)[-2])   # the lanes in order, the outputs a vector
    return sch


def _schedule_rms(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """RMS norms (nn/norm_rope.rms): the sum of squares as 16-lane partial sums, one vector of
    adds instead of a chain of 2048 scalar ones (the same order for every row count: a batched
    decode's rows normalize as decode's row does)."""
    return _schedule_lane_sums(func, lambda name: name == "rms_ss")


def _schedule_gather(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """Rows gathered from a ring (nn/state.gather_context): each row's channels copied 16 lanes at a
    time, unrolled. A loop of copies, scalar or vector, LLVM makes a call of memcpy per row (512
    bytes at the benchmark model's 128 channels): 13,120 calls of memcpy in a batched decode of 8
    (8% of its calling thread's time), 4,640 with the rows unrolled (decode 0.97-0.99x the time)."""
    if func.attrs is None or GATHER not in func.attrs:
        return None
    sch = s_tir.Schedule(func)
    (block,) = sch.get_child_blocks(sch.get_sblock("root"))
    channels = sch.get_loops(block)[-1]
    if (_extent(sch, channels) or 1) % 16:
        return None
    outer, lanes = sch.split(channels, [None, 16])
    sch.vectorize(lanes)
    sch.unroll(outer)
    return sch


def _realizes(stmt):
    """The SBlockRealize nodes in a loop nest, outer first."""
    if isinstance(stmt, s_tir.stmt.SBlockRealize):
        yield stmt
        stmt = stmt.block.body
    if isinstance(stmt, tirx.For):
        yield from _realizes(stmt.body)
    elif isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            yield from _realizes(s)
    elif isinstance(stmt, tirx.IfThenElse):
        yield from _realizes(stmt.then_case)
        if stmt.else_case is not None:
            yield from _realizes(stmt.else_case)


def _rows_apart(loop: tirx.For) -> bool:
    """Whether every iteration of `loop` touches its own rows only: each block under it binds the
    loop as one of its spatial variables and writes, and reads what any of them writes, at [that
    variable, ...] (so the iterations can run on different cores in any order, bit for bit as in
    one)."""
    realizes = list(_realizes(loop.body))
    rows, written = [], []
    for r in realizes:
        row = next((iv.var for iv, value in zip(r.block.iter_vars, r.iter_values)
                    if value.same_as(loop.loop_var) and iv.iter_type == tirx.IterVar.DataPar), None)
        if row is None:
            return False
        rows.append(row)
        written += [w.source for w in r.block.writes]
    for r, row in zip(realizes, rows):
        for region in [*r.block.writes, *(x for x in r.block.reads if any(x.source.same_as(w) for w in written))]:
            first = region.region[0]
            if not (first.min.same_as(row) and isinstance(first.extent, tirx.IntImm) and first.extent.value == 1):
                return False
    return bool(realizes)


def _top_loops(func: tirx.PrimFunc) -> list:
    body = func.body.block.body
    return list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]


def _row_work(stmt) -> float:
    """Iterations of the innermost statements of one iteration of a loop body (loops of constant
    extent multiplied out; one of a run-time extent counts as unbounded)."""
    if isinstance(stmt, tirx.For):
        inner = _row_work(stmt.body)
        return inner * stmt.extent.value if isinstance(stmt.extent, tirx.IntImm) else float("inf")
    if isinstance(stmt, tirx.SeqStmt):
        return sum(_row_work(s) for s in stmt.seq)
    if isinstance(stmt, s_tir.stmt.SBlockRealize):
        return max(1.0, _row_work(stmt.block.body))
    if isinstance(stmt, tirx.IfThenElse):
        return max(_row_work(stmt.then_case), _row_work(stmt.else_case) if stmt.else_case is not None else 0.0)
    return 1.0


def _rows_on_cores(func: tirx.PrimFunc, threads: int, min_row_work: float = 0) -> tirx.PrimFunc | None:
    """The kernel with each top-level loop over a number of rows known only at run time (the
    tokens of a prefill chunk or of verify), whose iterations are apart and each do at least
    min_row_work iterations, put on the cores; None where it has no such loop or is written by
    hand. Decode's kernels have one row, a constant, and stay on one core, where the pool's launch
    would cost more than the second core saves; so do, given min_row_work (the copies for
    verify's few rows: few_rows_copies), the loops of little work per row (an RMS norm's, the HC
    gates', an add's), whose launch cost verify(2..8) more than their rows' work (a prefill chunk's
    rows are many: there they pay; BENCHMARKS.md, 2026-12-07). The loop's kind is set here rather
    than by the schedule's `parallel`, which refuses a reduction split into init and update blocks
    (attention's p.v); a condition on the row count would need the loop nest twice, which TVM's
    analysis refuses (one variable bound to two ranges)."""
    if threads < 2 or (func.attrs is not None and func.attrs.get("ds4.schedule") == "hand"):
        return None

    def on_cores(stmt):
        if not isinstance(stmt, tirx.For) or stmt.kind != tirx.ForKind.SERIAL or \
                isinstance(stmt.extent, tirx.IntImm) or _row_work(stmt.body) < min_row_work or not _rows_apart(stmt):
            return stmt
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, tirx.ForKind.PARALLEL, stmt.body,
                        stmt.thread_binding, stmt.annotations)

    top = _top_loops(func)
    body = [on_cores(st) for st in top]
    if all(a.same_as(b) for a, b in zip(body, top)):
        return None
    root, block = func.body, func.body.block
    block = s_tir.stmt.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint,
                              tirx.SeqStmt(body) if len(body) > 1 else body[0], block.init, block.alloc_buffers,
                              block.match_buffers, block.annotations)
    return func.with_body(s_tir.stmt.SBlockRealize(root.iter_values, root.predicate, block))


FEW_ROWS = "ds4.few_rows"   # the attribute of a kernel's copy for the functions of a few rows (few_rows_copies)


def _light_rows(func: tirx.PrimFunc) -> bool:
    """Whether a TE kernel has a top-level loop over a run-time number of rows doing less than
    MIN_ROW_WORK per row (what a copy for a few rows would keep on one core)."""
    try:
        return any(isinstance(st, tirx.For) and not isinstance(st.extent, tirx.IntImm)
                   and _row_work(st.body) < MIN_ROW_WORK for st in _top_loops(func))
    except AttributeError:   # written by hand, no root block
        return False


def _verifies(name: str) -> bool:
    """Whether a function verifies blocks of a few rows: verify, or its batched form of b sequences
    (batch_name(b, "verify"))."""
    stem = name.rstrip("0123456789")
    return name == "verify" or (stem != name and name == batch_name(int(name[len(stem):]), "verify"))


def few_rows_copies(few):
    """A pass (after legalization) giving the functions whose names few(name) accepts (verify's
    blocks: a few rows, known only at run time) their own copy of each kernel with a loop over a
    run-time number of rows of little work each, marked FEW_ROWS: _rows_on_cores then keeps those
    copies' loops of less than MIN_ROW_WORK per row on one core, while a prefill chunk's rows share
    the cores. (Copied and rebound as fusion.preset_patterns does: in call order, the same build
    every time.)"""
    from tvm import relax

    from .fusion import rebound

    call_tir = tvm.ir.Op.get("relax.call_tir")

    @tvm.transform.module_pass(opt_level=0, name="FewRowsCopies")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        copies: dict = {}   # a kernel's GlobalVar -> its copy for a few rows (itself where none is needed)

        def copy_of(gv):
            if gv not in copies:
                func = bb.get()[gv]
                light = isinstance(func, tirx.PrimFunc) and _light_rows(func)
                copies[gv] = bb.add_func(func.with_attr(FEW_ROWS, True), f"{gv.name_hint}_few_rows") if light else gv
            return copies[gv]

        def rebind(b):
            v = b.value
            if not (isinstance(v, relax.Call) and v.op == call_tir) or copy_of(v.args[0]).same_as(v.args[0]):
                return b
            return relax.VarBinding(b.var, relax.Call(call_tir, [copies[v.args[0]], *v.args[1:]], v.attrs, v.ty_args))

        functions = sorted(mod.functions_items(), key=lambda item: item[0].name_hint)
        rewritten = [(gv, rebound(func, rebind)) for gv, func in functions
                     if isinstance(func, relax.Function) and few(gv.name_hint)]
        mod = bb.get()
        for gv, func in rewritten:
            mod[gv] = func
        return relax.transform.Normalize()(mod)   # the rebound calls' types

    return _pass


def _hand_schedules(threads: int):
    return (("llvm:row_matmul", lambda f: _schedule_row_matmul(f, threads)),
            ("llvm:expert_matmul", lambda f: _schedule_expert_matmul(f, threads)),
            ("llvm:attention", _schedule_attention), ("llvm:hadamard", _schedule_hadamard),
            ("llvm:rms", _schedule_rms), ("llvm:gather", _schedule_gather))


def hand_schedule(func: tirx.PrimFunc, threads: int, kind: list | None = None) -> s_tir.Schedule | None:
    """This pipeline's schedule of a kernel, or None for kernels it leaves as written; `kind` gets
    the schedule's name appended (ds4-compile --report)."""
    for name, schedule in _hand_schedules(threads):
        sch = schedule(func)
        if sch is not None:
            if kind is not None:
                kind.append(name)
            return sch
    return None


def schedule_kernels(threads: int, log: dict | None = None):
    """Schedules every kernel this pipeline knows, except those a tuning record already scheduled;
    log: kernel -> what scheduled it (schedules/report.py)."""
    @tvm.transform.module_pass(opt_level=0, name="ScheduleKernels")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, tirx.PrimFunc):
                continue
            if func.attrs is not None and func.attrs.get("tirx.is_scheduled"):
                if log is not None:
                    log[gv.name_hint] = "tuned"
                continue
            kind = []
            try:
                sch = hand_schedule(func, threads, kind)
                rows = _rows_on_cores(sch.mod["main"] if sch is not None else func, threads,
                                      MIN_ROW_WORK if func.attrs is not None and FEW_ROWS in func.attrs else 0)
            except Exception as e:  # noqa: BLE001 - unscheduled, this kernel would write a whole fp32 weight
                raise Ds4Error(f"could not schedule {gv.name_hint}: {e}") from None
            if rows is not None:
                mod[gv] = rows
                kind.append("llvm:rows")
            elif sch is not None:
                mod[gv] = sch.mod["main"]
            if log is not None and kind:
                log[gv.name_hint] = "+".join(kind)
        return mod

    return _pass


def legalize_passes() -> list:
    """Relax ops to kernels: the module as the schedules (and the tuning) see it."""
    from tvm.relax import backend, transform

    return [backend.DispatchSampling(), backend.DispatchSortScan(), transform.LegalizeOps()]


def pipeline(target: tvm.target.Target, records: str | None = None, log: dict | None = None,
             recorded: list | None = None, widths: dict | None = None):
    """records: a meta-schedule database directory (schedules/tuning.py) applied before the
    hand schedules, which then skip what it scheduled; log: kernel -> what scheduled it.
    recorded: given (for a module exported in the GPU forms), the CUDA pipeline's graph rewrite
    of the arguments (filled with the functions rewritten) and its fusion, so that the fused
    graph's numerics and the recorded-argument calls are checked here (with the width copies of
    `widths`)."""
    from tvm.relax import transform

    from .fusion import fusion_passes
    from .graphs import finish_recorded, record_arguments, width_copies
    from .report import note_weights_only

    database = contextlib.nullcontext()
    if records:   # entered as the current database: given a path, the pass logs a warning on every compile
        from tvm.s_tir import meta_schedule as ms

        database = ms.database.JSONDatabase(work_dir=str(records))

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target, database:
            seq = tvm.transform.Sequential([
                *legalize_passes(),
                *([width_copies(widths or {}), record_arguments(recorded), *fusion_passes()] if recorded is not None
                  else [few_rows_copies(_verifies)]),
                *([transform.MetaScheduleApplyDatabase()] if records else []),
                schedule_kernels(int(target.attrs.get("num-cores", 1)), log),
                *([finish_recorded()] if recorded is not None else []), transform.RewriteDataflowReshape(),
                *([note_weights_only(log)] if log is not None else []),
                transform.ToNonDataflow(), transform.RemovePurityChecking(),
                transform.CallTIRRewrite(), transform.StaticPlanBlockMemory(), transform.LowerAllocTensor(),
                transform.KillAfterLastUse(), transform.LowerRuntimeBuiltin(), transform.ComputePrimValue(),
                transform.VMShapeLower(), transform.AttachGlobalSymbol()])
            return seq(mod)

    return _pipeline
