"""GGML block formats split into per-field planes, bit-exactly, plus a numpy dequantizer.

A GGUF block interleaves scales and quants in one byte array; kernels that read one value per
buffer per element (dlight's GEMV analysis, tvm-guide §6) need a struct of arrays instead. Each
format here keeps the file's bits and only moves them: fp16 scales stay fp16, 4-bit codes stay
packed two per byte, IQ2_XXS keeps its grid indices and its 32-bit sign/scale words. The numpy
dequantizer over the planes reproduces `gguf.quants.dequantize` exactly (same float operations in
the same order), which is what the tests check with `np.array_equal`.

Shapes: a tensor of ggml shape [K, N, E...] is handled as rows of K values (numpy shape
(..., N, K)); every plane has the leading row dimensions and one last axis per row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from ..errors import Ds4Error

# Temporaries while splitting are bounded by this many raw bytes, whatever the tensor size.
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PlaneField:
    name: str
    dtype: str
    per_row: Callable[[int], int]  # number of values per row of K elements


@dataclass(frozen=True)
class PlaneFormat:
    qtype: QT
    fields: tuple[PlaneField, ...]
    split: Callable[[np.ndarray, int], dict[str, np.ndarray]] | None  # blocks [r, nb, bytes] -> fields [r, n]
    dequantize: Callable[[dict[str, np.ndarray], int], np.ndarray]  # fields [r, n] -> float32 [r, K]

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


@dataclass
class Planes:
    """A tensor's planes. `shape` is the numpy shape of the dequantized tensor (..., N, K)."""

    qtype: QT
    shape: tuple[int, ...]
    fields: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.fields.values())

    def dequantize(self) -> np.ndarray:
        return dequantize_planes(self)


def _f16(b: np.ndarray) -> np.ndarray:
    """[r, nb, 2] bytes -> [r, nb] float16 (copies: the byte pair is strided inside the block)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _rows(b: np.ndarray) -> np.ndarray:
    """[r, nb, m] -> [r, nb*m] contiguous."""
    return np.ascontiguousarray(b).reshape(b.shape[0], -1)


# ---------------------------------------------------------------------------- per-format split
def _split_q8_0(b, K):
    return {"d": _f16(b[..., 0:2]), "qs": _rows(b[..., 2:34]).view(np.int8)}


def _split_q4_1(b, K):
    return {"d": _f16(b[..., 0:2]), "m": _f16(b[..., 2:4]), "qs": _rows(b[..., 4:20])}


def _split_q4_k(b, K):
    r, nb = b.shape[:2]
    sc, mn = gq.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(r * nb, 12))
    return {"d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4]),
            "sc": sc.reshape(r, nb * 8).astype(np.uint8), "mn": mn.reshape(r, nb * 8).astype(np.uint8),
            "qs": _rows(b[..., 16:144])}


def _split_q2_k(b, K):
    return {"sc": _rows(b[..., 0:16]), "qs": _rows(b[..., 16:80]),
            "d": _f16(b[..., 80:82]), "dmin": _f16(b[..., 82:84])}


def _split_q6_k(b, K):
    return {"ql": _rows(b[..., 0:128]), "qh": _rows(b[..., 128:192]),
            "sc": _rows(b[..., 192:208]).view(np.int8), "d": _f16(b[..., 208:210])}


def _split_iq2_xxs(b, K):
    # Each 32-value sub-block is two u32: four grid indices (bytes) and a word holding four 7-bit
    # sign-pattern indices plus a 4-bit scale in the top bits.
    r, nb = b.shape[:2]
    words = np.ascontiguousarray(b[..., 2:66]).view(np.uint32).reshape(r, nb, 8, 2)
    grid = np.ascontiguousarray(words[..., 0]).view(np.uint8).reshape(r, nb * 32)
    return {"d": _f16(b[..., 0:2]), "grid": grid, "aux": np.ascontiguousarray(words[..., 1]).reshape(r, nb * 8)}


def _split_mxfp4(b, K):
    return {"e": _rows(b[..., 0:1]), "qs": _rows(b[..., 1:17])}


# ---------------------------------------------------------------------------- per-format dequantize
# Each mirrors the float operations of gguf.quants.<T>.dequantize_blocks in the same order.
def _blocks(a: np.ndarray, per_block: int) -> np.ndarray:
    return a.reshape(-1, per_block)


def _deq_q8_0(P, K):
    x = P["qs"].reshape(-1, 32).astype(np.float32)
    return (x * P["d"].reshape(-1, 1).astype(np.float32)).reshape(-1, K)


def _deq_q4_1(P, K):
    d = P["d"].reshape(-1, 1).astype(np.float32)
    m = P["m"].reshape(-1, 1).astype(np.float32)
    qs = P["qs"].reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    qs = (qs & np.uint8(0x0F)).reshape(-1, 32).astype(np.float32)
    return ((d * qs) + m).reshape(-1, K)


def _deq_q4_k(P, K):
    n = P["d"].size
    d = P["d"].reshape(n, 1).astype(np.float32)
    dmin = P["dmin"].reshape(n, 1).astype(np.float32)
    d = (d * P["sc"].reshape(n, 8).astype(np.float32)).reshape(n, 8, 1)
    dm = (dmin * P["mn"].reshape(n, 8).astype(np.float32)).reshape(n, 8, 1)
    qs = P["qs"].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qs = (qs & np.uint8(0x0F)).reshape(n, 8, 32).astype(np.float32)
    return (d * qs - dm).reshape(-1, K)


def _deq_q2_k(P, K):
    n = P["d"].size
    d = P["d"].reshape(n, 1).astype(np.float32)
    dmin = P["dmin"].reshape(n, 1).astype(np.float32)
    sc = P["sc"].reshape(n, 16)
    dl = (d * (sc & 0xF).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    qs = (P["qs"].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    qs = qs.reshape(n, 16, 16).astype(np.float32)
    return (dl * qs - ml).reshape(-1, K)


def _deq_q6_k(P, K):
    n = P["d"].size
    d = P["d"].reshape(n, 1).astype(np.float32)
    d = (d * P["sc"].reshape(n, 16).astype(np.float32)).reshape(n, 16, 1)
    ql = P["ql"].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = P["qh"].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, 8, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    q = q.reshape(n, 16, 16).astype(np.float32)
    return (d * q).reshape(-1, K)


def _iq2_tables() -> tuple[np.ndarray, np.ndarray]:
    gq.IQ2_XXS.init_grid()
    grid = gq.IQ2_XXS.grid.reshape(256, 8)                                   # float32 values 8/25/43
    ksigns = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)                # 128 sign patterns
    return grid, ksigns


def _deq_iq2_xxs(P, K):
    grid_tab, ksigns = _iq2_tables()
    n = P["d"].size
    d = P["d"].reshape(n, 1).astype(np.float32)
    aux = P["aux"].reshape(n, 8)
    db = d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)
    db = db.reshape(n, 8, 1, 1)
    signs = aux.reshape(n, 8, 1) >> np.array([0, 7, 14, 21], np.uint32).reshape(1, 1, 4)
    signs = ksigns[(signs & np.uint32(0x7F))].reshape(n, 8, 4, 1)
    signs = (signs >> np.arange(8, dtype=np.uint8).reshape(1, 1, 1, 8)) & np.uint8(1)
    signs = np.where(signs == 0, np.float32(1), np.float32(-1))
    grid = grid_tab[P["grid"].reshape(n, 8, 4)]                              # [n, 8, 4, 8]
    return (db * grid * signs).reshape(-1, K)


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e-128), with the two smallest codes as denormals."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


MXFP4_VALUES = np.array(gq.MXFP4.kvalues, dtype=np.int8)  # e2m1 codes, doubled


def _deq_mxfp4(P, K):
    d = e8m0_to_fp32_half(P["e"].reshape(-1, 1))
    qs = P["qs"].reshape(-1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    qs = MXFP4_VALUES[qs & np.uint8(0x0F)].reshape(-1, 32)
    return (d * qs.astype(np.float32)).reshape(-1, K)


def _deq_plain(P, K):
    return P["w"].reshape(-1, K).astype(np.float32)


def _deq_bf16(P, K):
    return (P["w"].reshape(-1, K).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f(name, dtype, per_row):
    return PlaneField(name, dtype, per_row)


FORMATS: dict[QT, PlaneFormat] = {f.qtype: f for f in [
    PlaneFormat(QT.F32, (_f("w", "float32", lambda K: K),), None, _deq_plain),
    PlaneFormat(QT.F16, (_f("w", "float16", lambda K: K),), None, _deq_plain),
    PlaneFormat(QT.BF16, (_f("w", "uint16", lambda K: K),), None, _deq_bf16),
    PlaneFormat(QT.Q8_0, (_f("d", "float16", lambda K: K // 32), _f("qs", "int8", lambda K: K)),
                _split_q8_0, _deq_q8_0),
    PlaneFormat(QT.Q4_1, (_f("d", "float16", lambda K: K // 32), _f("m", "float16", lambda K: K // 32),
                          _f("qs", "uint8", lambda K: K // 2)), _split_q4_1, _deq_q4_1),
    PlaneFormat(QT.Q4_K, (_f("d", "float16", lambda K: K // 256), _f("dmin", "float16", lambda K: K // 256),
                          _f("sc", "uint8", lambda K: K // 32), _f("mn", "uint8", lambda K: K // 32),
                          _f("qs", "uint8", lambda K: K // 2)), _split_q4_k, _deq_q4_k),
    PlaneFormat(QT.Q2_K, (_f("sc", "uint8", lambda K: K // 16), _f("qs", "uint8", lambda K: K // 4),
                          _f("d", "float16", lambda K: K // 256), _f("dmin", "float16", lambda K: K // 256)),
                _split_q2_k, _deq_q2_k),
    PlaneFormat(QT.Q6_K, (_f("ql", "uint8", lambda K: K // 2), _f("qh", "uint8", lambda K: K // 4),
                          _f("sc", "int8", lambda K: K // 16), _f("d", "float16", lambda K: K // 256)),
                _split_q6_k, _deq_q6_k),
    PlaneFormat(QT.IQ2_XXS, (_f("d", "float16", lambda K: K // 256), _f("grid", "uint8", lambda K: K // 8),
                             _f("aux", "uint32", lambda K: K // 32)), _split_iq2_xxs, _deq_iq2_xxs),
    PlaneFormat(QT.MXFP4, (_f("e", "uint8", lambda K: K // 32), _f("qs", "uint8", lambda K: K // 2)),
                _split_mxfp4, _deq_mxfp4),
]}


def plane_format(qtype: QT) -> PlaneFormat:
    try:
        return FORMATS[QT(qtype)]
    except (KeyError, ValueError):
        raise Ds4Error(f"GGML type {getattr(qtype, 'name', qtype)} has no plane layout; supported: "
                       f"{', '.join(t.name for t in FORMATS)}") from None


ALIGN = 64  # TVM's kernels assume 64-byte aligned buffers; aligned planes are bound without a copy


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def to_planes(data: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> Planes:
    """Split a tensor's data (as `gguf.GGUFReader` maps it: typed values for F32/F16, uint8 rows
    otherwise) into planes. `shape` is the numpy shape of the values (..., N, K).

    F32/F16/BF16 planes are views of `data` (no copy). Block formats are written into planes
    allocated once, `CHUNK_BYTES` of rows at a time, so peak memory is the planes plus one chunk.
    """
    fmt = plane_format(qtype)
    shape = tuple(int(s) for s in shape)
    K = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if fmt.split is None:
        flat = data.reshape(rows, -1)
        w = flat.view(np.uint16) if qtype == QT.BF16 else flat
        return Planes(fmt.qtype, shape, {"w": w.reshape(*shape[:-1], K)})
    bs, ts = fmt.block_size, fmt.type_size
    if K % bs:
        raise Ds4Error(f"row length {K} is not a multiple of the {fmt.qtype.name} block size {bs}")
    nb = K // bs
    raw = data.reshape(rows, nb * ts)
    out = {f.name: aligned_empty((rows, f.per_row(K)), f.dtype) for f in fmt.fields}
    step = max(1, CHUNK_BYTES // max(1, nb * ts))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        parts = fmt.split(np.asarray(raw[r0:r1]).reshape(r1 - r0, nb, ts), K)
        for name, arr in parts.items():
            out[name][r0:r1] = arr
    return Planes(fmt.qtype, shape, {k: v.reshape(*shape[:-1], v.shape[-1]) for k, v in out.items()})


# Values a weight plane may be derived by on the host when bound (manifest field "w:KIND"): two GGUF
# layouts of one model then bind the same bits (glm5next's ds4 layout stores A_log, llama.cpp's the
# -exp(A_log) its converter computed with numpy's float32 exp). Only for small F32 tensors: the
# result is a host copy.
HOST_DERIVED = {"neg_exp": lambda a: -np.exp(a)}
TO_F32 = "f32"   # an F16 / BF16 tensor bound as its float32 values (read only whole, as values)
# Planes with 16 rows interleaved (kernels/cpu_interleaved.py), derived at load in place of the
# row-major ones (the planes are a copy of the file's blocks anyway): per group of 16 rows, each
# field's values a few of each row in turn (INTERLEAVED_FIELDS: how many; NIBBLES / CRUMBS: 4-bit /
# 2-bit codes, unpacked, 4 of each row in turn, and packed two / four 64-byte runs to one, the later
# ones in the higher bits). Q8_0's codes are made unsigned (+128): vpdpbusd multiplies unsigned by
# signed bytes.
INTERLEAVED = "r16"
INTERLEAVE_ROWS = 16
NIBBLES, CRUMBS = 0, -1   # 4-bit codes, 2-bit codes
INTERLEAVED_FIELDS = {QT.Q8_0: {"d": 1, "qs": 4}, QT.MXFP4: {"e": 1, "qs": NIBBLES},
                      QT.Q4_K: {"d": 1, "dmin": 1, "sc": 1, "mn": 1, "qs": NIBBLES},
                      QT.Q2_K: {"sc": 1, "qs": CRUMBS, "d": 1, "dmin": 1},
                      QT.IQ2_XXS: {"d": 1, "grid": 4, "aux": 1}}


def packed_codes(qtype: QT, qs: np.ndarray) -> np.ndarray:
    """[rows, K/2] packed 4-bit codes ([rows, K/4] 2-bit ones) -> [rows, K] one per weight, in
    weight order."""
    n = len(qs)
    if qtype == QT.Q2_K:   # per 256: two runs of 32 bytes, each four 32-weight groups at shifts 0, 2, 4, 6
        runs = qs.reshape(n, -1, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        return (runs & np.uint8(3)).reshape(n, -1)
    lo, hi = qs & np.uint8(15), qs >> np.uint8(4)
    per = 16 if qtype == QT.MXFP4 else 32   # MXFP4: weight i low, i+16 high per 32; Q4_K: per 64
    return np.stack([lo.reshape(n, -1, per), hi.reshape(n, -1, per)], axis=2).reshape(n, -1)


def _chunked(flat: np.ndarray, view_shape: tuple, dtype, step_bytes: int, convert, after=None) -> np.ndarray:
    """[G, ...] -> aligned [G, prod(view_shape)]: viewed as [G, *view_shape], it gets
    convert(flat[g0:g1]) group chunk by group chunk (then after(its rows), if given), the chunks on
    the cores (numpy lets go of the GIL while it copies and shifts), temporaries bounded by
    CHUNK_BYTES a thread."""
    from concurrent.futures import ThreadPoolExecutor

    G = flat.shape[0]
    out = aligned_empty((G, int(np.prod(view_shape))), dtype)
    view = out.reshape(G, *view_shape)
    step = max(1, CHUNK_BYTES // max(1, step_bytes))

    def work(g0):
        view[g0:g0 + step] = convert(flat[g0:g0 + step])
        if after is not None:
            after(out[g0:g0 + step])

    starts = range(0, G, step)
    if len(starts) == 1:   # one chunk: a pool would only cost its start
        work(0)
        return out
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:   # 16 x CHUNK_BYTES at most
        list(pool.map(work, starts))
    return out


def _unbias(rows: np.ndarray) -> None:   # Q8_0 codes + 128, in place
    u = rows.view(np.uint8)
    np.bitwise_xor(u, np.uint8(0x80), out=u)


def interleaved_plane(p: Planes, name: str) -> np.ndarray:
    """Field `name` of planes p laid out 16 rows interleaved: [..., N/16, 16 * per_row]."""
    unit, R = INTERLEAVED_FIELDS[p.qtype][name], INTERLEAVE_ROWS
    a = p.fields[name]
    *lead, N, W = a.shape
    if unit in (NIBBLES, CRUMBS):
        def pack(g):   # g: [n, 16, W] packed codes -> [n, 16 * W]
            n = len(g)
            codes = packed_codes(p.qtype, g.reshape(-1, W)).reshape(n, R, -1, 8, 4)
            vecs = codes.transpose(0, 2, 3, 1, 4).reshape(n, -1, 8, 4 * R)   # code vector j: 4 weights of 16 rows
            if unit == NIBBLES:   # vector j in run j % 4, the high nibbles from j = 4
                return (vecs[:, :, :4] | (vecs[:, :, 4:] << np.uint8(4))).reshape(n, -1)
            runs = vecs.reshape(n, -1, 2, 4, 4 * R)   # vector j in run j // 4 at 2 * (j % 4) bits
            return (runs[:, :, :, 0] | (runs[:, :, :, 1] << np.uint8(2)) | (runs[:, :, :, 2] << np.uint8(4))
                    | (runs[:, :, :, 3] << np.uint8(6))).reshape(n, -1)
        out = _chunked(a.reshape(-1, R, W), (R * W,), np.uint8, 5 * R * W, pack)
    else:   # one strided copy per chunk: unit values of each row in turn, moved as one wider word
        word = np.dtype(f"u{unit * a.itemsize}") if unit * a.itemsize in (2, 4, 8) else a.dtype
        words = a.reshape(-1, W).view(word) if word != a.dtype else a.reshape(-1, W)
        per = words.shape[-1] // (W // unit)   # values of a unit per word: 1, or unit where no word fits
        biased = p.qtype == QT.Q8_0 and name == "qs"
        out = _chunked(words.reshape(-1, R, W // unit, per), (W // unit, R, per), word, R * W * a.itemsize,
                       lambda g: g.transpose(0, 2, 1, 3), _unbias if biased else None)
        out = out.view(np.uint8 if biased else a.dtype)
    return out.reshape(*lead, N // R, -1)


def derived_plane(p: Planes, field: str) -> np.ndarray:
    """The plane a manifest parameter field names: 'w' as stored, 'w:neg_exp' derived, 'w:f32' the
    tensor's float32 values, 'qs:r16' 16 rows interleaved."""
    name, _, kind = field.partition(":")
    if kind == TO_F32:
        return np.ascontiguousarray(dequantize_planes(p), dtype=np.float32)
    if kind == INTERLEAVED:
        return interleaved_plane(p, name)
    arr = p.fields[name]
    return arr if not kind else HOST_DERIVED[kind](np.asarray(arr, dtype=np.float32))


def dequantize_planes(p: Planes) -> np.ndarray:
    """float32 values of a tensor from its planes (numpy reference for the TVM kernels)."""
    fmt = plane_format(p.qtype)
    K = p.shape[-1]
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in p.fields.items()}
    return fmt.dequantize(flat, K).reshape(p.shape)


# ---------------------------------------------------------------------------- writing and test data
def quantize(values: np.ndarray, qtype: QT) -> np.ndarray:
    """Float values (..., K) -> GGUF data for `qtype`, for the types gguf-py can quantize."""
    qtype = QT(qtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == QT.F32:
        return values
    if qtype == QT.F16:
        return values.astype(np.float16)
    if qtype in (QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4):
        return gq.quantize(values, qtype)
    if qtype == QT.Q4_K:
        return _quantize_q4_k(values)
    raise Ds4Error(f"no quantizer for {qtype.name}: use random_blocks() for test data of this type")


def _quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K by each 32-value sub-block's minimum and range (no search for the best scales, as
    llama.cpp does): value = d*sc*q - dmin*m with 6-bit sc, m packed as get_scale_min_k4 reads them."""
    *lead, K = values.shape
    if K % 256:
        raise Ds4Error(f"row length {K} is not a multiple of the Q4_K block size 256")
    x = values.reshape(-1, 8, 32).astype(np.float32)
    lo = np.maximum(-x.min(axis=2), 0)                               # [n, 8] offsets, >= 0
    step = np.maximum((x.max(axis=2) + lo) / 15, 1e-30)
    d = (step.max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = (lo.max(axis=1, keepdims=True) / 63).astype(np.float16)
    df, mf = np.maximum(d.astype(np.float32), 1e-30), np.maximum(dmin.astype(np.float32), 1e-30)
    sc = np.clip(np.rint(step / df), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(lo / mf), 0, 63).astype(np.uint8)
    q = np.rint((x + (dmin.astype(np.float32) * m)[..., None]) / (df * sc)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)     # 64-value groups: low, high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(*lead, K // 256 * 144)


_FP16_FIELDS = {  # byte offsets of fp16 scale fields inside a block
    QT.Q8_0: (0,), QT.Q4_1: (0, 2), QT.Q4_K: (0, 2), QT.Q2_K: (80, 82), QT.Q6_K: (208,),
    QT.IQ2_XXS: (0,),
}


def random_blocks(qtype: QT, shape: tuple[int, ...], rng: np.random.Generator,
                  scale: float = 0.01) -> np.ndarray:
    """Random but valid GGUF data for `qtype` with numpy shape `shape` (..., K): random quant bits
    and small finite fp16 scales, for formats without a numpy quantizer (K- and IQ-quants)."""
    qtype = QT(qtype)
    *lead, K = shape
    if qtype in (QT.F32, QT.F16, QT.BF16):
        return quantize(rng.standard_normal(shape).astype(np.float32) * 0.5, qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if K % bs:
        raise Ds4Error(f"row length {K} is not a multiple of the {qtype.name} block size {bs}")
    n = int(np.prod(lead, dtype=np.int64)) * (K // bs)
    raw = rng.integers(0, 256, (n, ts), dtype=np.uint8)
    for off in _FP16_FIELDS.get(qtype, ()):
        vals = (rng.uniform(0.5, 1.5, (n, 1)) * scale).astype(np.float16)
        raw[:, off:off + 2] = vals.view(np.uint8)
    if qtype == QT.MXFP4:  # e8m0 exponents near 2^-6 .. 2^1
        raw[:, 0] = rng.integers(121, 129, n, dtype=np.uint8)
    return raw.reshape(*lead, K // bs * ts)
