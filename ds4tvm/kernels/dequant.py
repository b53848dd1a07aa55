"""The float32 value of element (row..., k) of a GGML tensor held as planes (gguf/quant.py), as a
TIR expression with the same float operations as gguf's numpy dequantizer. Shared by the TE
kernels of nn/qweight.py and the hand-written CPU kernels of kernels/cpu.py."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from tvm import tirx

from ..gguf.quant import _iq2_tables

F32 = "float32"


def _f32(x):
    return x.astype(F32)


def _u8(v):
    return tirx.const(v, "uint8")


def _deq_f(P, r, k):
    return _f32(P["w"][(*r, k)])


def _deq_bf16(P, r, k):
    return tirx.reinterpret(F32, P["w"][(*r, k)].astype("uint32") << tirx.const(16, "uint32"))


def _deq_q8_0(P, r, k):
    return _f32(P["qs"][(*r, k)]) * _f32(P["d"][(*r, k // 32)])


def _deq_q4_1(P, r, k):
    j = k % 32
    byte = P["qs"][(*r, (k // 32) * 16 + j % 16)]
    q = (byte >> ((j // 16) * 4).astype("uint8")) & _u8(15)
    return _f32(P["d"][(*r, k // 32)]) * _f32(q) + _f32(P["m"][(*r, k // 32)])


def _deq_q4_k(P, r, k):
    i = k % 256
    j = i // 32
    byte = P["qs"][(*r, (k // 256) * 128 + (j // 2) * 32 + i % 32)]
    q = (byte >> ((j % 2) * 4).astype("uint8")) & _u8(15)
    return (_f32(P["d"][(*r, k // 256)]) * _f32(P["sc"][(*r, k // 32)]) * _f32(q)
            - _f32(P["dmin"][(*r, k // 256)]) * _f32(P["mn"][(*r, k // 32)]))


def _deq_q2_k(P, r, k):
    i = k % 256
    byte = P["qs"][(*r, (k // 256) * 64 + (i // 128) * 32 + i % 32)]
    q = (byte >> (((i % 128) // 32) * 2).astype("uint8")) & _u8(3)
    s = P["sc"][(*r, k // 16)]
    return (_f32(P["d"][(*r, k // 256)]) * _f32(s & _u8(15)) * _f32(q)
            - _f32(P["dmin"][(*r, k // 256)]) * _f32(s >> _u8(4)))


def _deq_q6_k(P, r, k):
    i = k % 256
    h = i // 128
    lo = P["ql"][(*r, (k // 256) * 128 + h * 64 + i % 64)]
    lo = (lo >> (((i % 128) // 64) * 4).astype("uint8")) & _u8(15)
    hi = P["qh"][(*r, (k // 256) * 64 + h * 32 + i % 32)]
    hi = (hi >> (((i % 128) // 32) * 2).astype("uint8")) & _u8(3)
    q = (lo | (hi << _u8(4))).astype("int32") - 32
    return _f32(P["d"][(*r, k // 256)]) * _f32(P["sc"][(*r, k // 16)]) * _f32(q)


def _deq_mxfp4(P, r, k):
    """The e2m1 code's doubled value (gguf's kvalues table) from its bits, so a vector of them
    needs no gather: magnitude m in 1..7 is ((2 + m % 2) << (m // 2)) >> 1."""
    j = k % 32
    nib = ((P["qs"][(*r, (k // 32) * 16 + j % 16)] >> ((j // 16) * 4).astype("uint8")) & _u8(15)).astype("int32")
    m = nib & 7
    mag = tirx.Select(m == 0, 0, ((2 + (m & 1)) << (m >> 1)) >> 1)
    val = tirx.Select(nib >= 8, -mag, mag)
    e = P["e"][(*r, k // 32)].astype("uint32")
    half = tirx.Select(e < 2, tirx.reinterpret(F32, tirx.const(0x00200000, "uint32") << e),
                       tirx.reinterpret(F32, (e - tirx.const(1, "uint32")) << tirx.const(23, "uint32")))
    return half * _f32(val)


def _deq_iq2_xxs(P, r, k):
    """Eight weights share a grid row and a sign pattern: both are table rows [index, k % 8]."""
    i = k % 256
    g = i // 32
    aux = P["aux"][(*r, (k // 256) * 8 + g)]
    db = _f32(P["d"][(*r, k // 256)]) * (tirx.const(0.5, F32) + _f32(aux >> tirx.const(28, "uint32"))) \
        * tirx.const(0.25, F32)
    grid_idx = P["grid"][(*r, (k // 256) * 32 + g * 4 + (i % 32) // 8)].astype("int32")
    sign_idx = ((aux >> (tirx.const(7, "uint32") * ((i % 32) // 8).astype("uint32"))) & tirx.const(127, "uint32"))
    return db * P["iq2_grid"][grid_idx, i % 8] * P["iq2_signs"][sign_idx.astype("int32"), i % 8]


def tables(qtype: QT) -> dict[str, np.ndarray]:
    """Lookup tables a format's expressions read, passed to the kernels as constants."""
    if qtype == QT.IQ2_XXS:
        grid, ksigns = _iq2_tables()
        signs = np.where((ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1, -1.0, 1.0)
        return {"iq2_grid": grid.astype(np.float32), "iq2_signs": signs.astype(np.float32)}
    return {}


DEQUANT = {QT.F32: _deq_f, QT.F16: _deq_f, QT.BF16: _deq_bf16, QT.Q8_0: _deq_q8_0, QT.Q4_1: _deq_q4_1,
           QT.Q4_K: _deq_q4_k, QT.Q2_K: _deq_q2_k, QT.Q6_K: _deq_q6_k, QT.MXFP4: _deq_mxfp4,
           QT.IQ2_XXS: _deq_iq2_xxs}
