"""Linears on CPUs with AVX-512 VNNI whose weights are laid out 16 rows interleaved (the way
ik_llama.cpp repacks its weights at load; our own kernels), for Q8_0, Q4_K, Q2_K, IQ2_XXS and
MXFP4: one vpdpbusd multiplies 4 weights of each of 16 rows by the same 4 inputs, broadcast, so a
32-weight block of 16 rows is 8 dot products into one vector of 16 int32 sums, converted and
scaled once, where kernels/cpu.py's int8 kernel spends a conversion, a multiply and a
multiply-add per 64 weights of one row and then sums 16 lanes per output.

The planes (gguf/quant.INTERLEAVED, derived at load in place of the row-major ones) hold per
16-row group the codes of 4 weights of each row in turn, one 64-byte code vector per 4 weights:
Q8_0's bytes made unsigned (+128); the 4-bit codes two vectors to a run of 64 bytes, the second in
the high nibbles; Q2_K's four to a run; IQ2_XXS keeps its grid bytes and sign words (a row's 4
grid bytes one u32 lane) and gathers each grid entry's 8 codes for 8 rows at once from
kernels/cpu_int8's table of every (entry, sign pattern) pair. Every field of scales holds one
value of each row in turn. A format decodes a block's 8 code vectors and its scale S and offset M
per row (weight = S * code - M; Q2_K per half of the block, whose sums are kept apart); MXFP4
looks its codes up with vpshufb in its doubled e2m1 values + 128. The inputs are quantized as
kernels/cpu_int8.py quantizes them (gguf's Q8_0 rounding); a block's sum of a biased format (signed
codes + 128) starts at -128 times the sum of its input codes, which takes the bias back out,
exactly; Q4_K and Q2_K subtract M times the inputs' sum.

One kernel serves every token count of a linear (decode, a batched decode, verify, prefill): a
row's sum is its blocks' exact int32 dot products, each converted and scaled in block order, so a
token's outputs do not depend on the tokens beside it, bit for bit. Tokens go in blocks of TB
(their accumulators and int32 sums in registers, each weight vector decoded once for all), the
leftovers in blocks of 4, 2 and 1; one or two tokens keep two chains of dot products so the
instruction's latency does not bound a decode. The first token block of a group asks for the
lines of the blocks 8 ahead (_prefetcher), across the group's end into the next group's: a
decode streams its weights, and the hardware prefetcher alone stops at every page and group.

benchmarks/int8_interleaved.py times it against kernels/cpu.py's int8 kernel.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as QT
from tvm import tirx
from tvm.script import tirx as T

from ..gguf.quant import CRUMBS, INTERLEAVE_ROWS, INTERLEAVED_FIELDS, MXFP4_VALUES, NIBBLES, plane_format
from . import cpu_int8
from .cpu import _parallel, _parsed_once, _row_of_2d, _sort_by_expert, takes_int8
from .cpu_int8 import _bc, _e8m0_half, _vec
from .dequant import DEQUANT

F32 = "float32"
R = INTERLEAVE_ROWS   # rows per group: one int32 sum each in a 512-bit vector
BLOCK = 32            # weights per block: an input scale; Q8_0's, MXFP4's and an IQ2_XXS sub-block, a Q4_K sub-block
AHEAD = 8             # blocks a group's row is prefetched ahead (_prefetcher)
TB = 8                # tokens per block of accumulators (2 x 8 of the 32 vector registers)
FORMATS = tuple(INTERLEAVED_FIELDS)
BIASED = (QT.Q8_0, QT.MXFP4, QT.IQ2_XXS)   # signed codes stored or looked up + 128


def takes(qtype: QT, shape: tuple, forms) -> bool:
    """Whether a weight of this format and numpy shape is laid out interleaved for `forms`: rows in
    whole groups, inputs the int8 path takes (kernels/cpu.takes_int8: K in whole 256-weight blocks;
    narrower ones keep float inputs), on a CPU whose int8 dot is AVX-512 VNNI's."""
    c = forms.cpu_linears
    return (c is not None and c.interleaved and c.int8_dot == cpu_int8.VPDPBUSD and qtype in FORMATS
            and len(shape) >= 2 and shape[-2] % R == 0 and takes_int8(qtype, shape[-1], c.int8_dot))


def plane_shapes(qtype: QT, shape: tuple) -> dict:
    """name -> (shape, dtype) of the interleaved planes of a weight of numpy shape (..., N, K)."""
    *lead, N, K = shape
    return {f.name: ((*lead, N // R, R * f.per_row(K)), "uint8" if f.name == "qs" else f.dtype)
            for f in plane_format(qtype).fields}


class _RowMajor:
    """A row-major plane read from its interleaved one, element by element: what the TE kernels
    index (an embedding's rows), so they keep kernels/dequant.py's expressions and gguf's rounding."""

    def __init__(self, buf, qtype: QT, name: str):
        self.buf, self.qtype, self.name = buf, qtype, name
        self.unit = INTERLEAVED_FIELDS[qtype][name]

    def _code(self, lead, g, i, w):   # the code of weight w of row i of group g (4 or 2 bits)
        j, bits = w % BLOCK // 4, 4 if self.unit == NIBBLES else 2
        run, slot = (j % 4, j // 4) if self.unit == NIBBLES else (j // 4, j % 4)
        byte = self.buf[(*lead, g, w // BLOCK * (BLOCK * R * bits // 8) + run * (4 * R) + i * 4 + w % 4)]
        return (byte >> (slot * bits).astype("uint8")) & tirx.const((1 << bits) - 1, "uint8")

    def _packed(self, lead, g, i, c):   # byte c of a row's packed codes, in the file's order
        if self.unit == CRUMBS:   # Q2_K: 4 weights 32 apart per byte, per half of 128
            first = c // 64 * 256 + c % 64 // 32 * 128 + c % 32
            parts = [(first + q * 32, 2 * q) for q in range(4)]
        else:   # MXFP4: weights i, i + 16 per 32; Q4_K: i, i + 32 per 64
            per = 16 if self.qtype == QT.MXFP4 else 32
            first = c // per * (2 * per) + c % per
            parts = [(first, 0), (first + per, 4)]
        value = None
        for w, shift in parts:
            v = self._code(lead, g, i, w) << tirx.const(shift, "uint8")
            value = v if value is None else value | v
        return value

    def __getitem__(self, idx):
        *lead, n, c = idx
        g, i = n // R, n % R
        if self.unit in (NIBBLES, CRUMBS):
            return self._packed(lead, g, i, c)
        v = self.buf[(*lead, g, c // self.unit * (self.unit * R) + i * self.unit + c % self.unit)]
        if self.qtype == QT.Q8_0 and self.name == "qs":
            return (v.astype("int32") - 128).astype("int8")
        return v


def dequant_for(qtype: QT):
    """The TE kernels' element expression (kernels/dequant.py's, so gguf's float operations) over
    interleaved planes."""
    deq, fields = DEQUANT[qtype], INTERLEAVED_FIELDS[qtype]
    return lambda P, r, k: deq({name: _RowMajor(buf, qtype, name) if name in fields else buf
                                for name, buf in P.items()}, r, k)


def _ramp(start, n: int = R):
    return tirx.Ramp(start, 1, n)


def sums_of(qtype: QT) -> tuple[str, int]:
    """(dtype, inputs per value) of what a format needs of the inputs' code sums: -128 times the
    sum per block for the biased formats, whose block sums start there; the block's scale times
    the sum for Q4_K's offsets, per 16 inputs for Q2_K's."""
    return ("int32", BLOCK) if qtype in BIASED else (F32, 16 if qtype == QT.Q2_K else BLOCK)


def _quantize_row(qtype: QT):
    dtype, per = sums_of(qtype)

    @T.macro
    def quantize_row(x, x2, r, Kx, xq, DX, SUM):
        amax = T.decl_buffer((1,), F32, scope="local")
        for b in range(Kx // BLOCK):
            cpu_int8.block_codes(x, x2, r, b, xq, amax)
            DX[r, b] = amax[0] / T.float32(127)
            for h in range(BLOCK // per):
                total = cpu_int8.code_sum(xq, r, b * BLOCK + h * per, per)
                if dtype == "int32":
                    SUM[r, b] = total * -128
                else:
                    SUM[r, b * (BLOCK // per) + h] = DX[r, b] * T.Cast(F32, total)

    return quantize_row


def quantizer(qtype: QT, parallel: bool):
    """A macro quantize(x, x2, rows, Kx, xq, DX, SUM): xq[r, k] the int8 codes of rows x2(x, r, k)
    in blocks of 32 (gguf's Q8_0 rounding), DX[r, b] block b's scale, SUM what sums_of(qtype) says;
    the rows on the cores for a prefill's hundreds, on the calling core for a few."""
    return cpu_int8.quantizer(parallel, _quantize_row(qtype))


def _nibbles(P, grp, kb, j):
    """Code vector j (0..7) of block kb: the low or high nibbles of one 64-byte run."""
    v = _vec(P["qs"], grp, kb * (BLOCK * R // 2) + j % 4 * (4 * R), 4 * R)
    return (v >> tirx.Broadcast((j // 4 * 4).astype("uint8"), 4 * R)) & _bc(15, "uint8", 4 * R)


def _crumbs(P, grp, kb, j):
    """Code vector j (0..7) of block kb, 2 bits each: run j // 4 shifted by 2 * (j % 4)."""
    v = _vec(P["qs"], grp, kb * (BLOCK * R // 4) + j // 4 * (4 * R), 4 * R)
    return (v >> tirx.Broadcast((j % 4 * 2).astype("uint8"), 4 * R)) & _bc(3, "uint8", 4 * R)


def _q8_0(P, grp, kb, j):
    return _vec(P["qs"], grp, kb * (BLOCK * R) + j * (4 * R), 4 * R)


def _mxfp4(P, grp, kb, j):
    """The codes looked up in the doubled e2m1 values + 128 (vpshufb, within each 16-byte lane)."""
    table = tirx.reinterpret("int8x64", _vec(P["mxfp4_biased"], (), 0, 4 * R))
    return tirx.reinterpret("uint8x64", T.call_llvm_pure_intrin(
        "int8x64", "llvm.x86.avx512.pshuf.b.512", table, tirx.reinterpret("int8x64", _nibbles(P, grp, kb, j))))


def _iq2_xxs(P, grp, kb, j):
    """Code vector j of block kb: grid entry j // 2 of each row (its 4 grid bytes are one u32 lane,
    its sign patterns 7 bits each of its aux word) gathered from the table of every (grid entry,
    sign pattern) pair's 8 biased codes (kernels/cpu_int8.tables), 8 rows a gather, then the low
    or high 4 codes of each row's 8 (j % 2). LLVM computes the two gathers once for both halves."""
    m = (j // 2).astype("uint32")
    grid = tirx.reinterpret("uint32x16", _vec(P["grid"], grp, kb * (4 * R), 4 * R))
    signs = _vec(P["aux"], grp, kb * R, R)
    idx = ((grid >> tirx.Broadcast(m * 8, R)) & _bc(255, "uint32", R)) * _bc(128, "uint32", R) \
        + ((signs >> tirx.Broadcast(m * 7, R)) & _bc(127, "uint32", R))
    idx = idx.astype("int32x16")
    rows = [tirx.reinterpret("uint32x16", cpu_int8._gather_rows(P["iq2_codes"], tirx.Shuffle([idx], list(range(h, h + 8)))))
            for h in (0, 8)]
    low, high = (tirx.Shuffle(rows, [2 * i + half for i in range(R)]) for half in (0, 1))
    return tirx.reinterpret("uint8x64", tirx.Select(j % 2 == 0, low, high))


def _f32x16(v):
    return v.astype("float32x16")


def _iq2_xxs_scales(P, grp, kb):
    """gguf's d * (0.5 + the block's 4-bit scale) * 0.25, in its float operations."""
    top = (_vec(P["aux"], grp, kb * R, R) >> _bc(28, "uint32", R)).astype("float32x16")
    return [(_f32x16(_vec(P["d"], grp, kb // 8 * R, R)) * (_bc(0.5, F32, R) + top) * _bc(0.25, F32, R), None)]


def _q2_k_scales(P, grp, kb):
    """Per half of the block (16 weights, one scale byte each: scale low nibble, offset high)."""
    d, dmin = (_f32x16(_vec(P[n], grp, kb // 8 * R, R)) for n in ("d", "dmin"))
    sc = [_vec(P["sc"], grp, (kb * 2 + h) * R, R) for h in range(2)]
    return [(d * _f32x16(b & _bc(15, "uint8", R)), dmin * _f32x16(b >> _bc(4, "uint8", R))) for b in sc]


SCALES = {   # per part of a block (the whole block, or Q2_K's halves): (S, M), weight = S * code - M
    QT.Q8_0: lambda P, grp, kb: [(_f32x16(_vec(P["d"], grp, kb * R, R)), None)],
    QT.MXFP4: lambda P, grp, kb: [(_e8m0_half(_vec(P["e"], grp, kb * R, R)), None)],
    QT.Q4_K: lambda P, grp, kb: [(_f32x16(_vec(P["d"], grp, kb // 8 * R, R)) * _f32x16(_vec(P["sc"], grp, kb * R, R)),
                                  _f32x16(_vec(P["dmin"], grp, kb // 8 * R, R)) * _f32x16(_vec(P["mn"], grp, kb * R, R)))],
    QT.Q2_K: _q2_k_scales,
    QT.IQ2_XXS: _iq2_xxs_scales,
}
CODES = {QT.Q8_0: _q8_0, QT.MXFP4: _mxfp4, QT.Q4_K: _nibbles, QT.Q2_K: _crumbs, QT.IQ2_XXS: _iq2_xxs}


def tables(qtype: QT) -> dict:
    """The constants a format's decoder reads: MXFP4's doubled values + 128, once per 16-byte lane;
    IQ2_XXS's biased codes of every (grid entry, sign pattern) pair."""
    if qtype == QT.IQ2_XXS:
        return cpu_int8.tables(qtype, cpu_int8.VPDPBUSD)
    return {"mxfp4_biased": (np.tile(MXFP4_VALUES, 4).astype(np.int16) + 128).astype(np.uint8)} \
        if qtype == QT.MXFP4 else {}


def _chains(qtype: QT, nt: int) -> int:
    """Chains of dot products per token: Q2_K's two halves apart, and two for one or two tokens,
    whose 8 dot products per block would otherwise wait on each other."""
    return 2 if qtype == QT.Q2_K or nt <= 2 else 1


def _chain(qtype: QT, nt: int, j):
    return j // 4 if qtype == QT.Q2_K else j % _chains(qtype, nt)


class _Block:
    """The expressions of one block of a row group for one token: where its inputs are (x_loc(ctx,
    i, g): the quantized row of list entry i and its first input column), its dot products, and
    its int32 sums scaled into the token's accumulator."""

    def __init__(self, qtype: QT, x_loc):
        self.qtype, self.x_loc = qtype, x_loc
        self.biased, self.halves = qtype in BIASED, qtype == QT.Q2_K

    def row(self, ctx, i, g):
        return self.x_loc(ctx, i, g)[0]

    def blk(self, ctx, i, g, kb):   # the input block of weight block kb
        return self.x_loc(ctx, i, g)[1] // BLOCK + kb

    def input_sum(self, x, ctx, i, g, kb, part):   # sums_of's value for a part of the block (a half, or all)
        return x[2][self.row(ctx, i, g), self.blk(ctx, i, g, kb) * (2 if self.halves else 1) + part]

    def start(self, x, ctx, i, g, kb):   # a biased block's sum starts at -128 times its inputs' code sum
        return tirx.Broadcast(self.input_sum(x, ctx, i, g, kb, 0), R) if self.biased else _bc(0, "int32", R)

    def dot(self, acc, w, x, ctx, i, g, kb, j):   # acc + 4 codes of 16 rows times input j of the block
        q = x[0][self.row(ctx, i, g), self.blk(ctx, i, g, kb) * 8 + j]
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, w,
                                       tirx.reinterpret("int8x64", tirx.Broadcast(q, R)))

    def value(self, acc, ia, t, nt, parts, x, ctx, i, g, kb):
        """acc + over the parts of the block: S * DX * the int32 sum, less M * (DX * the inputs' sum)."""
        dx = tirx.Broadcast(x[1][self.row(ctx, i, g), self.blk(ctx, i, g, kb)], R)
        sums = [_vec(ia, (c, t), 0, R) for c in range(_chains(self.qtype, nt))]
        if not self.halves:
            sums = [functools.reduce(lambda a, b: a + b, sums)]
        v = acc
        for p, ((S, M), isum) in enumerate(zip(parts, sums)):
            v = v + isum.astype("float32x16") * (S * dx)
            if M is not None:
                v = v - M * tirx.Broadcast(self.input_sum(x, ctx, i, g, kb, p), R)
        return v


def _scaler(qtype: QT, parts, value):
    """A macro scaled(acc, ia, nt, i0, g, kb, x, ctx, ws): every token's block sums scaled into its
    accumulator, the block's scales (parts(ws, g, kb)) loaded and converted once for all."""
    @T.macro
    def scaled(acc, ia, nt, i0, g, kb, x, ctx, ws):
        if qtype == QT.Q2_K:
            S0 = T.bind(parts(ws, g, kb)[0][0])
            M0 = T.bind(parts(ws, g, kb)[0][1])
            S1 = T.bind(parts(ws, g, kb)[1][0])
            M1 = T.bind(parts(ws, g, kb)[1][1])
            for t in T.unroll(nt):
                T.buffer_store(acc, value(_vec(acc, (t,), 0, R), ia, t, nt, [(S0, M0), (S1, M1)], x, ctx, i0 + t, g, kb),
                               [t, _ramp(0)])
        elif qtype == QT.Q4_K:
            S = T.bind(parts(ws, g, kb)[0][0])
            M = T.bind(parts(ws, g, kb)[0][1])
            for t in T.unroll(nt):
                T.buffer_store(acc, value(_vec(acc, (t,), 0, R), ia, t, nt, [(S, M)], x, ctx, i0 + t, g, kb),
                               [t, _ramp(0)])
        else:
            S = T.bind(parts(ws, g, kb)[0][0])
            for t in T.unroll(nt):
                T.buffer_store(acc, value(_vec(acc, (t,), 0, R), ia, t, nt, [(S, None)], x, ctx, i0 + t, g, kb),
                               [t, _ramp(0)])

    return scaled


def _prefetcher(qtype: QT, K: int, w_group, n_groups: int):
    """A macro prefetch(ws, g, kb) asking for the cache lines of the format's largest plane AHEAD
    blocks past block kb of row group g, where the memory continues into the groups after it (a
    core's next ones, in the contiguous runs of the dense kernels and of few-token experts'), the
    last group's end not passed. The hardware prefetcher starts again at every 4 KB page and does
    not cross to the next group's rows; asked ahead, a decode of the benchmark model took 0.94 of
    its time, a batch of 8 0.87, verify(4) 0.79 (BENCHMARKS.md)."""
    import tvm

    shapes = plane_shapes(qtype, (R, K))
    names = [f.name for f in plane_format(qtype).fields]
    nbytes = [shapes[n][0][-1] * tvm.DataType(shapes[n][1]).bits // 8 for n in names]
    big = nbytes.index(max(nbytes))
    row = shapes[names[big]][0][-1]                # elements of a group's row in that plane
    per_block, per_line = row // (K // BLOCK), 64 * row // nbytes[big]

    def at(flat):
        flat = T.min(flat, n_groups * row - 1)
        return (*w_group(flat // row), flat % row)

    lines = max(1, per_block // per_line)

    @T.macro
    def prefetch(ws, g, kb):
        for ln in range(lines):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch", T.address_of(
                ws[big][at(g * row + (kb + AHEAD) * per_block + ln * per_line)]), T.int32(0), T.int32(3), T.int32(1)))

    return prefetch


def _token_blocks(qtype: QT, K: int, x_loc, w_group, y_at, n_groups: int):
    """A macro blocks(first, count, g, x, y, ctx, ws) over token rows first .. first+count-1 of a
    list for row group g: x_loc(ctx, i, g) the quantized row of list entry i and its first input
    column, w_group(g) the group's leading plane indices, y_at(ctx, i, g) its 16 outputs' index
    (the last a Ramp); x = (xq as int32 words, DX, SUM), ws = the planes then the tables."""
    KB = K // BLOCK
    names = [f.name for f in plane_format(qtype).fields] + list(tables(qtype))
    b = _Block(qtype, x_loc)

    def codes(ws, g, kb, j):
        return CODES[qtype](dict(zip(names, ws)), w_group(g), kb, j)

    def parts(ws, g, kb):
        return SCALES[qtype](dict(zip(names, ws)), w_group(g), kb)

    scaled = _scaler(qtype, parts, b.value)
    prefetch = _prefetcher(qtype, K, w_group, n_groups)

    @T.macro
    def micro(nt, i0, g, x, y, ctx, ws, first_pass):
        acc = T.decl_buffer((nt, R), F32)   # global scope: in registers (kernels/cpu.py's docstring)
        ia = T.decl_buffer((_chains(qtype, nt), nt, R), "int32")
        for t in T.unroll(nt):
            T.buffer_store(acc, _bc(0.0, F32, R), [t, _ramp(0)])
        for kb in range(KB):
            if first_pass:   # later token blocks of the group find its weights in the cache
                prefetch(ws, g, kb)
            for t in T.unroll(nt):
                T.buffer_store(ia, b.start(x, ctx, i0 + t, g, kb), [0, t, _ramp(0)])
                if _chains(qtype, nt) == 2:
                    T.buffer_store(ia, _bc(0, "int32", R), [1, t, _ramp(0)])
            for j in T.unroll(8):
                w = T.bind(codes(ws, g, kb, j))
                for t in T.unroll(nt):
                    T.buffer_store(ia, b.dot(_vec(ia, (_chain(qtype, nt, j), t), 0, R), w, x, ctx, i0 + t, g, kb, j),
                                   [_chain(qtype, nt, j), t, _ramp(0)])
            scaled(acc, ia, nt, i0, g, kb, x, ctx, ws)
        for t in T.unroll(nt):
            T.buffer_store(y, _vec(acc, (t,), 0, R), y_at(ctx, i0 + t, g))

    @T.macro
    def blocks(first, count, g, x, y, ctx, ws):
        for b in range(count // TB):
            micro(TB, first + b * TB, g, x, y, ctx, ws, b == 0)
        if count % TB >= 4:
            micro(4, first + count // TB * TB, g, x, y, ctx, ws, count < TB)
        if count % TB % 4 >= 2:
            micro(2, first + count // TB * TB + count % TB // 4 * 4, g, x, y, ctx, ws, count < 4)
        if count % 2 == 1:
            micro(1, first + count - 1, g, x, y, ctx, ws, count < 2)

    return blocks


def supports(N: int, K: int, groups: int = 1) -> bool:
    return N % (R * groups) == 0 and K % BLOCK == 0


ARGS = 6   # weight arguments of every kernel: Q4_K's five planes, MXFP4's two and a table


def arg_types(qtype: QT, shape: tuple) -> list[tuple[tuple, str]]:
    """(shape, dtype) of each weight argument of a weight of numpy shape `shape`: the interleaved
    planes, then the tables, padded by repeating the first (never read)."""
    a = list(plane_shapes(qtype, shape).values()) + [(t.shape, str(t.dtype)) for t in tables(qtype).values()]
    return a + a[:1] * (ARGS - len(a))


def weight_args(args: list) -> list:
    return args + args[:1] * (ARGS - len(args))


@_parsed_once
def dense_linear(qtype: QT, N: int, K: int, threads: int, few: bool, groups: int = 1):
    """y[T, N] = x[T, G*K] @ W[N, K]^T for any T, output rows g*N/G .. reading x[:, g*K ..] (a
    grouped projection with G groups). few: a call of a few tokens (nn/state.few_rows), whose
    inputs are quantized on the calling core."""
    G, per_group = N // R, N // groups
    parallel = _parallel(threads, N, K)
    quantize = quantizer(qtype, threads > 1 and not few)

    def x_loc(_ctx, i, g):
        return i, g * R // per_group * K

    def y_at(_ctx, i, g):
        return [i, _ramp(g * R)]

    blocks = _token_blocks(qtype, K, x_loc, lambda g: (g,), y_at, G)
    width = groups * K
    a = arg_types(qtype, (N, K))

    @T.prim_func(private=True)
    def main(x_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]), w3: T.Buffer(*a[3]),
             w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, width), F32)
        y = T.match_buffer(y_h, (n_tok, N), F32)
        xq = T.decl_buffer((n_tok, width), "int8")
        words = T.decl_buffer((n_tok, width // 4), "int32", data=xq.data)
        DX = T.decl_buffer((n_tok, width // BLOCK), F32)
        SUM = T.decl_buffer((n_tok, width // sums_of(qtype)[1]), sums_of(qtype)[0])
        quantize(x, _row_of_2d, n_tok, width, xq, DX, SUM)
        if parallel:   # a contiguous run of groups per core: one sequential stream each
            for g in T.parallel(G):
                blocks(0, n_tok, g, (words, DX, SUM), y, None, (w0, w1, w2, w3, w4, w5))
        else:
            for g in T.serial(G):
                blocks(0, n_tok, g, (words, DX, SUM), y, None, (w0, w1, w2, w3, w4, w5))

    return main


@_parsed_once
def expert_linear(qtype: QT, E: int, N: int, K: int, J: int, per_slot_input: bool, threads: int, few: bool):
    """y[T, J, N] = x[T, (J|1), K] @ W[ids[t, j], N, K]^T for any T: the (token, slot) pairs sorted
    by expert (kernels/cpu.py's counting sort), the row groups of the experts in use shared among
    the cores, a contiguous run each for a few tokens (every group then costs the same), dealt
    round-robin otherwise (balanced whatever the experts' token counts)."""
    NG, XJ = N // R, (J if per_slot_input else 1)
    parallel = _parallel(threads, N, K)
    quantize = quantizer(qtype, threads > 1 and not few)

    def x_loc(slots, i, _eg):   # the quantized inputs are x's rows flattened: [T * XJ, K]
        return slots[i] // J * XJ + (slots[i] % J if per_slot_input else 0), 0

    def y_at(slots, i, eg):
        return [slots[i] // J, slots[i] % J, _ramp(eg % NG * R)]

    def x_row(x, r, k):
        return x[r // XJ, r % XJ, k]

    blocks = _token_blocks(qtype, K, x_loc, lambda eg: (eg // NG, eg % NG), y_at, E * NG)
    a = arg_types(qtype, (E, N, K))

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
    def main(x_h: T.handle, ids_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]),
             w3: T.Buffer(*a[3]), w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), y_h: T.handle):
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
        SUM = T.decl_buffer((n_tok * XJ, K // sums_of(qtype)[1]), sums_of(qtype)[0])
        quantize(x, x_row, n_tok * XJ, K, xq, DX, SUM)
        groups(n_used, (words, DX, SUM), y, slots, cnt, off, used, (w0, w1, w2, w3, w4, w5))

    return main
