"""Float32 rounding as TIR expressions, from the bits: powers of two, block scales and minifloat
(FP8 / FP4) rounding, shared by nn/rounding.py's blocks and the GPU kernels."""

from __future__ import annotations

from tvm import tirx

F32, U32 = "float32", "uint32"


def _bits(x):
    return tirx.reinterpret(U32, x)


def _from_bits(b):
    return tirx.reinterpret(F32, b)


def _exponent(x):
    """floor(log2(|x|)) for normal float32 x != 0, from the bits."""
    return ((_bits(x) >> tirx.const(23, U32)) & tirx.const(0xFF, U32)).astype("int32") - 127


def _pow2(e):
    """2^e as float32 for -126 <= e <= 127."""
    return _from_bits((e + 127).astype(U32) << tirx.const(23, U32))


def pow2_ceil_scale(amax, top: float):
    """2^ceil(log2(amax / top)); 1 when the block is all zeros."""
    v = amax / tirx.const(top, F32)
    e = _exponent(v)
    exact = (_bits(v) & tirx.const(0x7FFFFF, U32)) == tirx.const(0, U32)
    e = tirx.if_then_else(exact, e, e + 1)
    return tirx.if_then_else(amax > tirx.const(0, F32), _pow2(tirx.max(e, -126)), tirx.const(1.0, F32))


def round_minifloat(y, mant_bits: int, min_exp: int, max_val: float):
    """y (already scaled) to the nearest value with `mant_bits` mantissa bits, exponent >= min_exp
    (smaller magnitudes are subnormal with the spacing of min_exp), clamped to +-max_val."""
    a = tirx.min(tirx.abs(y), tirx.const(max_val, F32))
    e = tirx.if_then_else(a > tirx.const(0, F32), tirx.max(_exponent(a), min_exp), min_exp)
    step = _pow2(e - mant_bits)
    q = tirx.min(tirx.nearbyint(a / step) * step, tirx.const(max_val, F32))
    return tirx.if_then_else(y < tirx.const(0, F32), -q, q)
