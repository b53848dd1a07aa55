"""The CPU's clamped SwiGLU (nn/moe.clamped_swiglu) computes its exp in arithmetic (_exp_value),
which LLVM vectorizes: checked against numpy's exp in float64 and the SwiGLU against its
definition, over the whole float32 range the sigmoid meets."""

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from tvm import te  # noqa: E402

from ds4tvm.nn.moe import _exp_value, _swiglu_value  # noqa: E402

TARGET = {"kind": "llvm"}


def _run(expr, *inputs: np.ndarray) -> np.ndarray:
    n = len(inputs[0])
    args = [te.placeholder((n,), "float32", name=f"x{i}") for i in range(len(inputs))]
    out = te.compute((n,), lambda i: expr(*(a[i] for a in args)), name="out")
    f = tvm.tirx.build(te.create_prim_func([*args, out]), target=TARGET)
    y = tvm.runtime.empty((n,), "float32")
    f(*[tvm.runtime.tensor(x) for x in inputs], y)
    return y.numpy()


def test_exp_is_within_one_ulp_of_exp_and_clamped_outside():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-120, 120, 1 << 15), rng.normal(0, 8, 1 << 15),
                        [0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0]]).astype(np.float32)
    y, ref = _run(_exp_value, x), np.exp(x.astype(np.float64))
    inside = (x > -87.33) & (x < 88.37)
    rel = np.abs(y[inside] - ref[inside]) / ref[inside]
    assert rel.max() < 1.2e-7                         # float32's epsilon: within one ulp
    assert np.isfinite(y).all() and (y > 0).all()     # no inf, no zero, no NaN at the clamps
    assert y[x <= -87.33].max() < 1.2e-38 * 1.001    # below the range: the smallest normal float32
    assert 1.0 + y[x <= -87.33].max() == 1.0


def test_clamped_swiglu_matches_its_definition():
    rng = np.random.default_rng(1)
    g = np.concatenate([rng.normal(0, 4, 4096), [-200.0, -90.0, 0.0, 90.0, 200.0]]).astype(np.float32)
    u = rng.normal(0, 4, len(g)).astype(np.float32)
    for limit in (0.0, 7.0):
        y = _run(lambda a, b: _swiglu_value(a, b, limit), g, u)
        gc, uc = g.astype(np.float64), u.astype(np.float64)
        if limit > 0:
            gc, uc = np.minimum(gc, limit), np.clip(uc, -limit, limit)
        ref = gc / (1.0 + np.exp(-gc)) * uc
        assert np.allclose(y, ref, rtol=4e-7, atol=1e-30), limit
