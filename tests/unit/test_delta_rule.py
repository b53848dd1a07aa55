"""The gated delta rule kernels (nn/linear_attention.py), the CPU form and the GPU form (run with its
thread loops serial), against numpy on snapshot slots: the state before row i is read from slot
(start + i) % R (zeros at position 0) and the state after it lands in the next slot."""

import numpy as np
import pytest

pytestmark = pytest.mark.unit
H, DK, DV, R = 3, 8, 4, 4


def _numpy(q, k, v, g, beta, slots, start):
    slots, out = slots.copy(), np.zeros((len(q), H, DV))
    for i in range(len(q)):
        pos = start + i
        S = slots[pos % R].reshape(H, DK, DV) if pos > 0 else np.zeros((H, DK, DV))
        S = S * np.exp(g[i])[:, :, None]
        u = beta[i][:, None] * (v[i] - np.einsum("hkv,hk->hv", S, k[i]))
        S = S + k[i][:, :, None] * u[:, None, :]
        out[i] = np.einsum("hkv,hk->hv", S, q[i])
        slots[(pos + 1) % R] = S.reshape(-1)
    return out, slots


@pytest.mark.parametrize("start", [0, 2, 5])
@pytest.mark.parametrize("form", ["cpu", "gpu-serial"])
def test_delta_rule_kernels_match_numpy(form, start):
    import tvm

    from ds4tvm.nn.linear_attention import _delta_rule_func, _delta_rule_gpu_func

    func = _delta_rule_func(H, DK, DV, R) if form == "cpu" else _delta_rule_gpu_func(H, DK, DV, R, bind=False)
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
    rng = np.random.default_rng(start)
    n = 3
    q, k = rng.standard_normal((2, n, H, DK)).astype(np.float32)
    v = rng.standard_normal((n, H, DV)).astype(np.float32)
    g = -rng.uniform(0, 1, (n, H, DK)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, H)).astype(np.float32)
    slots = rng.standard_normal((R, H * DK * DV)).astype(np.float32)
    want_out, want_slots = _numpy(q, k, v, g, beta, slots, start)
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in (q, k, v, g, beta, slots)]
    out = tvm.runtime.tensor(np.zeros((n, H, DV), np.float32), dev)
    lib["main"](*args, start, out)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(args[5].numpy(), want_slots, rtol=0, atol=1e-5)
