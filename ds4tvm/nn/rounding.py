"""ds4's low-precision round trips, which no oracle reproduces (ds4-spec §2):
- FP8-E4M3 on the non-RoPE channels of every cached K=V row: blocks of 64 values, a power-of-two
  scale 2^ceil(log2(amax/448)), values clamped to +-448, round to nearest even;
- the indexer's keys and queries: a normalised Hadamard transform over the head, then FP4-E2M1
  in blocks of 32 with a power-of-two scale 2^ceil(log2(amax/6)), range +-6.
Values are rounded and kept in float32 (the cache holds what an FP8/FP4 cache would give back)."""

from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels.minifloat import pow2_ceil_scale, round_minifloat

F32, U32 = "float32", "uint32"


def fp8_round_rows(x: nn.Tensor, n_plain: int, name: str = "fp8_round") -> nn.Tensor:
    """E4M3 round trip of channels [0, n_plain) of each row of x [T, D] in blocks of 64."""
    def f(x_te):
        T, D = x_te.shape
        nb = (n_plain + 63) // 64
        j = te.reduce_axis((0, 64), name="j")
        amax = te.compute((T, nb), lambda t, b: te.max(tirx.if_then_else(
            b * 64 + j < n_plain, tirx.abs(x_te[t, tirx.min(b * 64 + j, D - 1)]), tirx.const(0, F32)), axis=j),
            name=name + "_amax")

        def body(t, d):
            scale = pow2_ceil_scale(amax[t, tirx.min(d // 64, nb - 1)], 448.0)
            q = round_minifloat(x_te[t, d] / scale, 3, -6, 448.0) * scale
            return tirx.if_then_else(d < n_plain, q, x_te[t, d])

        return te.compute((T, D), body, name=name)

    return op.tensor_expr_op(f, name, [x])


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order n (a power of two), scaled by 1/sqrt(n)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def hadamard_fp4(x: nn.Tensor, name: str = "hadamard_fp4", before=None) -> nn.Tensor:
    """Normalised Hadamard transform over the last axis of x [T, (H,) D], then E2M1 in blocks of
    32 with power-of-two scales (range +-6). before (tensors, accessor): the transform reads
    accessor(x_te, *their TE tensors)(index) instead of x (an elementwise step run inline)."""
    D = int(x.shape[-1])
    h = nn.Tensor.from_const(hadamard_matrix(D))
    extra, accessor = before if before is not None else ([], None)

    def f(x_te, h_te, *more):
        src = accessor(x_te, *more) if accessor is not None else (lambda i: x_te[i])
        k = te.reduce_axis((0, D), name="k")
        # h is symmetric: read by its row k, the outputs are contiguous (schedules/llvm.py's vectors)
        y = te.compute(x_te.shape, lambda *i: te.sum(src((*i[:-1], k)) * h_te[k, i[-1]], axis=k), name=name + "_h")
        j = te.reduce_axis((0, 32), name="j")
        amax = te.compute((*x_te.shape[:-1], D // 32), lambda *i: te.max(
            tirx.abs(y[(*i[:-1], i[-1] * 32 + j)]), axis=j), name=name + "_amax")

        def body(*i):
            scale = pow2_ceil_scale(amax[(*i[:-1], i[-1] // 32)], 6.0)
            return round_minifloat(y[i] / scale, 1, 0, 6.0) * scale

        return te.compute(x_te.shape, body, name=name)

    return op.tensor_expr_op(f, name, [x, h, *extra])
