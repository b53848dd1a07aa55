"""TVM kernels that read GGUF planes: every format, dense, expert-gathered and row lookups."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ds4tvm.gguf.quant import random_blocks, to_planes

tvm = pytest.importorskip("tvm")
pytestmark = pytest.mark.compile

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q2_K, QT.Q6_K, QT.MXFP4, QT.IQ2_XXS]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_plane_kernels_match_gguf_dequantize(qtype):
    from tvm import relax
    from tvm.relax.frontend import nn

    from ds4tvm.nn.qweight import QWeight

    E, N, K = 3, 8, 512
    rng = np.random.default_rng(int(qtype))

    class M(nn.Module):
        def __init__(self):
            self.w = QWeight("w", qtype, (N, K))
            self.we = QWeight("we", qtype, (E, N, K))

        def f(self, x, ids, sel):
            return self.w.linear(x), self.we.expert_linear(x, sel), self.w.rows(ids)

    spec = {"f": {"x": nn.spec.Tensor(["t", K], "float32"), "ids": nn.spec.Tensor(["t"], "int32"),
                  "sel": nn.spec.Tensor(["t", 2], "int32"), "$": {"param_mode": "plain", "effect_mode": "none"}}}
    mod, params = M().export_tvm(spec=spec)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    raw, raw_e = random_blocks(qtype, (N, K), rng), random_blocks(qtype, (E, N, K), rng)
    W, We = quants.dequantize(raw, qtype), quants.dequantize(raw_e, qtype)
    planes = {"w": to_planes(raw, qtype, (N, K)), "we": to_planes(raw_e, qtype, (E, N, K))}
    args = [tvm.runtime.tensor(np.ascontiguousarray(planes[n.split(".")[0]].fields[n.split("plane_")[1]]))
            for n, _ in params]
    x = rng.standard_normal((5, K)).astype(np.float32)
    ids = np.array([1, 0, 7, 3, 3], np.int32)
    sel = rng.integers(0, E, (5, 2)).astype(np.int32)
    y, ye, rows = vm["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(ids), tvm.runtime.tensor(sel), *args)
    # Rows are the dequantized values bit for bit; products differ only by fp32 summation order.
    assert np.array_equal(rows.numpy(), W[ids])
    ref, ref_e = x @ W.T, np.einsum("tk,tjnk->tjn", x, We[sel])
    assert np.abs(y.numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(ye.numpy() - ref_e).max() <= 1e-5 * np.abs(ref_e).max()
