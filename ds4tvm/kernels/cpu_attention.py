"""The window attention of DeepSeek-V4 (nn/attention.sparse_window_attention) written for the CPU:
one token at a time, all its heads, over its slots (kernels/slots.window_slots: the raw window's
context rows, then the compressed rows it sees, all or those the indexer chose), with one learned
sink logit per head in the denominator and the keys as values. A slot's key row is read once for
the scores of a block of heads (16-lane partial sums over the channels, then halved), and once
per 16 channels for the output, whose accumulators hold 16 channels of every head in the block;
the softmax runs 16 slots at a time, its e^x a polynomial (exp16). The TE form computed each
stage over all tokens apart (scores, maxima, weights, sums, output), reading each key row once
per head and stage: ~27 GFLOP/s for a 512-token prefill.

Every call of a build with int8 inputs (decode, a batched decode's sequences, verify, prefill)
runs this kernel, a token's outputs computed alone in the same operations, so a token gets the
same outputs bit for bit whatever the tokens beside it (the rollback and identity tests rely on
it). Prefill and verify put tokens on the cores; decode's one token puts its blocks of heads on
the cores where it has several (the real model's 64 heads), or stays on the calling core.
Its sums run in another order than the TE form's and its e^x is not expf (within ~4e-7 of it,
tests/unit/test_kernels.py: 2e-6 of the largest output): the float build
(`--float-activations`, the numerics the oracle tests compare) keeps the TE form and its logits,
bit for bit.

Also the indexer's scores (indexer_scores), for DeepSeek-V4's, GLM-5.3's and Qwen3.8's indexers in
every CPU build.
"""

from __future__ import annotations

import functools
import math

from tvm import tirx
from tvm.script import tirx as T

from . import cpu_int8
from .cpu import lane_sum
from .slots import NEG_INF

F32 = "float32"
L = 16          # lanes of the vectors: one AVX-512 register, two AVX2 ones
HB = 8          # heads per block of output accumulators


def _vec(buf, lead: tuple, start):
    return cpu_int8._vec(buf, lead, start, L)


def _slots(window: int, ratio: int, C: int, use_sel: bool):
    """(in_window(t, a, s, R), compressed(t, a, s, sel)) of kernels/slots.window_slots' slots: each
    (whether slot a is visible to token t at position s + t, its key row), of ctx for the window's
    slots (a < window), of comp for the others."""
    def in_window(t, a, s, R):
        return s + t - window + 1 + a.astype("int64") >= 0, tirx.min(t + a.astype("int64"), R - 1)

    def compressed(t, a, s, sel):
        c = sel[t, a - window].astype("int64") if use_sel else (a - window).astype("int64")
        return c < tirx.floordiv(s + t + 1, ratio), tirx.max(tirx.min(c, C - 1), 0)

    return in_window, compressed


def _lanes(lead):
    return [*lead, tirx.Ramp(0, 1, L)]


def _bc(value):
    return tirx.Broadcast(T.float32(value), L)


def exp16(x):
    """e^x on 16 lanes (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n; within
    2 ulp of expf), for x <= 0: scalar expf calls were most of a token's time (~1,500 a layer).
    Below -88.38 (weights < 1e-38 of the largest) it gives 0."""
    x = T.max(x, _bc(-88.3762626647949))
    n = T.floor(x * _bc(1.44269504088896341) + _bc(0.5))
    r = x - n * _bc(0.693359375) - n * _bc(-2.12194440e-4)
    p = _bc(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + _bc(c)
    two_n = tirx.reinterpret(f"float32x{L}", (T.Cast(f"int32x{L}", n) + tirx.Broadcast(T.int32(127), L))
                             << tirx.Broadcast(T.int32(23), L))
    return (p * (r * r) + r + _bc(1.0)) * two_n


def _stages(H: int, D: int, AP: int):
    """The macros (scores, weighted, softmax) of a block of min(HB, H) heads over AP slots (A padded
    to whole vectors)."""
    HBk, scale = min(HB, H), 1.0 / math.sqrt(D)

    @T.macro
    def scores(t, q, keys, a, hb, sc, rows, ok, acc):   # a block of heads' scores: one read of each key chunk
        if ok[a] == 0:
            for i in T.unroll(HBk):
                sc[hb * HBk + i, a] = T.float32(NEG_INF)
        else:
            for i in T.unroll(HBk):
                T.buffer_store(acc, _bc(0), _lanes((i,)))
            for ko in T.unroll(D // L):
                k = T.bind(_vec(keys, (rows[a],), ko * L))
                for i in T.unroll(HBk):
                    T.buffer_store(acc, _vec(acc, (i,), 0) + _vec(q, (t, hb * HBk + i), ko * L) * k, _lanes((i,)))
            for i in T.unroll(HBk):
                sc[hb * HBk + i, a] = lane_sum(_vec(acc, (i,), 0)) * T.float32(scale)

    @T.macro
    def weighted(keys, a, hb, dc, sc, rows, ok, acc):
        if ok[a] != 0:
            k = T.bind(_vec(keys, (rows[a],), dc * L))
            for i in T.unroll(HBk):
                T.buffer_store(acc, _vec(acc, (i,), 0) + tirx.Broadcast(sc[hb * HBk + i, a], L) * k, _lanes((i,)))

    @T.macro
    def softmax(h, sinks, sc, ok, stat, acc):   # 16 slots at a time
        T.buffer_store(acc, _vec(sc, (h,), 0), _lanes((0,)))
        for c in range(1, AP // L):
            T.buffer_store(acc, T.max(_vec(acc, (0,), 0), _vec(sc, (h,), c * L)), _lanes((0,)))
        stat[0, h] = T.max(sinks[h], cpu_int8.lanes_reduced(_vec(acc, (0,), 0), T.max))
        T.buffer_store(acc, _bc(0), _lanes((0,)))
        for c in range(AP // L):
            T.buffer_store(sc, tirx.Select(_vec(ok, (), c * L) != tirx.Broadcast(T.int32(0), L),
                                           exp16(_vec(sc, (h,), c * L) - tirx.Broadcast(stat[0, h], L)), _bc(0)),
                           [h, tirx.Ramp(c * L, 1, L)])
            T.buffer_store(acc, _vec(acc, (0,), 0) + _vec(sc, (h,), c * L), _lanes((0,)))
        stat[1, h] = T.exp(sinks[h] - stat[0, h]) + lane_sum(_vec(acc, (0,), 0))

    return scores, weighted, softmax


def _token(H: int, D: int, A: int, window: int, slots, split: bool):
    """A macro token(t, s, q, ctx, sinks, comp, sel, out, R): token t's outputs, all heads, a block
    of heads after another, or split: the blocks on the cores. Slots below `window` read ctx, the
    others comp: a loop over each. A head's sums are the same either way."""
    in_window, compressed = slots
    HBk, AP, W0 = min(HB, H), -(-A // L) * L, min(window, A)   # slots padded to whole vectors
    scores, weighted, softmax = _stages(H, D, AP)

    @T.macro
    def heads(t, hb, q, ctx, sinks, comp, out, sc, rows, ok, stat):   # block hb of the heads, from scores to output
        acc = T.decl_buffer((HBk, L), F32)
        for a in range(W0):
            scores(t, q, ctx, a, hb, sc, rows, ok, acc)
        for a in range(W0, A):
            scores(t, q, comp, a, hb, sc, rows, ok, acc)
        for i in range(HBk):
            softmax(hb * HBk + i, sinks, sc, ok, stat, acc)
        for dc in range(D // L):
            for i in T.unroll(HBk):
                T.buffer_store(acc, _bc(0), _lanes((i,)))
            for a in range(W0):
                weighted(ctx, a, hb, dc, sc, rows, ok, acc)
            for a in range(W0, A):
                weighted(comp, a, hb, dc, sc, rows, ok, acc)
            for i in T.unroll(HBk):
                T.buffer_store(out, _vec(acc, (i,), 0) / tirx.Broadcast(stat[1, hb * HBk + i], L),
                               [t, hb * HBk + i, tirx.Ramp(dc * L, 1, L)])

    @T.macro
    def token(t, s, q, ctx, sinks, comp, sel, out, R):
        sc = T.decl_buffer((H, AP), F32)      # scores, then weights
        rows = T.decl_buffer((A,), "int64")
        ok = T.decl_buffer((AP,), "int32")
        stat = T.decl_buffer((2, H), F32)     # per head: maximum, then denominator
        for a in range(W0):
            ok[a] = T.Cast("int32", in_window(t, a, s, R)[0])
            rows[a] = in_window(t, a, s, R)[1]
        for a in range(W0, A):
            ok[a] = T.Cast("int32", compressed(t, a, s, sel)[0])
            rows[a] = compressed(t, a, s, sel)[1]
        for a in range(A, AP):
            ok[a] = 0
            for h in range(H):
                sc[h, a] = T.float32(NEG_INF)
        if split:
            for hb in T.parallel(H // HBk):
                heads(t, hb, q, ctx, sinks, comp, out, sc, rows, ok, stat)
        else:
            for hb in range(H // HBk):
                heads(t, hb, q, ctx, sinks, comp, out, sc, rows, ok, stat)

    return token


@functools.lru_cache(maxsize=None)
def window_attention(H: int, D: int, window: int, ratio: int, comp_rows: int | None, selected: int | None,
                     parallel: bool, split_heads: bool = False):
    """out[t, h] = sum over token t's slots a of softmax_a(q[t, h] . key_a / sqrt(D), with sink h)
    * key_a, for q [n, H, D], ctx [R, D] (as sparse_window_attention takes it: row j holds position
    start - window + 1 + j), sinks [H], start, comp [C, D] and sel [n, M] (the chosen compressed
    rows; None: all C in order; [1, 1] unread). comp_rows None: no compressed rows ([1, D] unread).
    parallel: the tokens on the cores (a prefill, verify); split_heads: each token's blocks of HB
    heads on the cores where there are several (a decode's one token; 192 slots of 128 channels on
    2 cores: 64 heads 80 -> 48 us, 32 heads 42 -> 36, 16 heads 21 -> 20; one block of 8 would be
    split in two for nothing: 12 us either way)."""
    has_comp, use_sel = comp_rows is not None, selected is not None
    A, C = window + ((selected if use_sel else comp_rows) if has_comp else 0), comp_rows or 1
    split = split_heads and not parallel and H >= 2 * HB
    token = _token(H, D, A, window, _slots(window, ratio, C, use_sel), split)

    @T.prim_func(private=True)
    def main(q_h: T.handle, ctx_h: T.handle, sinks: T.Buffer((H,), F32), s: T.int64, comp: T.Buffer((C, D), F32),
             sel_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n, R = T.int64(), T.int64()
        q = T.match_buffer(q_h, (n, H, D), F32)
        ctx = T.match_buffer(ctx_h, (R, D), F32)
        sel = T.match_buffer(sel_h, (n if use_sel else 1, selected or 1), "int32")
        out = T.match_buffer(out_h, (n, H, D), F32)
        if parallel:
            for t in T.parallel(n):
                token(t, s, q, ctx, sinks, comp, sel, out, R)
        else:
            for t in range(n):
                token(t, s, q, ctx, sinks, comp, sel, out, R)

    return main


def supports(H: int, D: int) -> bool:
    return D % L == 0 and H % min(HB, H) == 0


RB = 16           # rows of the indexer's table a block scores at once (one per lane)
SPLIT_ROWS = 256  # visible rows from which one token's scores are split over the cores


def indexer_supports(dim: int, rows: int) -> bool:
    return dim % L == 0 and rows % RB == 0


@functools.lru_cache(maxsize=None)
def indexer_scores(heads: int, dim: int, rows: int, ratio: int, threads: int):
    """S[t, c] = sum_h W[t, h] * relu(Q[t, h] . K[c]) for the rows c < (start + t + 1) // ratio
    visible to token t, NEG_INF for the others: nn/attention's indexer scores in the same
    operations (each dot 16 partial sums along contiguous channels, summed in lane order, the heads
    in order), bit for bit, with the lanes over 16 rows of the table instead of 16 channels of one:
    a block of rows is transposed once and scored for every head, where one row a head chained 16
    dependent adds. A decode's token splits its row blocks over the cores where SPLIT_ROWS or more
    are visible (a long context: the table grows a row every `ratio` tokens); several tokens (a
    prefill, verify) go on the cores a token each."""
    KO = dim // L

    @T.macro
    def block(t, cb, Q, W, K, S, vis):
        kt = T.decl_buffer((dim, RB), F32)       # the block's rows, transposed
        acc = T.decl_buffer((L, RB), F32)        # lane l's partial sums, for each of the RB rows
        tot = T.decl_buffer((2, RB), F32)        # the dot product, the weighted sum over heads
        for d in range(dim):
            for i in T.vectorized(RB):
                kt[d, i] = K[T.min(cb * RB + i, rows - 1), d]
        T.buffer_store(tot, _bc(0), [1, tirx.Ramp(0, 1, RB)])
        for h in range(heads):
            for lane in T.unroll(L):
                T.buffer_store(acc, _bc(0), _lanes((lane,)))
            for ko in range(KO):
                for lane in T.unroll(L):
                    T.buffer_store(acc, _vec(acc, (lane,), 0) + tirx.Broadcast(Q[t, h, ko * L + lane], RB)
                                   * _vec(kt, (ko * L + lane,), 0), _lanes((lane,)))
            T.buffer_store(tot, _bc(0), _lanes((0,)))
            for lane in T.unroll(L):
                T.buffer_store(tot, _vec(tot, (0,), 0) + _vec(acc, (lane,), 0), _lanes((0,)))
            T.buffer_store(tot, _vec(tot, (1,), 0) + tirx.Broadcast(W[t, h], RB) * T.max(_vec(tot, (0,), 0), _bc(0)),
                           _lanes((1,)))
        T.buffer_store(S, tirx.Select(tirx.Ramp(cb * RB, 1, RB) < tirx.Broadcast(vis, RB), _vec(tot, (1,), 0),
                                      _bc(NEG_INF)), [t, tirx.Ramp(cb * RB, 1, RB)])

    def visible(start, t):   # the table's rows token t sees
        return T.min(T.floordiv(start + t + 1, ratio), rows)

    def blocks(start, t):    # the blocks of RB rows holding them
        return T.floordiv(visible(start, t) + RB - 1, RB)

    @T.macro
    def token(t, start, Q, W, K, S, split):   # split: the row blocks on the cores
        if split:
            for cb in T.parallel(blocks(start, t)):
                block(t, cb, Q, W, K, S, visible(start, t))
        else:
            for cb in range(blocks(start, t)):
                block(t, cb, Q, W, K, S, visible(start, t))
        for c in range(blocks(start, t) * RB, rows):
            S[t, c] = T.float32(NEG_INF)

    @T.prim_func(private=True)
    def main(q_h: T.handle, w_h: T.handle, K: T.Buffer((rows, dim), F32), start: T.int64, s_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n = T.int64()
        Q = T.match_buffer(q_h, (n, heads, dim), F32)
        W = T.match_buffer(w_h, (n, heads), F32)
        S = T.match_buffer(s_h, (n, rows), F32)
        if threads > 1 and n > 1:
            for t in T.parallel(n):
                token(t, start, Q, W, K, S, False)
        elif threads > 1 and visible(start, 0) >= SPLIT_ROWS:
            token(0, start, Q, W, K, S, True)
        else:
            for t in range(n):
                token(t, start, Q, W, K, S, False)

    return main
