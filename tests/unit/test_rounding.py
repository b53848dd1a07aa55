"""The FP8-E4M3 and Hadamard + FP4-E2M1 round trips, op by op against a numpy reference written
from ds4-spec §2 by enumerating the formats' value grids (independent of the kernels' bit tricks)."""

import math

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytestmark = pytest.mark.compile


def grid(exp_bits, mant_bits, bias, max_val):
    """Every finite non-negative value of a minifloat (subnormals included), sorted."""
    vals = [m / 2 ** mant_bits * 2.0 ** (1 - bias) for m in range(2 ** mant_bits)]
    for e in range(1, 2 ** exp_bits):
        vals += [(1 + m / 2 ** mant_bits) * 2.0 ** (e - bias) for m in range(2 ** mant_bits)]
    return np.array(sorted(v for v in vals if v <= max_val))


E4M3 = grid(4, 3, 7, 448.0)     # 0 .. 448
E2M1 = grid(2, 1, 1, 6.0)       # 0, 0.5, 1, 1.5, 2, 3, 4, 6


def round_to_grid(y, g):
    """Nearest grid value, ties to the even mantissa (even index in the grid), sign kept."""
    a = np.minimum(np.abs(y), g[-1])
    hi = np.clip(np.searchsorted(g, a), 1, len(g) - 1)
    lo = hi - 1
    dlo, dhi = a - g[lo], g[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(y) * g[pick]


def pow2_scale(amax, top):
    with np.errstate(divide="ignore"):
        return np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-38) / top)), 1.0)


def ref_fp8_rows(x, n_plain):
    out = x.astype(np.float64).copy()
    for b0 in range(0, n_plain, 64):
        blk = out[:, b0:min(b0 + 64, n_plain)]
        s = pow2_scale(np.abs(blk).max(1, keepdims=True), 448.0)
        out[:, b0:b0 + blk.shape[1]] = round_to_grid(blk / s, E4M3) * s
    return out.astype(np.float32)


def ref_hadamard_fp4(x):
    D = x.shape[-1]
    h = np.array([[1.0]])
    while h.shape[0] < D:
        h = np.block([[h, h], [h, -h]])
    y = (x.astype(np.float64) @ (h / math.sqrt(D)).T).astype(np.float32).astype(np.float64)
    blocks = y.reshape(*y.shape[:-1], D // 32, 32)
    s = pow2_scale(np.abs(blocks).max(-1, keepdims=True), 6.0)
    return (round_to_grid(blocks / s, E2M1) * s).reshape(y.shape).astype(np.float32)


def build(fn, shape):
    from tvm import relax
    from tvm.relax.frontend import nn

    class M(nn.Module):
        def f(self, x):
            return fn(x)

    mod, _ = M().export_tvm(spec={"f": {"x": nn.spec.Tensor(list(shape), "float32"),
                                        "$": {"param_mode": "none", "effect_mode": "none"}}})
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return lambda a: vm["f"](tvm.runtime.tensor(a)).numpy()


def test_grids():
    assert len(E4M3) == 127 and E4M3[1] == 2.0 ** -9 and E4M3[-1] == 448.0
    assert list(E2M1) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_fp8_rows_match_reference():
    from ds4tvm.nn.rounding import fp8_round_rows

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((9, 512)) * np.exp(rng.uniform(-12, 6, (9, 1)))).astype(np.float32)
    x[1, :64] = 0.0                                  # an all-zero block
    x[2, :448] = np.float32(0.0625) * 17 / 16        # halfway between two E4M3 values: ties to even
    x[3, 5] = 1e4                                    # a large value sets its block's scale
    fn = build(lambda t: fp8_round_rows(t, 448), x.shape)
    got, want = fn(x), ref_fp8_rows(x, 448)
    assert np.array_equal(got[:, 448:], x[:, 448:])  # the RoPE channels are untouched
    assert np.array_equal(got, want)
    rel = np.abs(got[:, :448] - x[:, :448]) / np.abs(x[:, :448]).max(1, keepdims=True)
    assert rel.max() < 2 ** -4 and np.abs(got - x).max() > 0


def test_fp8_partial_block():
    """Tiny models have fewer than 64 non-RoPE channels: one partial block."""
    from ds4tvm.nn.rounding import fp8_round_rows

    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    got = build(lambda t: fp8_round_rows(t, 48), x.shape)(x)
    assert np.array_equal(got, ref_fp8_rows(x, 48))


@pytest.mark.parametrize("shape", [(5, 128), (3, 4, 64)], ids=str)
def test_hadamard_fp4_matches_reference(shape):
    from ds4tvm.nn.rounding import hadamard_fp4

    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    got = build(hadamard_fp4, shape)(x)
    want = ref_hadamard_fp4(x)
    # The transform's float32 sums may differ from numpy's float64 ones in the last bit, which
    # only matters for a value sitting on a rounding boundary: none does in this data.
    assert np.array_equal(got, want)
    assert len(np.unique(np.abs(got))) > 4 and np.abs(got).max() > 0
