"""Hand-written CPU kernels for the quantized linears of formats with one or two planes (F32, F16,
BF16, Q8_0), written in TVMScript because their register blocking is beyond the TE schedules in
schedules/llvm.py (which keep the other formats).

The core is a micro-kernel of TB tokens x NR output rows whose TB*NR accumulators are 16-lane
vectors of partial sums over k, folded 16->8->4->2->1 at the end: 24 of the 32 AVX-512 registers,
each weight vector loaded once for TB tokens and each token vector once for NR rows. Output rows
go in tiles of RB; with fewer than HT tokens (decode, verify) a tile's weights are dequantized in
registers inside the micro-kernel; with more (prefill) the tile is dequantized once into a
[RB, K] buffer (32 KB at K = 512) that every token block reads. Leftover tokens run 4-, 2- and 1-token
variants of the same core, so they still share each weight vector.

Routed experts sort the (token, slot) pairs by expert first (a counting sort in the kernel), then
run the same tiles per expert over that expert's slots only: an expert used by 30 tokens of a
prefill is read and dequantized once instead of 30 times, and experts nobody chose cost nothing.

On the 127M benchmark model's shapes (2 threads, side by side with the TE schedules): dense
1.1-3.8x faster at every token count from 1 to 128, experts 1.2-1.4x at 6 tokens and 2.5-4x at
64-128 (slower at one token, so decode keeps the TE kernel). BENCHMARKS.md has the model numbers.
"""

from __future__ import annotations

import functools

from gguf import GGMLQuantizationType as QT
from tvm.script import tirx as T

from ..gguf.quant import plane_format
from .dequant import DEQUANT

RB, NR, TB, HT = 16, 4, 6, 12     # row tile, rows per micro-kernel, tokens per micro-kernel, tile threshold
PARALLEL_MIN_WEIGHTS = 1 << 16    # smaller linears run on one core (the pool's launch costs more)
PARALLEL_MIN_SLOTS = 64           # likewise for routed experts: (token, slot) pairs per call
FORMATS = (QT.F32, QT.F16, QT.BF16, QT.Q8_0)


def supports(qtype: QT, N: int, K: int, groups: int = 1) -> bool:
    return qtype in FORMATS and N % (RB * groups) == 0 and K % 32 == 0


def _parallel(threads: int, N: int, K: int) -> bool:
    return threads > 1 and N * K >= PARALLEL_MIN_WEIGHTS


def _planes(qtype: QT, lead: tuple, K: int) -> list[tuple[tuple, str]]:
    """(shape, dtype) of each plane, padded to two (the kernels take two plane arguments)."""
    out = [((*lead, f.per_row(K)), f.dtype) for f in plane_format(qtype).fields]
    return out + out[:1] * (2 - len(out))


def _dequant(qtype: QT):
    names = [f.name for f in plane_format(qtype).fields]
    deq = DEQUANT[qtype]
    return lambda r, k, p0, p1: deq(dict(zip(names, (p0, p1))), r, k)


@T.macro
def _zero(acc, nt):
    for t in T.unroll(nt):
        for n in T.unroll(NR):
            for lane in T.vectorized(16):
                acc[t, n, lane] = T.float32(0)


@T.macro
def _fold_to_two(acc, nt):
    """Each accumulator's 16 lanes summed in halves down to lanes 0 and 1 (16->8->4->2)."""
    for t in T.unroll(nt):
        for n in T.unroll(NR):
            for lane in T.vectorized(8):
                acc[t, n, lane] = acc[t, n, lane] + acc[t, n, lane + 8]
            for lane in T.vectorized(4):
                acc[t, n, lane] = acc[t, n, lane] + acc[t, n, lane + 4]
            for lane in T.vectorized(2):
                acc[t, n, lane] = acc[t, n, lane] + acc[t, n, lane + 2]


def _row_tiles(K: int, x_at, w_at, y_at):
    """The tiled product both kernels share, as a macro row_tile(first, count, tile, x, y, ctx,
    p0, p1): output rows tile*RB .. for the `count` token rows first .. first+count-1 of a list.
    The accessors, evaluated while parsing, say where those rows live: x_at(x, ctx, i, tile, k)
    the input of list entry i, y_at(ctx, i, tile, r) the output index of entry i and tile row r,
    w_at(inline, tile, r, k, wt, p0, p1) weight row r of the tile (dequantized, or from wt)."""
    KC = K // 16

    @T.macro
    def micro(inline, nt, i0, tile, rb, x, y, ctx, wt, p0, p1):
        acc = T.decl_buffer((nt, NR, 16), "float32", scope="local")
        _zero(acc, nt)
        for kc in range(KC):
            for t in T.unroll(nt):
                for n in T.unroll(NR):
                    for lane in T.vectorized(16):
                        acc[t, n, lane] = acc[t, n, lane] + x_at(x, ctx, i0 + t, tile, kc * 16 + lane) * w_at(
                            inline, tile, rb * NR + n, kc * 16 + lane, wt, p0, p1)
        _fold_to_two(acc, nt)
        for t in T.unroll(nt):
            for n in T.unroll(NR):
                T.buffer_store(y, acc[t, n, 0] + acc[t, n, 1], y_at(ctx, i0 + t, tile, rb * NR + n))

    @T.macro
    def blocks(inline, first, count, tile, x, y, ctx, wt, p0, p1):
        for rb in range(RB // NR):
            for blk in range(count // TB):
                micro(inline, TB, first + blk * TB, tile, rb, x, y, ctx, wt, p0, p1)
            # the last count % TB rows in blocks of 4, 2, 1 (still sharing each weight vector)
            if count % TB >= 4:
                micro(inline, 4, first + count // TB * TB, tile, rb, x, y, ctx, wt, p0, p1)
            if count % TB % 4 >= 2:
                micro(inline, 2, first + count // TB * TB + count % TB // 4 * 4, tile, rb, x, y, ctx, wt, p0, p1)
            if count % TB % 2 == 1:
                micro(inline, 1, first + count - 1, tile, rb, x, y, ctx, wt, p0, p1)

    @T.macro
    def row_tile(first, count, tile, x, y, ctx, p0, p1):
        wt = T.decl_buffer((RB, K), "float32")
        if count >= HT:
            for r, kb in T.grid(RB, K // 32):
                for kl in T.vectorized(32):
                    wt[r, kb * 32 + kl] = w_at(True, tile, r, kb * 32 + kl, wt, p0, p1)
            blocks(False, first, count, tile, x, y, ctx, wt, p0, p1)
        else:
            blocks(True, first, count, tile, x, y, ctx, wt, p0, p1)

    return row_tile


@functools.lru_cache(maxsize=None)   # one PrimFunc per shape, shared by the layers
def dense_linear(qtype: QT, N: int, K: int, threads: int, groups: int = 1):
    """y[T, N] = x[T, K] @ W[N, K]^T for any T. With groups G, x is [T, G*K] and output rows
    g*N/G .. (g+1)*N/G read x[:, g*K : (g+1)*K] (a grouped projection)."""
    parallel = _parallel(threads, N, K)
    deq = _dequant(qtype)
    rows_per_group = N // groups
    (s0, d0), (s1, d1) = _planes(qtype, (N,), K)

    def x_at(x, _ctx, i, rt, k):   # a tile's input columns are its group's slice of x
        return x[i, rt * RB // rows_per_group * K + k]

    def w_at(inline, rt, r, k, wt, p0, p1):
        return deq((rt * RB + r,), k, p0, p1) if inline else wt[r, k]

    def y_at(_ctx, i, rt, r):
        return [i, rt * RB + r]

    row_tile = _row_tiles(K, x_at, w_at, y_at)

    @T.prim_func(private=True)
    def main(x_h: T.handle, p0: T.Buffer(s0, d0), p1: T.Buffer(s1, d1), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, groups * K), "float32")
        y = T.match_buffer(y_h, (n_tok, N), "float32")
        if parallel:
            for rt in T.parallel(N // RB):
                row_tile(0, n_tok, rt, x, y, x, p0, p1)
        else:
            for rt in T.serial(N // RB):
                row_tile(0, n_tok, rt, x, y, x, p0, p1)

    return main


@functools.lru_cache(maxsize=None)
def expert_linear(qtype: QT, E: int, N: int, K: int, J: int, per_slot_input: bool, threads: int):
    """y[T, J, N] = x[T, (J|1), K] @ W[ids[t, j], N, K]^T for any T, grouped by expert: tile et is
    expert et // NT, rows et % NT * RB .., over the expert's entries of the sorted slot list."""
    deq = _dequant(qtype)
    parallel = _parallel(threads, N, K)   # per expert; calls with few slots also stay on one core
    (s0, d0), (s1, d1) = _planes(qtype, (E, N), K)
    NT, XJ = N // RB, (J if per_slot_input else 1)

    def x_at(x, slots, i, _et, k):
        return x[slots[i] // J, slots[i] % J if per_slot_input else 0, k]

    def w_at(inline, et, r, k, wt, p0, p1):
        return deq((et // NT, et % NT * RB + r), k, p0, p1) if inline else wt[r, k]

    def y_at(slots, i, et, r):
        return [slots[i] // J, slots[i] % J, et % NT * RB + r]

    row_tile = _row_tiles(K, x_at, w_at, y_at)

    @T.macro
    def expert_tile(et, x, y, slots, cnt, off, p0, p1):
        if cnt[et // NT] > 0:   # experts nobody chose cost nothing
            row_tile(off[et // NT], cnt[et // NT], et, x, y, slots, p0, p1)

    @T.prim_func(private=True)
    def main(x_h: T.handle, ids_h: T.handle, p0: T.Buffer(s0, d0), p1: T.Buffer(s1, d1), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, XJ, K), "float32")
        ids = T.match_buffer(ids_h, (n_tok, J), "int32")
        y = T.match_buffer(y_h, (n_tok, J, N), "float32")
        cnt = T.decl_buffer((E,), "int32")
        off = T.decl_buffer((E + 1,), "int32")
        fill = T.decl_buffer((E,), "int32")
        slots = T.decl_buffer((n_tok * J,), "int32")
        # counting sort of the (token, slot) pairs by expert: slots[off[e] .. off[e] + cnt[e]]
        for e in range(E):
            cnt[e] = 0
        for s in range(n_tok * J):
            cnt[ids[s // J, s % J]] = cnt[ids[s // J, s % J]] + 1
        off[0] = 0
        for e in range(E):
            off[e + 1] = off[e] + cnt[e]
            fill[e] = off[e]
        for s in range(n_tok * J):
            slots[fill[ids[s // J, s % J]]] = s
            fill[ids[s // J, s % J]] = fill[ids[s // J, s % J]] + 1
        if parallel and n_tok * J >= PARALLEL_MIN_SLOTS:
            for et in T.parallel(E * NT):
                expert_tile(et, x, y, slots, cnt, off, p0, p1)
        else:
            for et in T.serial(E * NT):
                expert_tile(et, x, y, slots, cnt, off, p0, p1)

    return main
