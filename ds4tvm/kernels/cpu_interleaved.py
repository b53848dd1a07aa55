"""Q8_0 linears on CPUs with AVX-512 VNNI, their weights laid out 16 rows interleaved (the way
ik_llama.cpp repacks its weights at load; our own kernels): one vpdpbusd multiplies 4 weights of
each of 16 rows by the same 4 inputs, broadcast, so a 32-weight block of 16 rows is 8 dot
products into one vector of 16 int32 sums, converted and scaled once, where kernels/cpu.py's int8
kernel spends a conversion, a multiply and a multiply-add per 64 weights of one row and then sums
16 lanes per output. Its planes (gguf/quant.INTERLEAVED, derived at load from the file's, in
place of the row-major ones): per 16-row group the codes made unsigned (+128), 4 bytes of each
row in turn, and the fp16 scales, one per row per block in turn. The inputs are quantized as
kernels/cpu_int8.py quantizes them (gguf's Q8_0 rounding); each block's sum starts at -128 times
the sum of its input codes, which takes the +128 of the codes back out, exactly.

One kernel serves every token count of a linear (decode, a batched decode, verify, prefill): a
row's sum is its blocks' exact int32 dot products, each converted and scaled in block order, so a
token's outputs do not depend on the tokens beside it, bit for bit. Tokens go in blocks of TB
(their accumulators and int32 sums in registers, each weight vector loaded once for all), the
leftovers in blocks of 4, 2 and 1; one or two tokens keep two chains of dot products so the
instruction's latency does not bound a decode.

benchmarks/int8_interleaved.py times it against kernels/cpu.py's int8 kernel.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as QT
from tvm import tirx
from tvm.script import tirx as T

from ..gguf.quant import INTERLEAVE_ROWS
from . import cpu_int8
from .cpu import _parallel, _parsed_once, _row_of_2d, _sort_by_expert
from .cpu_int8 import _bc, _vec

F32 = "float32"
R = INTERLEAVE_ROWS   # rows per group: one int32 sum each in a 512-bit vector
BLOCK = 32            # weights per Q8_0 block, per input scale
TB = 8                # tokens per block of accumulators (2 x 8 of the 32 vector registers)


def takes(qtype: QT, shape: tuple, forms) -> bool:
    """Whether a weight of this format and numpy shape is laid out interleaved for `forms`: Q8_0
    rows in whole groups on a CPU whose int8 dot is AVX-512 VNNI's."""
    c = forms.cpu_linears
    return (c is not None and c.interleaved and c.int8_dot == cpu_int8.VPDPBUSD and qtype == QT.Q8_0 and len(shape) >= 2
            and shape[-2] % R == 0 and shape[-1] % BLOCK == 0)


def plane_shapes(shape: tuple) -> dict:
    """(shape, dtype) of the interleaved planes of a Q8_0 weight of numpy shape (..., N, K)."""
    *lead, N, K = shape
    return {"d": ((*lead, N // R, R * K // BLOCK), "float16"), "qs": ((*lead, N // R, R * K), "uint8")}


def dequant(P, r, k):
    """Element (r..., k) of an interleaved weight as float32, as gguf dequantizes Q8_0 (d * q): for
    the TE kernels that read it otherwise (an embedding's rows)."""
    *lead, n = r
    g, i = n // R, n % R
    code = P["qs"][(*lead, g, k // 4 * (4 * R) + i * 4 + k % 4)].astype("int32") - 128
    return code.astype(F32) * P["d"][(*lead, g, k // BLOCK * R + i)].astype(F32)


def _ramp(start, n: int = R):
    return tirx.Ramp(start, 1, n)


@T.macro
def _quantize_row(x, x2, r, Kx, xq, DX, NS):
    amax = T.decl_buffer((1,), F32, scope="local")
    total = T.decl_buffer((1,), "int32", scope="local")
    for b in range(Kx // BLOCK):
        cpu_int8.block_codes(x, x2, r, b, xq, amax)
        DX[r, b] = amax[0] / T.float32(127)
        total[0] = 0
        for i in range(BLOCK):
            total[0] = total[0] + T.Cast("int32", xq[r, b * BLOCK + i])
        NS[r, b] = total[0] * -128


def quantizer(parallel: bool):
    """A macro quantize(x, x2, rows, Kx, xq, DX, NS): xq[r, k] the int8 codes of rows x2(x, r, k) in
    blocks of 32 (gguf's Q8_0 rounding), DX[r, b] block b's scale, NS[r, b] -128 times the sum of
    its codes; the rows on the cores for a prefill's hundreds, on the calling core for a few."""
    @T.macro
    def quantize(x, x2, rows, Kx, xq, DX, NS):
        if parallel:
            for r in T.parallel(rows):
                _quantize_row(x, x2, r, Kx, xq, DX, NS)
        else:
            for r in range(rows):
                _quantize_row(x, x2, r, Kx, xq, DX, NS)

    return quantize


def _chains(nt: int) -> int:
    """Independent chains of dot products per token: two for one or two tokens, whose 8 dot
    products per block would otherwise wait on each other."""
    return 2 if nt <= 2 else 1


def _block_sum(ia, t, nt: int):
    s = _vec(ia, (0, t), 0, R)
    return s + _vec(ia, (1, t), 0, R) if _chains(nt) == 2 else s


def _token_blocks(K: int, x_loc, w_group, y_at):
    """A macro blocks(first, count, g, x, y, ctx, ws) over token rows first .. first+count-1 of a
    list for row group g: x_loc(ctx, i, g) the quantized row of list entry i and its first input
    column, w_group(g) the group's leading plane indices, y_at(ctx, i, g) its 16 outputs' index
    (the last a Ramp); x = (xq as int32 words, DX, NS), ws = (scales, codes)."""
    KB = K // BLOCK

    def row(ctx, i, g):
        return x_loc(ctx, i, g)[0]

    def blk(ctx, i, g, kb):   # the input block of weight block kb
        return x_loc(ctx, i, g)[1] // BLOCK + kb

    def dot(acc, w, q):
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, w,
                                       tirx.reinterpret("int8x64", tirx.Broadcast(q, R)))

    @T.macro
    def micro(nt, i0, g, x, y, ctx, ws):
        acc = T.decl_buffer((nt, R), F32)   # global scope: in registers (kernels/cpu.py's docstring)
        ia = T.decl_buffer((_chains(nt), nt, R), "int32")
        for t in T.unroll(nt):
            T.buffer_store(acc, _bc(0.0, F32, R), [t, _ramp(0)])
        for kb in range(KB):
            for t in T.unroll(nt):
                T.buffer_store(ia, tirx.Broadcast(x[2][row(ctx, i0 + t, g), blk(ctx, i0 + t, g, kb)], R),
                               [0, t, _ramp(0)])
                if _chains(nt) == 2:
                    T.buffer_store(ia, _bc(0, "int32", R), [1, t, _ramp(0)])
            for j in T.unroll(8):
                w = T.bind(_vec(ws[1], w_group(g), kb * (BLOCK * R) + j * (4 * R), 4 * R))
                for t in T.unroll(nt):
                    T.buffer_store(ia, dot(_vec(ia, (j % _chains(nt), t), 0, R), w,
                                           x[0][row(ctx, i0 + t, g), blk(ctx, i0 + t, g, kb) * 8 + j]),
                                   [j % _chains(nt), t, _ramp(0)])
            S = T.bind(_vec(ws[0], w_group(g), kb * R, R).astype("float32x16"))
            for t in T.unroll(nt):
                T.buffer_store(acc, _vec(acc, (t,), 0, R) + _block_sum(ia, t, nt).astype("float32x16") * (
                    S * tirx.Broadcast(x[1][row(ctx, i0 + t, g), blk(ctx, i0 + t, g, kb)], R)), [t, _ramp(0)])
        for t in T.unroll(nt):
            T.buffer_store(y, _vec(acc, (t,), 0, R), y_at(ctx, i0 + t, g))

    @T.macro
    def blocks(first, count, g, x, y, ctx, ws):
        for b in range(count // TB):
            micro(TB, first + b * TB, g, x, y, ctx, ws)
        if count % TB >= 4:
            micro(4, first + count // TB * TB, g, x, y, ctx, ws)
        if count % TB % 4 >= 2:
            micro(2, first + count // TB * TB + count % TB // 4 * 4, g, x, y, ctx, ws)
        if count % 2 == 1:
            micro(1, first + count - 1, g, x, y, ctx, ws)

    return blocks


def supports(N: int, K: int, groups: int = 1) -> bool:
    return N % (R * groups) == 0 and K % BLOCK == 0


@_parsed_once
def dense_linear(N: int, K: int, threads: int, few: bool, groups: int = 1):
    """y[T, N] = x[T, G*K] @ W[N, K]^T for any T, output rows g*N/G .. reading x[:, g*K ..] (a
    grouped projection with G groups). few: a call of a few tokens (nn/state.few_rows), whose
    inputs are quantized on the calling core."""
    G, per_group = N // R, N // groups
    parallel = _parallel(threads, N, K)
    quantize = quantizer(threads > 1 and not few)

    def x_loc(_ctx, i, g):
        return i, g * R // per_group * K

    def y_at(_ctx, i, g):
        return [i, _ramp(g * R)]

    blocks = _token_blocks(K, x_loc, lambda g: (g,), y_at)
    width = groups * K

    @T.prim_func(private=True)
    def main(x_h: T.handle, d: T.Buffer((G, R * K // BLOCK), "float16"), qs: T.Buffer((G, R * K), "uint8"),
             y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, width), F32)
        y = T.match_buffer(y_h, (n_tok, N), F32)
        xq = T.decl_buffer((n_tok, width), "int8")
        words = T.decl_buffer((n_tok, width // 4), "int32", data=xq.data)
        DX = T.decl_buffer((n_tok, width // BLOCK), F32)
        NS = T.decl_buffer((n_tok, width // BLOCK), "int32")
        quantize(x, _row_of_2d, n_tok, width, xq, DX, NS)
        if parallel:   # a contiguous run of groups per core: one sequential stream each
            for g in T.parallel(G):
                blocks(0, n_tok, g, (words, DX, NS), y, None, (d, qs))
        else:
            for g in T.serial(G):
                blocks(0, n_tok, g, (words, DX, NS), y, None, (d, qs))

    return main


@_parsed_once
def expert_linear(E: int, N: int, K: int, J: int, per_slot_input: bool, threads: int, few: bool):
    """y[T, J, N] = x[T, (J|1), K] @ W[ids[t, j], N, K]^T for any T: the (token, slot) pairs sorted
    by expert (kernels/cpu.py's counting sort), the row groups of the experts in use shared among
    the cores, a contiguous run each for a few tokens (every group then costs the same), dealt
    round-robin otherwise (balanced whatever the experts' token counts)."""
    NG, XJ = N // R, (J if per_slot_input else 1)
    parallel = _parallel(threads, N, K)
    quantize = quantizer(threads > 1 and not few)

    def x_loc(slots, i, _eg):   # the quantized inputs are x's rows flattened: [T * XJ, K]
        return slots[i] // J * XJ + (slots[i] % J if per_slot_input else 0), 0

    def y_at(slots, i, eg):
        return [slots[i] // J, slots[i] % J, _ramp(eg % NG * R)]

    def x_row(x, r, k):
        return x[r // XJ, r % XJ, k]

    blocks = _token_blocks(K, x_loc, lambda eg: (eg // NG, eg % NG), y_at)

    @T.macro
    def used_group(ug, x, y, slots, cnt, off, used, ws):
        blocks(off[used[ug // NG]], cnt[used[ug // NG]], used[ug // NG] * NG + ug % NG, x, y, slots, ws)

    @T.macro
    def groups(n_used, x, y, slots, cnt, off, used, ws):
        if parallel and few:
            for p in T.parallel(threads):
                for ug in range(p * n_used * NG // threads, (p + 1) * n_used * NG // threads):
                    used_group(ug, x, y, slots, cnt, off, used, ws)
        elif parallel:
            for p in T.parallel(threads):
                for i in range((n_used * NG - p + threads - 1) // threads):
                    used_group(p + i * threads, x, y, slots, cnt, off, used, ws)
        else:
            for ug in T.serial(n_used * NG):
                used_group(ug, x, y, slots, cnt, off, used, ws)

    @T.prim_func(private=True)
    def main(x_h: T.handle, ids_h: T.handle, d: T.Buffer((E, NG, R * K // BLOCK), "float16"),
             qs: T.Buffer((E, NG, R * K), "uint8"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, XJ, K), F32)
        ids = T.match_buffer(ids_h, (n_tok, J), "int32")
        y = T.match_buffer(y_h, (n_tok, J, N), F32)
        cnt = T.decl_buffer((E,), "int32")
        off = T.decl_buffer((E + 1,), "int32")
        fill = T.decl_buffer((E,), "int32")
        used = T.decl_buffer((E + 1,), "int32")   # the experts chosen at least once; their count last
        slots = T.decl_buffer((n_tok * J,), "int32")
        _sort_by_expert(ids, n_tok, J, E, cnt, off, fill, used, slots)
        n_used: T.int32 = used[E]
        xq = T.decl_buffer((n_tok * XJ, K), "int8")
        words = T.decl_buffer((n_tok * XJ, K // 4), "int32", data=xq.data)
        DX = T.decl_buffer((n_tok * XJ, K // BLOCK), F32)
        NS = T.decl_buffer((n_tok * XJ, K // BLOCK), "int32")
        quantize(x, x_row, n_tok * XJ, K, xq, DX, NS)
        groups(n_used, (words, DX, NS), y, slots, cnt, off, used, (d, qs))

    return main
