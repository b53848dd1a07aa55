"""GPU forms of the routed-expert linears (../shared/reference/gpu-guide.md §1): the "blockized"
GEMV that dlight's GEMV rule schedules, as MLC-LLM writes its MoE GEMVs. One (token, slot) pair per
`blockIdx.y`; inside it an outer block reads the pair's expert id once, a `dequantize` block turns
that expert's rows into float32 (inlined by the rule into the product: no fp32 weight is written)
and a `gemv` block reduces over K. The expert's planes are read straight from the weight arguments
with kernels/dequant.py's expressions, the same float operations as every other path.

Then the kernels written scheduled for what dlight's rules would split into several launches
(`launches` in `ds4-compile --report`): the window attention over a K=V ring, RMSNorm + RoPE + FP8
rows, and the top-k choice of experts or indexer rows. Each takes bind=False to run its loops
serially, so that the GPU forms built for a CPU check their numerics; they read shared memory
outside `if` conditions only (TVM's sync planner cannot put a barrier inside one)."""

from __future__ import annotations

import functools
import math

from gguf import GGMLQuantizationType as QT
from tvm import tirx
from tvm.script import tirx as T

from .cpu import arg_types, dequant_of
from .minifloat import pow2_ceil_scale, round_minifloat
from .slots import NEG_INF, context_row, window_slots
from .tags import OPAQUE

# Formats whose dequantization gathers lookup tables by the weight's codes: dlight's GEMV rejects
# them in any form, so their experts keep the flat form (nn/qweight.py) that schedules/gpu.py's
# HandGEMV takes.
TABLE_GATHERED = (QT.IQ2_XXS,)
K_QUANTS = (QT.Q2_K, QT.Q4_K, QT.Q6_K)


def takes_blockized(qtype: QT, K: int) -> bool:
    """Whether the routed experts take expert_gemv. Not the table formats, and not a K-quant row of
    one 256-weight super-block: GEMV's schedule of that form fails in TVM 0.27's CUDA codegen (its
    two-block rows, K = 512 and up, compile); those take the flat form."""
    return qtype not in TABLE_GATHERED and not (qtype in K_QUANTS and K < 512)


@functools.lru_cache(maxsize=None)
def expert_gemv(qtype: QT, E: int, N: int, K: int, J: int, per_slot_input: bool, bind: bool = True):
    """y[T, J, N] = x[T, (J|1), K] @ W[ids[t, j], N, K]^T for any T (a decode's T = 1 is the case
    it is shaped for; wider calls run one GEMV per (token, slot) pair). bind=False: the pair loop
    serial, for checking the form's numerics on a CPU."""
    a = arg_types(qtype, (E, N), K, False)
    deq = dequant_of(qtype)
    XJ = J if per_slot_input else 1

    def x_of(x, s, k):
        return x[s // J, s % J if per_slot_input else 0, k]

    @T.prim_func(private=True, s_tir=True)
    def main(x_h: T.handle, ids_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]),
             w3: T.Buffer(*a[3]), w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), w6: T.Buffer(*a[6]), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int64()
        x = T.match_buffer(x_h, (n_tok, XJ, K), "float32")
        ids = T.match_buffer(ids_h, (n_tok, J), "int32")
        y = T.match_buffer(y_h, (n_tok, J, N), "float32")
        for pair in (T.thread_binding(n_tok * J, thread="blockIdx.y") if bind else T.serial(n_tok * J)):
            with T.sblock("gemv_o"):
                s = T.axis.spatial(n_tok * J, pair)
                w = T.sblock_alloc_buffer((N, K), "float32")
                for i1, i2 in T.grid(N, K):
                    with T.sblock("dequantize"):
                        i, k = T.axis.remap("SS", [i1, i2])
                        w[i, k] = deq((ids[s // J, s % J], i), k, (w0, w1, w2, w3, w4, w5, w6))
                for i1, i2 in T.grid(N, K):
                    with T.sblock("gemv"):
                        i, k = T.axis.remap("SR", [i1, i2])
                        with T.init():
                            y[s // J, s % J, i] = T.float32(0)
                        y[s // J, s % J, i] = y[s // J, s % J, i] + x_of(x, s, k) * w[i, k]

    return main


def clamped_swiglu_value(g, u, limit: float, silu=None):
    """nn/moe.clamped_swiglu of one gate value g and up value u, SiLU by default as the relax ops
    compute it (x * sigmoid(x)), else silu(x)."""
    if limit > 0:
        g = tirx.min(g, tirx.const(limit, "float32"))
        u = tirx.min(tirx.max(u, tirx.const(-limit, "float32")), tirx.const(limit, "float32"))
    return (g * tirx.sigmoid(g) if silu is None else silu(g)) * u


@functools.lru_cache(maxsize=None)
def expert_gemv_swiglu(qtype: QT, E: int, N: int, K: int, J: int, limit: float, bind: bool = True):
    """y[T, J, N] = clamped SwiGLU(g, x @ W[ids]^T) (nn/moe.clamped_swiglu of the gate projection
    g and this up projection): expert_gemv of a shared input with the SwiGLU as its epilogue,
    which dlight's GEMV rule schedules after the reduction (one launch where there were two)."""
    a = arg_types(qtype, (E, N), K, False)
    deq = dequant_of(qtype)

    def act(g, u):
        return clamped_swiglu_value(g, u, limit)

    @T.prim_func(private=True, s_tir=True)
    def main(x_h: T.handle, ids_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]),
             w3: T.Buffer(*a[3]), w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), w6: T.Buffer(*a[6]), g_h: T.handle,
             y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int64()
        x = T.match_buffer(x_h, (n_tok, 1, K), "float32")
        ids = T.match_buffer(ids_h, (n_tok, J), "int32")
        g = T.match_buffer(g_h, (n_tok, J, N), "float32")
        y = T.match_buffer(y_h, (n_tok, J, N), "float32")
        for pair in (T.thread_binding(n_tok * J, thread="blockIdx.y") if bind else T.serial(n_tok * J)):
            with T.sblock("gemv_o"):
                s = T.axis.spatial(n_tok * J, pair)
                w = T.sblock_alloc_buffer((N, K), "float32")
                up = T.sblock_alloc_buffer((N,), "float32")
                for i1, i2 in T.grid(N, K):
                    with T.sblock("dequantize"):
                        i, k = T.axis.remap("SS", [i1, i2])
                        w[i, k] = deq((ids[s // J, s % J], i), k, (w0, w1, w2, w3, w4, w5, w6))
                for i1, i2 in T.grid(N, K):
                    with T.sblock("gemv"):
                        i, k = T.axis.remap("SR", [i1, i2])
                        with T.init():
                            up[i] = T.float32(0)
                        up[i] = up[i] + x[s // J, 0, k] * w[i, k]
                for i1 in range(N):
                    with T.sblock("epilogue"):
                        i = T.axis.spatial(N, i1)
                        y[s // J, s % J, i] = act(g[s // J, s % J, i], up[i])

    return main


MAX_SLOTS = 4096   # a block keeps its slots' scores and weights in shared memory: 32 KB
THREADS = 256   # a hand kernel's thread block
MAX_BLOCK_THREADS = 1024


def hand_kernel(func):
    """A kernel written scheduled (plain loops bound to threads) wrapped in a root block, the form
    Relax's analyses of PrimFuncs expect (RewriteDataflowReshape's reads every call's)."""
    from tvm import s_tir

    return func.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", func.body)))


@functools.lru_cache(maxsize=None)
def window_attention(H: int, D: int, ring_shape: tuple, before: int, comp_shape: tuple | None, sel_width: int | None,
                     window: int, ratio: int, n_rot: int, bind: bool = True, write_ring: bool = False):
    """nn/attention.sparse_window_attention as one kernel, its context rows read in place from the
    ring (nn/state.RingRows): a thread block per (token, head) keeps its slots' scores in shared
    memory; each thread scores slots (the dot over D in order, as the TE form), max and sum run as
    tree reductions over the threads, then each thread sums its output channel pair over the slots
    in order and, with n_rot, rotates it back by RoPE at the token's position. With write_ring, the
    first head's block of each token then writes the token's row into the ring (in place: the
    ring is then the kernel's first output), which no block reads while fewer rows are new than
    the ring holds beyond `before` (a decode step, a recorded width). bind=False: the same loops
    serial (a CPU runs them: the numerics check of the GPU forms)."""
    size, width = ring_shape
    has_comp, use_sel = comp_shape is not None, sel_width is not None
    CR, CW = comp_shape if has_comp else (1, 1)
    MS = sel_width if use_sel else 1
    A = window + (sel_width if use_sel else CR if has_comp else 0)
    NT, lo = THREADS, (D - n_rot if n_rot else D)   # channels from lo on are rotated back
    assert D % 2 == 0 and lo % 2 == 0 and NT & (NT - 1) == 0
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda: T.thread_binding(NT, thread="threadIdx.x")) if bind else (lambda: T.serial(NT))

    def slots(ring, new, comp, sel, s):
        return window_slots(context_row(ring, new, s, before), new.shape[0] + before, comp if has_comp else None,
                            sel if use_sel else None, s, window, ratio)

    scores, softmax, outputs, write_row = _window_phases(
        H, D, A, NT, lo, threads, lambda ring, new, comp, sel, s, t, a, d: slots(ring, new, comp, sel, s)[2](t, a, d),
        lambda ring, new, comp, sel, s, t, a: slots(ring, new, comp, sel, s)[1](t, a), size, width)

    @T.prim_func(private=True)
    def main(q_h: T.handle, ring_h: T.handle, new_h: T.handle, sinks: T.Buffer((H,), "float32"), start: T.int64,
             fr_h: T.handle, comp_h: T.handle, sel_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        n, n_fr, n_sel = T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (n, H, D), "float32")
        Ring = T.match_buffer(ring_h, (size, width), "float32")
        New = T.match_buffer(new_h, (n, width), "float32")
        Fr = T.match_buffer(fr_h, (n_fr,), "float32")
        Comp = T.match_buffer(comp_h, (CR, CW), "float32")
        Sel = T.match_buffer(sel_h, (n_sel, MS), "int32")
        O = T.match_buffer(out_h, (n, H, D), "float32")
        for th in blocks(n * H):
            score = T.alloc_buffer((A,), "float32", scope="shared")
            prob = T.alloc_buffer((A,), "float32", scope="shared")
            red = T.alloc_buffer((NT,), "float32", scope="shared")
            stat = T.alloc_buffer((2,), "float32", scope="shared")
            acc = T.alloc_buffer((2,), "float32", scope="local")
            # Each phase writes shared memory it does not read (the sync planner cannot place a
            # barrier inside the slot loop's condition), accumulating in registers.
            scores(Q, Ring, New, Comp, Sel, start, th, score, red, acc)
            softmax(Ring, New, Comp, Sel, start, th, sinks, score, prob, red, stat, acc)
            outputs(Ring, New, Comp, Sel, start, th, Fr, O, prob, stat, acc)
            if write_ring:
                write_row(Ring, New, start, th)

    return hand_kernel(main)


def _window_phases(H: int, D: int, A: int, NT: int, lo: int, threads, key, valid, size: int, width: int):
    """window_attention's phases, as macros over one (token, head) block th: the slots' scores and
    their maximum, the softmax's probabilities and sum (with the head's sink), the output channel
    pairs (rotated back from channel lo on), and the token's row written into the ring."""
    per_thread, scale = (A + NT - 1) // NT, 1.0 / math.sqrt(D)
    ring_steps = (width + NT - 1) // NT
    rounds = NT.bit_length() - 1   # of the tree reductions: strides NT/2 .. 1

    @T.macro
    def scores(Q, Ring, New, Comp, Sel, start, th, score, red, acc):
        for tx in threads():
            acc[1] = T.float32(NEG_INF)
            for i in range(per_thread):
                if i * NT + tx < A:
                    acc[0] = T.float32(0)
                    for d in range(D):
                        acc[0] = acc[0] + Q[th // H, th % H, d] * key(Ring, New, Comp, Sel, start, th // H,
                                                                        i * NT + tx, d)
                    acc[0] = T.if_then_else(valid(Ring, New, Comp, Sel, start, th // H, i * NT + tx),
                                            acc[0] * T.float32(scale), T.float32(NEG_INF))
                    score[i * NT + tx] = acc[0]
                    acc[1] = T.max(acc[1], acc[0])
            red[tx] = acc[1]

    @T.macro
    def softmax(Ring, New, Comp, Sel, start, th, sinks, score, prob, red, stat, acc):
        for k in T.unroll(rounds):
            for tx in threads():
                if tx < T.shift_right(NT // 2, k):
                    red[tx] = T.max(red[tx], red[tx + T.shift_right(NT // 2, k)])
        for tx in threads():
            if tx == 0:
                stat[0] = T.max(red[0], sinks[th % H])
        for tx in threads():
            acc[1] = T.float32(0)
            for i in range(per_thread):
                if i * NT + tx < A:
                    acc[0] = T.if_then_else(valid(Ring, New, Comp, Sel, start, th // H, i * NT + tx),
                                            T.exp(score[i * NT + tx] - stat[0]), T.float32(0))
                    prob[i * NT + tx] = acc[0]
                    acc[1] = acc[1] + acc[0]
            red[tx] = acc[1]
        for k in T.unroll(rounds):
            for tx in threads():
                if tx < T.shift_right(NT // 2, k):
                    red[tx] = red[tx] + red[tx + T.shift_right(NT // 2, k)]
        for tx in threads():
            if tx == 0:
                stat[1] = red[0] + T.exp(sinks[th % H] - stat[0])

    @T.macro
    def write_row(Ring, New, start, th):
        for tx in threads():
            if th % H == 0:
                for i in range(ring_steps):
                    if i * NT + tx < width:
                        Ring[T.floormod(start + th // H, size), i * NT + tx] = New[th // H, i * NT + tx]

    return scores, softmax, _output_phase(H, D, A, NT, lo, threads, key), write_row


def _output_phase(H: int, D: int, A: int, NT: int, lo: int, threads, key):
    """window_attention's last phase: each thread sums its output channel pairs over the slots in
    order, divides by the softmax's sum and, from channel lo on, rotates the pair back by RoPE."""
    pair_steps = (D // 2 + NT - 1) // NT

    def rotated(x0, x1, pos, j, odd: bool):   # rope(..., inverse=True) of the pair (x0, x1)
        c, s = T.cos(pos.astype("float32") * j), -T.sin(pos.astype("float32") * j)
        return x0 * s + x1 * c if odd else x0 * c - x1 * s

    @T.macro
    def outputs(Ring, New, Comp, Sel, start, th, Fr, O, prob, stat, acc):
        for tx in threads():
            for i in range(pair_steps):
                if i * NT + tx < D // 2:
                    acc[0] = T.float32(0)
                    acc[1] = T.float32(0)
                    for a in range(A):
                        acc[0] = acc[0] + prob[a] * key(Ring, New, Comp, Sel, start, th // H, a, 2 * (i * NT + tx))
                        acc[1] = acc[1] + prob[a] * key(Ring, New, Comp, Sel, start, th // H, a,
                                                         2 * (i * NT + tx) + 1)
                    acc[0] = acc[0] / stat[1]
                    acc[1] = acc[1] / stat[1]
                    if 2 * (i * NT + tx) >= lo:
                        O[th // H, th % H, 2 * (i * NT + tx)] = rotated(
                            acc[0], acc[1], start + th // H, Fr[(2 * (i * NT + tx) - lo) // 2], False)
                        O[th // H, th % H, 2 * (i * NT + tx) + 1] = rotated(
                            acc[0], acc[1], start + th // H, Fr[(2 * (i * NT + tx) - lo) // 2], True)
                    else:
                        O[th // H, th % H, 2 * (i * NT + tx)] = acc[0]
                        O[th // H, th % H, 2 * (i * NT + tx) + 1] = acc[1]

    return outputs


@functools.lru_cache(maxsize=None)
def top_k(E: int, k: int, biased: bool, denominator=None, scale: float = 1.0, bind: bool = True):
    """The indices of the k highest of E <= MAX_BLOCK_THREADS scores per row (plus a bias) and
    their weights (nn/moe.route_weights' expressions over the unbiased scores) as one kernel: a
    thread block per row, a thread per score counting the scores above its own (its rank; equal
    scores: the lower index first), then a thread per chosen slot picking the index of its rank
    and its weight. Indices stay in [0, E) whatever the scores (a NaN gives ranks that collide:
    its slot reads index 0, never one out of range). nn/moe.choose_experts, and the indexer's
    selection over few rows (nn/attention.indexer_select). bind=False: the same loops serial."""
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda: T.thread_binding(E, thread="threadIdx.x")) if bind else (lambda: T.serial(E))

    def score(x, bias, t, e):
        return x[t, e] + bias[e] if biased else x[t, e]

    def weight(chosen, total):
        return _route_weight(chosen, total, denominator, scale)

    @T.prim_func(private=True)
    def choose(x_h: T.handle, bias: T.Buffer((E if biased else 1,), "float32"), out_h: T.handle, w_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        n = T.int64()
        x = T.match_buffer(x_h, (n, E), "float32")
        out = T.match_buffer(out_h, (n, k), "int32")
        wt = T.match_buffer(w_h, (n, k), "float32")
        for t in blocks(n):
            rank = T.alloc_buffer((E,), "int32", scope="shared")
            chosen = T.alloc_buffer((k,), "int32", scope="shared")
            above = T.alloc_buffer((1,), "int32", scope="local")
            total = T.alloc_buffer((1,), "float32", scope="local")
            for e in threads():
                above[0] = 0
                for o in range(E):
                    if score(x, bias, t, o) > score(x, bias, t, e) or (
                            score(x, bias, t, o) == score(x, bias, t, e) and o < e):
                        above[0] = above[0] + 1
                rank[e] = above[0]
            for j in threads():
                if j < k:
                    chosen[j] = 0
                    for e in range(E):
                        above[0] = rank[e]   # a register: the sync planner reads no shared memory in conditions
                        if above[0] == j:
                            chosen[j] = e
                    out[t, j] = chosen[j]
            for j in threads():   # each slot sums the chosen scores in slot order, as route_weights
                if j < k:
                    total[0] = T.float32(0)
                    for i in range(k):
                        total[0] = total[0] + x[t, chosen[i]]
                    wt[t, j] = weight(x[t, chosen[j]], total[0])
    return hand_kernel(choose)


def _route_weight(chosen, total, denominator, scale: float):
    """nn/moe.route_weights' expression of one chosen score given the sum of the chosen."""
    w = chosen if denominator is None else chosen / denominator(total)
    return w if scale == 1.0 else w * T.float32(scale)


@functools.lru_cache(maxsize=None)
def table_experts(E: int, V: int, k: int, denominator=None, scale: float = 1.0, bind: bool = True):
    """The experts of each token's row of a token-id table (DeepSeek-V4's hash layers) and their
    weights (route_weights' expressions) as one kernel, where the gather and the weights were two:
    a thread block per token, a thread per slot. The table's values were checked in [0, E) at
    load (gguf/validate.py), the token ids before the call. bind=False: the same loops serial."""
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda: T.thread_binding(k, thread="threadIdx.x")) if bind else (lambda: T.serial(k))

    @T.prim_func(private=True)
    def hashed(x_h: T.handle, table: T.Buffer((V, k), "int32"), ids_h: T.handle, out_h: T.handle, w_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        n = T.int64()
        x = T.match_buffer(x_h, (n, E), "float32")
        ids = T.match_buffer(ids_h, (n,), "int32")
        out = T.match_buffer(out_h, (n, k), "int32")
        wt = T.match_buffer(w_h, (n, k), "float32")
        for t in blocks(n):
            total = T.alloc_buffer((1,), "float32", scope="local")
            for j in threads():   # each slot sums the chosen scores in slot order, as route_weights
                out[t, j] = table[ids[t], j]
                total[0] = T.float32(0)
                for i in range(k):
                    total[0] = total[0] + x[t, table[ids[t], i]]
                wt[t, j] = _route_weight(x[t, table[ids[t], j]], total[0], denominator, scale)
    return hand_kernel(hashed)


@functools.lru_cache(maxsize=None)
def rms_rope_fp8(D: int, n_rot: int, eps: float, weighted: bool, offset: int, stride: int, bind: bool = True):
    """fp8_round_rows(rope(rms(x, eps, w), ...), D - n_rot) of rows x [n, D] as one kernel: a
    thread block per row sums its squares by a tree over the threads, each thread normalizes and
    rotates a channel pair into shared memory, a thread per block of 64 channels finds its
    largest magnitude, and each thread writes its pair rounded. The same expressions as the three
    kernels (nn/norm_rope.py, nn/rounding.py). bind=False: the same loops serial."""

    NT, lo = THREADS, D - n_rot
    pairs, n_blocks = D // 2, (lo + 63) // 64
    assert D % 2 == 0 and lo % 2 == 0 and n_blocks <= NT
    per_thread, pair_steps, rounds = (D + NT - 1) // NT, (pairs + NT - 1) // NT, NT.bit_length() - 1
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda: T.thread_binding(NT, thread="threadIdx.x")) if bind else (lambda: T.serial(NT))

    def normed(x, w, red, t, d):
        y = x[t, d] / T.sqrt(red[0] / T.float32(D) + T.float32(eps))
        return y * w[d] if weighted else y

    def theta(fr, start, t, d):
        pos = start + t if stride == 1 else (start // stride + t) * stride
        return (pos + offset).astype("float32") * fr[(d - lo) // 2]

    @T.prim_func(private=True)
    def main(x_h: T.handle, fr: T.Buffer((n_rot // 2,), "float32"), start: T.int64,
             w: T.Buffer((D if weighted else 1,), "float32"), out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": OPAQUE})
        n = T.int64()
        x = T.match_buffer(x_h, (n, D), "float32")
        out = T.match_buffer(out_h, (n, D), "float32")
        for t in blocks(n):
            red = T.alloc_buffer((NT,), "float32", scope="shared")
            y = T.alloc_buffer((D,), "float32", scope="shared")
            amax = T.alloc_buffer((n_blocks,), "float32", scope="shared")
            big = T.alloc_buffer((1,), "float32", scope="local")
            for tx in threads():
                red[tx] = T.float32(0)
                for i in range(per_thread):
                    if i * NT + tx < D:
                        red[tx] = red[tx] + x[t, i * NT + tx] * x[t, i * NT + tx]
            for k in T.unroll(rounds):
                for tx in threads():
                    if tx < T.shift_right(NT // 2, k):
                        red[tx] = red[tx] + red[tx + T.shift_right(NT // 2, k)]
            for tx in threads():
                for i in range(pair_steps):
                    if i * NT + tx < pairs:
                        if 2 * (i * NT + tx) >= lo:
                            y[2 * (i * NT + tx)] = normed(x, w, red, t, 2 * (i * NT + tx)) * T.cos(
                                theta(fr, start, t, 2 * (i * NT + tx))) - normed(x, w, red, t, 2 * (i * NT + tx) + 1) \
                                * T.sin(theta(fr, start, t, 2 * (i * NT + tx)))
                            y[2 * (i * NT + tx) + 1] = normed(x, w, red, t, 2 * (i * NT + tx)) * T.sin(
                                theta(fr, start, t, 2 * (i * NT + tx))) + normed(x, w, red, t, 2 * (i * NT + tx) + 1) \
                                * T.cos(theta(fr, start, t, 2 * (i * NT + tx)))
                        else:
                            y[2 * (i * NT + tx)] = normed(x, w, red, t, 2 * (i * NT + tx))
                            y[2 * (i * NT + tx) + 1] = normed(x, w, red, t, 2 * (i * NT + tx) + 1)
            for tx in threads():
                if tx < n_blocks:
                    big[0] = T.float32(0)
                    for j in range(64):
                        if tx * 64 + j < lo:
                            big[0] = T.max(big[0], T.abs(y[tx * 64 + j]))
                    amax[tx] = big[0]
            for tx in threads():
                for i in range(per_thread):
                    if i * NT + tx < lo:
                        big[0] = amax[(i * NT + tx) // 64]   # a register: the rounding's conditions read it
                        out[t, i * NT + tx] = round_minifloat(y[i * NT + tx] / pow2_ceil_scale(big[0], 448.0), 3, -6,
                                                               448.0) * pow2_ceil_scale(big[0], 448.0)
                    elif i * NT + tx < D:
                        out[t, i * NT + tx] = y[i * NT + tx]
    return hand_kernel(main)
