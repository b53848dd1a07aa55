"""The int8-activation path of the CPU linears (the default on CPUs with an int8 dot instruction;
`ds4-compile --float-activations` opts out):
each token's input is quantized to int8 in blocks of 32 (gguf's Q8_0 rounding, the scale kept in
float32) and multiplied by the weights' integer codes with integer dot products, as llama.cpp's CPU
backend does: AVX-512 VNNI's vpdpbusd (64 u8 x s8 products summed into 16 int32 lanes per
instruction) or, on AVX2, vpmaddubsw (u8 x s8 pairs summed into int16, saturating) then vpmaddwd
(int16 pairs into int32), on each half of the 64 (`int8_dot_for` picks by the target). It reads the
same planes as kernels/cpu.py and replaces that module's float micro-kernel only.

The logits change: every input is rounded to 8 bits (a relative error of about 1/254 of its
block's largest magnitude), so they no longer match transformers to ~1e-6; what the kernels
compute is checked against gguf's own Q8_0 quantizer applied to the input
(tests/unit/test_kernels.py). A token's outputs still do not depend on the tokens beside it, bit
for bit, so decode and verify round alike.

Each format decodes a block of 256 weights of a row into four chunks of 64 unsigned codes u
(u8 x 64) with a scale per dot-product lane S (f32 x 16: each lane sums 4 products), and an offset
per 16 weights M (f32 x 16), such that weight = S * u - M. With the token's input scales per lane
D and its sums of 16 inputs X (the scale times the codes' sum), each chunk adds
cvt(dot(u, q)) * S * D to the token's 16 partial sums and the block subtracts M * X. Signed codes
(Q8_0, IQ2_XXS) are biased by 128 to be unsigned, M = 128 S, for vpdpbusd. vpmaddubsw would
saturate on biased codes (255 x 127 x 2 > 32767), so on AVX2 they stay signed (no M): the
instruction takes |w| and the input with w's sign, as llama.cpp's AVX2 kernels do (|w| <= 128 and
|q| <= 127 keep a pair's sum within int16). There IQ2_XXS reads its magnitudes and its sign rows
from two small tables, vpsignb putting the signs on the inputs, and MXFP4 looks its codes up with
vpshufb. Each sums the same four products into a lane; the VNNI path's biased sums less the
offsets round differently in float32 than the AVX2 path's direct ones, so the two builds' logits
differ in the last bits.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from tvm import tirx
from tvm.script import tirx as T

from ..gguf.quant import MXFP4_VALUES, plane_format
from . import dequant

F32 = "float32"
CHUNK = 64          # weights per dot product
VPDPBUSD, VPMADDUBSW = "vpdpbusd", "vpmaddubsw"   # the int8 dot products: AVX-512 VNNI, AVX2
SIGNED = (QT.Q8_0, QT.IQ2_XXS, QT.MXFP4)           # signed codes: biased for vpdpbusd, kept for vpmaddubsw
BLOCK = 256         # weights per decoded block: four chunks
ACT_BLOCK = 32      # inputs per int8 scale


def _vec(buf, lead: tuple, start, lanes: int):
    return tirx.BufferLoad(buf, [*lead, tirx.Ramp(start, 1, lanes)])


def _bc(value, dtype: str, lanes: int):
    return tirx.Broadcast(tirx.const(value, dtype), lanes)


def _spread(v, first: int, per: int):
    """16 lanes from a vector of per-block values: lane l takes v[first + l // per]."""
    n = v.ty.dtype.lanes
    return tirx.Shuffle([v] * max(1, 16 // n), [first + lane // per for lane in range(16)])


def _nibbles(v, shifts: tuple[int, int], mask: int):
    """The 64 codes of a chunk from 32 bytes: the first 32 at shifts[0], the next at shifts[1]."""
    lo, hi = ((v >> _bc(s, "uint8", 32)) & _bc(mask, "uint8", 32) for s in shifts)
    return tirx.Shuffle([lo, hi], list(range(64)))


def _gather_rows(table, idx):
    """table[idx] for eight int32 indices into a table of uint64 rows: one AVX-512 gather (TVM
    would load the lanes one by one)."""
    return T.call_llvm_pure_intrin("uint64x8", "llvm.x86.avx512.mask.gather.dpq.512", _bc(0, "uint64", 8),
                                   T.address_of(table[0]), idx, tirx.Broadcast(tirx.const(True, "bool"), 8),
                                   tirx.const(8, "int32"))


def _f16(P, name, r, i):
    return P[name][(*r, i)].astype(F32)


def _q4_k(P, r, s, _dot):
    sc = _vec(P["sc"], r, s * 8, 8).astype("float32x8") * tirx.Broadcast(_f16(P, "d", r, s), 8)
    mn = _vec(P["mn"], r, s * 8, 8).astype("float32x8") * tirx.Broadcast(_f16(P, "dmin", r, s), 8)
    codes = [_nibbles(_vec(P["qs"], r, s * 128 + j * 32, 32), (0, 4), 15) for j in range(4)]
    return codes, [_spread(sc, 2 * j, 8) for j in range(4)], _spread(mn, 0, 2)


def _q2_k(P, r, s, _dot):
    raw = _vec(P["sc"], r, s * 16, 16)
    sc = (raw & _bc(15, "uint8", 16)).astype("float32x16") * tirx.Broadcast(_f16(P, "d", r, s), 16)
    mn = (raw >> _bc(4, "uint8", 16)).astype("float32x16") * tirx.Broadcast(_f16(P, "dmin", r, s), 16)
    codes = [_nibbles(_vec(P["qs"], r, s * 64 + j // 2 * 32, 32), (j % 2 * 4, j % 2 * 4 + 2), 3) for j in range(4)]
    return codes, [_spread(sc, 4 * j, 4) for j in range(4)], mn


def _q8_0(P, r, s, dot):
    d = _vec(P["d"], r, s * 8, 8).astype("float32x8")
    codes = [_vec(P["qs"], r, s * 256 + j * CHUNK, 64) for j in range(4)]
    if signed_codes(QT.Q8_0, dot):
        return codes, [_spread(d, 2 * j, 8) for j in range(4)], None
    codes = [tirx.reinterpret("uint8x64", c) ^ _bc(128, "uint8", 64) for c in codes]
    return codes, [_spread(d, 2 * j, 8) for j in range(4)], _spread(d, 0, 2) * _bc(128.0, F32, 16)


def _iq2_xxs_codes(P, r, s, aux, j):
    """Chunk j's codes: eight rows of the table of every (grid entry, sign pattern) pair, one
    gather: the row of grid entry g and sign pattern p holds, per weight, 128 + its magnitude
    (8/25/43) when positive, 128 - its magnitude when negative."""
    grid = _vec(P["grid"], r, s * 32 + j * 8, 8).astype("int32x8")
    words = tirx.Shuffle([aux], [2 * j + i // 4 for i in range(8)])
    shifts = tirx.Shuffle([tirx.Ramp(tirx.const(0, "uint32"), tirx.const(7, "uint32"), 4)] * 2, list(range(8)))
    sign_idx = ((words >> shifts) & _bc(127, "uint32", 8)).astype("int32x8")
    return tirx.reinterpret("uint8x64", _gather_rows(P["iq2_codes"], grid * _bc(128, "int32", 8) + sign_idx))


def _iq2_xxs_apart(P, r, s, aux, j):
    """Chunk j's magnitudes (u8 x 64) and signs (+-1 x 64) apart, each eight 64-bit rows of a small
    table (grid 2 KB, signs 1 KB) read with scalar indices (a vector of indices costs an extract
    per lane): on AVX2 the signs go onto the inputs (vpsignb), as in llama.cpp."""
    def row(table, index):
        return tirx.BufferLoad(P[table], [index.astype("int32")])

    grid = [row("iq2_grid8", P["grid"][(*r, s * 32 + j * 8 + i)]) for i in range(8)]
    words = [P["aux"][(*r, s * 8 + 2 * j + h)] for h in range(2)]   # 4 x 7 sign bits each
    signs = [row("iq2_signs8", (words[i // 4] >> tirx.const(7 * (i % 4), "uint32")) & tirx.const(127, "uint32"))
             for i in range(8)]
    return (tirx.reinterpret("uint8x64", tirx.Shuffle(grid, list(range(8)))),
            tirx.reinterpret("int8x64", tirx.Shuffle(signs, list(range(8)))))


def _iq2_xxs(P, r, s, dot):
    aux = _vec(P["aux"], r, s * 8, 8)
    db = (tirx.Broadcast(_f16(P, "d", r, s), 8) * (_bc(0.5, F32, 8) + (aux >> _bc(28, "uint32", 8)).astype("float32x8"))
          * _bc(0.25, F32, 8))
    scales = [_spread(db, 2 * j, 8) for j in range(4)]
    if signs_apart(QT.IQ2_XXS, dot):
        return [_iq2_xxs_apart(P, r, s, aux, j) for j in range(4)], scales, None
    return [_iq2_xxs_codes(P, r, s, aux, j) for j in range(4)], scales, _spread(db, 0, 2) * _bc(128.0, F32, 16)


def _e8m0_half(e):
    """gguf's e8m0_to_fp32_half of a vector of exponent bytes: 2^(e-128), the two smallest as
    denormals (kernels/dequant.py's expression, lane by lane)."""
    n = e.ty.dtype.lanes
    e = e.astype(f"uint32x{n}")
    small = _bc(0x00200000, "uint32", n) << e
    big = (e - _bc(1, "uint32", n)) << _bc(23, "uint32", n)
    return tirx.reinterpret(f"float32x{n}", tirx.Select(e < _bc(2, "uint32", n), small, big))


def _mxfp4(P, r, s, dot):
    """MXFP4's 4-bit codes looked up in its doubled e2m1 values (-12 .. 12) with vpshufb, 32 at
    a time: a chunk's 64 codes are two 32-weight blocks, each 16 low nibbles then 16 high ones.
    Signed codes for vpmaddubsw, biased by 128 for vpdpbusd (as Q8_0's)."""
    half = _e8m0_half(_vec(P["e"], r, s * 8, 8))
    values = _vec(P["mxfp4_values"], (), 0, 32)
    codes = []
    for j in range(4):
        v = _vec(P["qs"], r, s * 128 + j * 32, 32)
        lo, hi = (tirx.reinterpret("int8x32", n) for n in (v & _bc(15, "uint8", 32), v >> _bc(4, "uint8", 32)))
        L, H = (T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.pshuf.b", values, n) for n in (lo, hi))
        codes.append(tirx.Shuffle([L, H], [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]))
    scales = [_spread(half, 2 * j, 8) for j in range(4)]
    if signed_codes(QT.MXFP4, dot):
        return codes, scales, None
    codes = [tirx.reinterpret("uint8x64", c) ^ _bc(128, "uint8", 64) for c in codes]
    return codes, scales, _spread(half, 0, 2) * _bc(128.0, F32, 16)


BLOCKS = {QT.Q4_K: _q4_k, QT.Q2_K: _q2_k, QT.Q8_0: _q8_0, QT.IQ2_XXS: _iq2_xxs, QT.MXFP4: _mxfp4}
# IQ2_XXS on AVX2 reads its grid and sign rows with scalar indices: with its combined table
# gathered (two 4-row gathers, or a vector of indices) it was no faster than the float kernel.
FORMATS = {VPDPBUSD: (QT.Q4_K, QT.Q2_K, QT.Q8_0, QT.IQ2_XXS, QT.MXFP4),
           VPMADDUBSW: (QT.Q4_K, QT.Q2_K, QT.Q8_0, QT.MXFP4, QT.IQ2_XXS)}


def signed_codes(qtype: QT, dot: str) -> bool:
    """Whether a format's codes stay signed (no bias, no offsets) for the dot instruction."""
    return dot == VPMADDUBSW and qtype in SIGNED


def tables(qtype: QT, dot: str) -> dict:
    """The tables the decoders read: MXFP4's 16 values twice (vpshufb looks up within each
    16-byte half); IQ2_XXS's 64-bit rows of its grid and of its sign patterns (AVX2), or of the
    codes of every (grid entry, sign pattern) pair, [256 * 128] (256 KB, one copy in a module)."""
    if qtype == QT.MXFP4:   # vpshufb's table, once per 128-bit lane
        return {"mxfp4_values": np.tile(MXFP4_VALUES, 2)}
    if qtype != QT.IQ2_XXS:
        return {}
    float_tables = dequant.tables(qtype)   # the float kernels' grid magnitudes and +-1 signs
    mag = float_tables["iq2_grid"].astype(np.uint8)                                # [256, 8]
    sign = float_tables["iq2_signs"].astype(np.int8)                               # [128, 8]

    def rows(a):
        return np.ascontiguousarray(a).view(np.uint64).reshape(-1)

    if signs_apart(qtype, dot):
        return {"iq2_grid8": rows(mag), "iq2_signs8": rows(sign)}
    codes = (128 + sign[None].astype(np.int16) * mag[:, None]).astype(np.uint8)   # [256, 128, 8]
    return {"iq2_codes": rows(codes.reshape(-1, 8))}


def signs_apart(qtype: QT, dot: str) -> bool:
    """Whether a format's decoder gives each chunk as (magnitudes, signs): IQ2_XXS on AVX2."""
    return qtype == QT.IQ2_XXS and dot == VPMADDUBSW


def block_decoder(qtype: QT, dot: str):
    """dec(rows, blk, ws) -> (codes, scales, mins) of 256-weight block blk of a weight row: the
    four chunks' codes (u8 x 64, or s8 x 64 where signed_codes) and scales S (f32 x 16, one per
    dot-product lane), and the block's offsets (f32 x 16, one per 16 weights; None for signed
    codes); the chunks' scales are lanes of one vector of the block's, which LLVM loads and
    converts once."""
    names = [f.name for f in plane_format(qtype).fields] + list(tables(qtype, dot))
    dec = BLOCKS[qtype]
    return lambda r, blk, ws: dec(dict(zip(names, ws)), r, blk, dot)


def _roundf(v):
    """gguf's np_roundf (half away from zero) in the same float operations."""
    a = T.fabs(v)
    f = T.floor(a)
    b = f + T.floor(T.float32(2) * (a - f))
    return T.Select(v < T.float32(0), -b, b)


def lanes_reduced(v, op):
    """op over the lanes of a vector, halves combined pairwise (log2(lanes) steps where a scalar
    loop chains one per lane: a few rows' quantization, on the calling core while the other cores
    wait, took ~0.6 us per 512 inputs that way)."""
    lanes = v.ty.dtype.lanes
    while lanes > 1:
        lanes //= 2
        v = op(tirx.Shuffle([v], list(range(lanes))), tirx.Shuffle([v], list(range(lanes, 2 * lanes))))
    return v


def code_sum(xq, r, start, n: int):
    """The int32 sum of codes xq[r, start .. start+n]."""
    return lanes_reduced(tirx.Cast(f"int32x{n}", _vec(xq, (r,), start, n)), lambda a, b: a + b)


@T.macro
def block_codes(x, x2, r, b, xq, amax):
    """xq[r, 32b ..] the codes of block b of row x2(x, r, .) as gguf's Q8_0 quantizer rounds them;
    amax[0] its largest magnitude (the block's scale is amax / 127)."""
    amax[0] = lanes_reduced(T.fabs(x2(x, r, tirx.Ramp(b * ACT_BLOCK, 1, ACT_BLOCK))), T.max)   # exact in any order
    d: T.float32 = amax[0] / T.float32(127)
    inv: T.float32 = T.Select(d == T.float32(0), T.float32(0), T.float32(1) / d)
    for i in T.vectorized(ACT_BLOCK):
        xq[r, b * ACT_BLOCK + i] = T.Cast("int8", _roundf(x2(x, r, b * ACT_BLOCK + i) * inv))


@T.macro
def _quantize_row(x, x2, r, Kx, xq, D, X):
    amax = T.decl_buffer((1,), F32, scope="local")
    for b in range(Kx // ACT_BLOCK):
        block_codes(x, x2, r, b, xq, amax)
        d: T.float32 = amax[0] / T.float32(127)
        for lane in T.vectorized(ACT_BLOCK // 4):
            D[r, b * 8 + lane] = d
        for h in range(2):
            X[r, b * 2 + h] = d * T.Cast(F32, code_sum(xq, r, b * ACT_BLOCK + h * 16, 16))


def quantizer(parallel: bool, quantize_row=_quantize_row):
    """A macro quantize(x, x2, rows, Kx, xq, D, X): xq[r, k] int8, D[r, k/4] each dot-product
    lane's input scale, X[r, k/16] the scale times the sum of 16 inputs' codes, of rows x2(x, r, k)
    in blocks of 32 as gguf's Q8_0 quantizer rounds them (or what another quantize_row macro
    writes: kernels/cpu_interleaved.py's). parallel: the rows on the cores (a prefill's hundreds
    of rows; the routed experts' down inputs are four per token: prefill of 512 tokens 821 -> 855
    tok/s on the benchmark model); a decode's one row stays on the calling core."""
    @T.macro
    def quantize(x, x2, rows, Kx, xq, D, X):
        if parallel:
            for r in T.parallel(rows):
                quantize_row(x, x2, r, Kx, xq, D, X)
        else:
            for r in range(rows):
                quantize_row(x, x2, r, Kx, xq, D, X)

    return quantize


def _lanes16(buf, i0: tuple, start):
    return tirx.BufferLoad(buf, [*i0, tirx.Ramp(start, 1, 16)])


def _halves(v, lanes: int):
    return [tirx.Shuffle([v], list(range(h * lanes, (h + 1) * lanes))) for h in range(2)]


def _dot(u, q, dot: str, signed: bool):
    """16 int32 lanes, lane l the sum of products 4l .. 4l+3 of codes u (u8 x 64, or s8 x 64:
    signed) and inputs q (s8 x 64)."""
    if dot == VPDPBUSD:
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", _bc(0, "int32", 16), u, q)
    if isinstance(u, tuple):   # magnitudes and signs apart: the signs go onto the inputs
        u, signs = u
        q = tirx.Shuffle([T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", qh, sh)
                          for qh, sh in zip(_halves(q, 32), _halves(signs, 32))], list(range(64)))
    elif signed:   # |w| times q with w's sign
        q = tirx.Select(u < _bc(0, "int8", 64), _bc(0, "int8", 64) - q, q)
        u = tirx.reinterpret("uint8x64", T.abs(u))
    ones = _bc(1, "int16", 16)
    parts = [T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd",
                                     T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", uh, qh), ones)
             for uh, qh in zip(_halves(u, 32), _halves(q, 32))]
    return tirx.Shuffle(parts, list(range(16)))


def chunk_update(acc, t, n, u, S, xq, D, row, col, dot: str, signed: bool):
    """(token t, row n)'s 16 partial sums plus chunk u, S at input column col of quantized row
    `row`: cvt(dot(u, q)) * S * D."""
    q = _vec(xq, (row,), col, 64)
    return _lanes16(acc, (t, n), 0) + _dot(u, q, dot, signed).astype("float32x16") * (S * _lanes16(D, (row,), col // 4))


def offset_update(acc, t, n, M, X, row, col):
    """(token t, row n)'s 16 partial sums less a block's offsets M (at input column col, one per
    16 weights) times the inputs' sums X over the same 16."""
    return _lanes16(acc, (t, n), 0) - M * _lanes16(X, (row,), col // 16)
