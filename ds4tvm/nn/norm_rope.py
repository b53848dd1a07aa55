"""Norms and rotary position embeddings, with positions from the host (a call's first position):
RMSNorm, LayerNorm, RoPE (interleaved, NeoX, YaRN frequencies), RMSNorm + RoPE (+ FP8 rows) in one
kernel, RoPE + Hadamard + FP4, and rows of a table by position (absolute position embeddings)."""

from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels import gpu as gpu_kernels
from ..kernels.tags import BROADCAST
from ..kernels.forms import Forms
from .rounding import fp8_round_rows, hadamard_fp4

F32 = "float32"


def rms(x: nn.Tensor, eps: float, weight: nn.Tensor | None = None) -> nn.Tensor:
    """RMSNorm over the last axis (weightless when weight is None), as one kernel: written as
    relax ops it was seven (square, sum, divide, add, sqrt, divide, multiply), each with its own VM
    calls, and a model has dozens of norms per token."""
    def f(x_te, *w):
        return te.compute(x_te.shape, _rms_te(lambda i: x_te[i], x_te.shape, eps, w), name="rms")

    return op.tensor_expr_op(f, "rms", [x] + ([weight] if weight is not None else []))


def _rms_te(src, shape, eps: float, w: tuple, name: str = "rms"):
    """The normalized element i of src (an element accessor over shape), times w[0][i[-1]] when
    a weight is given."""
    D = shape[-1]
    k = te.reduce_axis((0, D), name="k")
    ss = te.compute(shape[:-1], lambda *i: te.sum(src((*i, k)) * src((*i, k)), axis=k), name=name + "_ss")

    def body(*i):
        y = src(i) / te.sqrt(ss[i[:-1]] / D.astype(F32) + tirx.const(eps, F32))
        return y * w[0][i[-1]] if w else y

    return body


def layer_norm(x: nn.Tensor, eps: float, weight: nn.Tensor, bias: nn.Tensor, name: str = "layer_norm") -> nn.Tensor:
    """LayerNorm over the last axis of x [T, D] (biased variance), with weight and bias."""
    def f(x_te, w, b):
        n, D = x_te.shape
        inv = tirx.const(1.0, F32) / D.astype(F32)
        k = te.reduce_axis((0, D), name="k")
        total = te.compute((n,), lambda t: te.sum(x_te[t, k], axis=k), name=name + "_sum")
        k2 = te.reduce_axis((0, D), name="k2")
        dev = te.compute((n,), lambda t: te.sum((x_te[t, k2] - total[t] * inv) * (x_te[t, k2] - total[t] * inv),
                                                axis=k2), name=name + "_dev")
        return te.compute((n, D), lambda t, d: (x_te[t, d] - total[t] * inv)
                          / te.sqrt(dev[t] * inv + tirx.const(eps, F32)) * w[d] + b[d], name=name)

    return op.tensor_expr_op(f, name, [x, weight, bias])


# ---------------------------------------------------------------------------- RoPE
def rope_inv_freq(n_rot: int, base: float, yarn: tuple[float, int, float, float] | None) -> np.ndarray:
    """Per-pair angular frequencies of interleaved RoPE; with YaRN (factor, original context,
    beta_fast, beta_slow) the ramp between interpolated and extrapolated frequencies, with the
    magnitude correction cancelled (DeepSeek-V4's attention factor 1)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    freq = base ** (-2.0 * i / n_rot)
    if yarn is not None and yarn[0] != 1.0:
        factor, orig, beta_fast, beta_slow = yarn

        def corr_dim(beta):
            return n_rot * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        lo = max(0, math.floor(corr_dim(beta_fast)))
        hi = min(n_rot - 1, math.ceil(corr_dim(beta_slow)))
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
        freq = freq / factor * (1.0 - ramp) + freq * ramp
    return freq.astype(np.float32)


def rope(x: nn.Tensor, positions_start, inv_freq: np.ndarray, offset: int = 0, inverse: bool = False,
         name: str = "rope", stride: int = 1, *, forms: Forms) -> nn.Tensor:
    """Rotates interleaved pairs of the last 2*len(inv_freq) channels of x [T, ..., D] at position
    start + t + offset (t the first axis); with stride > 1, at (start // stride + t) * stride + offset
    (rows that are every stride-th position, as compressed rows are). In the CPU forms each row's
    cos and sin are computed once per pair into a table the rotation reads (the same values: one
    sincos per pair, where every element of every head made its own libm call); the GPU forms
    compute them in place."""
    n_rot = 2 * len(inv_freq)

    def f(x_te, fr, start):
        table = None if forms.gpu else _angle_table(x_te.shape[0], n_rot // 2, fr, start, offset, stride, name)
        return te.compute(x_te.shape, _rope_te(lambda i: x_te[i], fr, start, n_rot, x_te.shape[-1],
                                               offset, inverse, stride, table), name=name)

    # Opaque to FuseOps: fused into its neighbours, this kernel makes FuseTIR fail (s_tir RenewDefs,
    # "VarRemapGet(source) == nullptr"; found by marking kernel families opaque one at a time).
    return op.tensor_expr_op(f, name, [x, nn.Tensor.from_const(inv_freq), positions_start], attrs={"op_pattern": 8})


def rms_rope(x: nn.Tensor, eps: float, weight: nn.Tensor | None, positions_start, inv_freq: np.ndarray,
             name: str = "rms_rope", fp8: bool = False, fp4: bool = False, *, forms: Forms, **at) -> nn.Tensor:
    """rope(rms(x, eps, weight), positions_start, inv_freq, **at), with fp8 then the E4M3 round
    trip of the channels before the rotated ones (rounding.fp8_round_rows), with fp4 then
    rounding.hadamard_fp4. In the GPU forms one kernel, the rotation reading the normalized pair
    in registers (with fp8, rows [n, D] only: gpu_kernels.rms_rope_fp8; with fp4, read inline by
    the transform); on the CPU the norm and the rotation are one kernel (the pair's cos and sin from
    rope's table), the rounding another."""
    n_rot = 2 * len(inv_freq)
    assert not (fp8 and fp4)
    if not forms.gpu:
        y = _rms_rope(x, eps, weight, positions_start, inv_freq, name, at, forms)
        y = fp8_round_rows(y, int(x.shape[-1]) - n_rot) if fp8 else y
        return hadamard_fp4(y) if fp4 else y
    if fp4:
        def rotated(x_te, fr, start, *w):
            normalized = _rms_te(lambda i: x_te[i], x_te.shape, eps, w)
            body = _rope_te(lambda i: normalized(*i), fr, start, n_rot, x_te.shape[-1], **at)
            return lambda i: body(*i)

        return hadamard_fp4(x, before=([nn.Tensor.from_const(inv_freq), positions_start]
                                       + ([weight] if weight is not None else []), rotated))
    if fp8:
        func = gpu_kernels.rms_rope_fp8(int(x.shape[-1]), n_rot, float(eps), weight is not None, at.get("offset", 0),
                                        at.get("stride", 1), forms.binds_threads)
        w = weight if weight is not None else nn.Tensor.from_const(np.zeros(1, np.float32))
        return op.tensor_ir_op(func, name, [x, nn.Tensor.from_const(inv_freq), positions_start, w],
                               nn.Tensor.placeholder(x.shape, F32))

    return _rms_rope(x, eps, weight, positions_start, inv_freq, name, at, forms)


def _rms_rope(x: nn.Tensor, eps: float, weight: nn.Tensor | None, positions_start, inv_freq: np.ndarray, name: str,
              at: dict, forms: Forms) -> nn.Tensor:
    """rope(rms(x, eps, weight), ...) as one kernel: in the GPU forms the rotation reads the
    normalized pair inline; in the CPU forms the rows are normalized into a buffer of the kernel's
    own (as the separate norm wrote them, bit for bit), then rotated with rope's table."""
    n_rot = 2 * len(inv_freq)

    def f(x_te, fr, start, *w):
        normalized = _rms_te(lambda i: x_te[i], x_te.shape, eps, w)
        table = None
        if not forms.gpu:   # the normalized rows stored once (the rotation reads each twice), then rotated
            table = _angle_table(x_te.shape[0], n_rot // 2, fr, start, at.get("offset", 0), at.get("stride", 1), name)
            normalized = te.compute(x_te.shape, normalized, name=name + "_norm")
        read = (lambda i: normalized(*i)) if forms.gpu else (lambda i: normalized[i])
        return te.compute(x_te.shape, _rope_te(read, fr, start, n_rot, x_te.shape[-1], **at, table=table), name=name)

    return op.tensor_expr_op(f, name, [x, nn.Tensor.from_const(inv_freq), positions_start]
                             + ([weight] if weight is not None else []), attrs={"op_pattern": 8})


def rope_hadamard_fp4(x: nn.Tensor, positions_start, inv_freq: np.ndarray, name: str = "hadamard_fp4", *, forms: Forms) -> nn.Tensor:
    """hadamard_fp4(rope(x, positions_start, inv_freq)); in the GPU forms one kernel, the
    transform reading the rotated pairs inline."""
    if not forms.gpu:
        return hadamard_fp4(rope(x, positions_start, inv_freq, forms=forms), name)

    def rotated(x_te, fr, start):
        body = _rope_te(lambda i: x_te[i], fr, start, 2 * len(inv_freq), x_te.shape[-1])
        return lambda i: body(*i)

    return hadamard_fp4(x, name, before=([nn.Tensor.from_const(inv_freq), positions_start], rotated))


def _rope_angle(fr, start, t, j, offset: int, stride: int):
    """Row t's angle of pair j."""
    pos = start + t if stride == 1 else (start // stride + t) * stride
    return (pos + offset).astype(F32) * fr[j]


def _rope_te(src, fr, start, n_rot: int, D, offset: int = 0, inverse: bool = False, stride: int = 1, table=None):
    """The rotated element idx of src (an element accessor) for rope's te.compute; table: (cos,
    sin) of each row's pairs, [T, n_rot / 2] (computed here where None)."""
    lo = D - n_rot

    def body(*idx):
        t, d = idx[0], idx[-1]
        rest = idx[1:-1]
        j = (d - lo) // 2
        if table is None:
            theta = _rope_angle(fr, start, t, j, offset, stride)
            c, s = te.cos(theta), te.sin(theta)
        else:
            c, s = table[0][t, tirx.max(j, 0)], table[1][t, tirx.max(j, 0)]
        if inverse:
            s = -s
        even = (d - lo) % 2 == 0
        a = src((t, *rest, tirx.if_then_else(even, d, d - 1)))
        b = src((t, *rest, tirx.if_then_else(even, d + 1, d)))
        rotated = tirx.if_then_else(even, a * c - b * s, a * s + b * c)
        return tirx.if_then_else(d < lo, src(idx), rotated)

    return body


def rope_neox(x: nn.Tensor, positions_start, inv_freq: np.ndarray, offset: int = 0, name: str = "rope_neox",
              *, forms: Forms) -> nn.Tensor:
    """Rotates the first 2*len(inv_freq) channels of x [T, ..., D] in halves (channel i with
    i + len(inv_freq), transformers' rotate_half) at position start + t + offset; in the CPU forms
    each row's cos and sin from a table computed once per pair (as rope's)."""
    half = len(inv_freq)
    freq = nn.Tensor.from_const(inv_freq)

    def f(x_te, fr, start):
        table = None if forms.gpu else _angle_table(x_te.shape[0], half, fr, start, offset, 1, name)

        def body(*idx):
            t, d = idx[0], idx[-1]
            rest = idx[1:-1]
            j = tirx.floormod(d, half)
            if table is None:
                theta = (start + t + offset).astype(F32) * fr[tirx.min(j, half - 1)]
                c, s = te.cos(theta), te.sin(theta)
            else:
                c, s = table[0][t, tirx.min(j, half - 1)], table[1][t, tirx.min(j, half - 1)]
            lo = x_te[(t, *rest, tirx.min(j, d))]
            hi = x_te[(t, *rest, tirx.min(j + half, x_te.shape[-1] - 1))]
            rotated = tirx.if_then_else(d < half, lo * c - hi * s, hi * c + lo * s)
            return tirx.if_then_else(d < 2 * half, rotated, x_te[idx])

        return te.compute(x_te.shape, body, name=name)

    return op.tensor_expr_op(f, name, [x, freq, positions_start], attrs={"op_pattern": 8})


def _angle_table(rows, pairs: int, fr, start, offset: int, stride: int, name: str) -> tuple:
    """(cos, sin) of each row's pair angles, [rows, pairs] each, in one loop nest (where rows
    are many, each loop nest on the cores is a launch of the pool)."""
    def both(t, j):
        theta = _rope_angle(fr, start, t, j, offset, stride)
        return te.cos(theta), te.sin(theta)

    return tuple(te.compute((rows, pairs), both, name=name + "_angle"))


def periodic_rows(table: nn.Tensor, positions_start, n_like: nn.Tensor, period: int, name: str, *, forms: Forms) -> nn.Tensor:
    """table[(start + t) % period] for each row t of n_like (DeepSeek-V4's compressor position
    bias). In the GPU forms marked a broadcast, which it is as far as fusion cares (a row read by
    index, no reduction), so that it fuses with its consumer's add into the GEMV before it."""
    def f(a, x, s):
        return te.compute((x.shape[0], a.shape[1]), lambda t, d: a[tirx.floormod(s + t, period), d], name=name)

    attrs = {"op_pattern": BROADCAST} if forms.gpu else None
    return op.tensor_expr_op(f, name, [table, n_like, positions_start], attrs=attrs)
