"""GPU forms of the routed-expert linears (../shared/reference/gpu-guide.md §1): the "blockized"
GEMV that dlight's GEMV rule schedules, as MLC-LLM writes its MoE GEMVs. One (token, slot) pair per
`blockIdx.y`; inside it an outer block reads the pair's expert id once, a `dequantize` block turns
that expert's rows into float32 (inlined by the rule into the product: no fp32 weight is written)
and a `gemv` block reduces over K. The expert's planes are read straight from the weight arguments
with nn/dequant.py's expressions, the same float operations as every other path."""

from __future__ import annotations

import functools
import math

from gguf import GGMLQuantizationType as QT
from tvm.script import tirx as T

from .cpu_kernels import _arg_types, _dequant

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
    a = _arg_types(qtype, (E, N), K, False)
    deq = _dequant(qtype)
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


MAX_SLOTS = 4096   # a block keeps its slots' scores in shared memory: 16 KB
THREADS = 256


@functools.lru_cache(maxsize=None)
def window_attention(H: int, D: int, ring_shape: tuple, before: int, comp_shape: tuple | None, sel_width: int | None,
                     window: int, ratio: int, n_rot: int, bind: bool = True):
    """nn/blocks.sparse_window_attention as one kernel, its context rows read in place from the
    ring (nn/state.RingRows): a thread block per (token, head) keeps its slots' scores in shared
    memory; each thread scores slots (the dot over D in order, as the TE form), max and sum run as
    tree reductions over the threads, then each thread sums its output channel pair over the slots
    in order and, with n_rot, rotates it back by RoPE at the token's position. bind=False: the same
    loops serial (a CPU runs them: the numerics check of the GPU forms)."""
    from .blocks import NEG_INF, _window_slots   # blocks imports this module
    from .state import context_row

    size, width = ring_shape
    has_comp, use_sel = comp_shape is not None, sel_width is not None
    CR, CW = comp_shape if has_comp else (1, 1)
    MS = sel_width if use_sel else 1
    A = window + (sel_width if use_sel else CR if has_comp else 0)
    NT, lo = THREADS, (D - n_rot if n_rot else D)   # channels from lo on are rotated back
    assert D % 2 == 0 and lo % 2 == 0 and NT & (NT - 1) == 0
    per_thread, pair_steps, scale = (A + NT - 1) // NT, (D // 2 + NT - 1) // NT, 1.0 / math.sqrt(D)
    rounds = NT.bit_length() - 1   # of the tree reductions: strides NT/2 .. 1
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda: T.thread_binding(NT, thread="threadIdx.x")) if bind else (lambda: T.serial(NT))

    def slots(ring, new, comp, sel, s):
        return _window_slots(context_row(ring, new, s, before), new.shape[0] + before, comp if has_comp else None,
                             sel if use_sel else None, s, window, ratio)

    def key(ring, new, comp, sel, s, t, a, d):
        return slots(ring, new, comp, sel, s)[2](t, a, d)

    def valid(ring, new, comp, sel, s, t, a):
        return slots(ring, new, comp, sel, s)[1](t, a)

    def rotated(x0, x1, pos, j, odd: bool):   # rope(..., inverse=True) of the pair (x0, x1)
        c, s = T.cos(pos.astype("float32") * j), -T.sin(pos.astype("float32") * j)
        return x0 * s + x1 * c if odd else x0 * c - x1 * s

    @T.prim_func(private=True)
    def main(q_h: T.handle, ring_h: T.handle, new_h: T.handle, sinks: T.Buffer((H,), "float32"), start: T.int64,
             fr_h: T.handle, comp_h: T.handle, sel_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
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
            red = T.alloc_buffer((NT,), "float32", scope="shared")
            stat = T.alloc_buffer((2,), "float32", scope="shared")
            acc = T.alloc_buffer((2,), "float32", scope="local")
            for tx in threads():
                red[tx] = T.float32(NEG_INF)
                for i in range(per_thread):
                    if i * NT + tx < A:
                        acc[0] = T.float32(0)
                        for d in range(D):
                            acc[0] = acc[0] + Q[th // H, th % H, d] * key(Ring, New, Comp, Sel, start, th // H,
                                                                            i * NT + tx, d)
                        score[i * NT + tx] = T.if_then_else(valid(Ring, New, Comp, Sel, start, th // H, i * NT + tx),
                                                            acc[0] * T.float32(scale), T.float32(NEG_INF))
                        red[tx] = T.max(red[tx], score[i * NT + tx])
            for k in T.unroll(rounds):
                for tx in threads():
                    if tx < T.shift_right(NT // 2, k):
                        red[tx] = T.max(red[tx], red[tx + T.shift_right(NT // 2, k)])
            for tx in threads():
                if tx == 0:
                    stat[0] = T.max(red[0], sinks[th % H])
            for tx in threads():
                red[tx] = T.float32(0)
                for i in range(per_thread):
                    if i * NT + tx < A:
                        score[i * NT + tx] = T.if_then_else(valid(Ring, New, Comp, Sel, start, th // H, i * NT + tx),
                                                            T.exp(score[i * NT + tx] - stat[0]), T.float32(0))
                        red[tx] = red[tx] + score[i * NT + tx]
            for k in T.unroll(rounds):
                for tx in threads():
                    if tx < T.shift_right(NT // 2, k):
                        red[tx] = red[tx] + red[tx + T.shift_right(NT // 2, k)]
            for tx in threads():
                if tx == 0:
                    stat[1] = red[0] + T.exp(sinks[th % H] - stat[0])
            for tx in threads():
                for i in range(pair_steps):
                    if i * NT + tx < D // 2:
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        for a in range(A):
                            acc[0] = acc[0] + score[a] * key(Ring, New, Comp, Sel, start, th // H, a, 2 * (i * NT + tx))
                            acc[1] = acc[1] + score[a] * key(Ring, New, Comp, Sel, start, th // H, a,
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

    return main
