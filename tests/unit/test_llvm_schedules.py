"""schedules/llvm.py's schedules of TE kernels with many rows (a prefill chunk, verify) against
their one-row builds (decode): a row's outputs do not depend on the rows beside it, bit for bit
(decode, verify and prefill give a token the same logits), and the results are what the kernel
computes (numpy)."""

import numpy as np
import pytest
import tvm
from gguf import GGMLQuantizationType as QT
from gguf import quants
from tvm import relax
from tvm.relax.frontend import nn

from ds4tvm.gguf.quant import derived_plane, random_blocks, to_planes
from ds4tvm.kernels.cpu import blocking_for
from ds4tvm.kernels.forms import CpuLinears, Forms
from ds4tvm.nn.qweight import QWeight, parameter_sources, set_forms
from ds4tvm.nn.rounding import hadamard_fp4
from ds4tvm.schedules.llvm import _row_block, _schedule_hadamard, _top_loops, pipeline

from test_rounding import ref_hadamard_fp4

MODE = {"param_mode": "plain", "effect_mode": "none"}
TARGET = {"kind": "llvm", "num-cores": 2}


def _built(module, shapes: dict):
    """The module's methods named in shapes (name -> input specs), built by this pipeline."""
    for name in shapes:
        setattr(type(module), name, type(module).f)
    mod, params = module.export_tvm(spec={n: {**specs, "$": MODE} for n, specs in shapes.items()})
    target = tvm.target.Target(TARGET)
    return relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=pipeline(target)), tvm.cpu()), params


class Hadamard(nn.Module):
    def f(self, x):
        return hadamard_fp4(x, "hadamard_fp4")


@pytest.mark.parametrize("inner", [(16, 64), (128,)], ids=str)
def test_hadamard_rows_alone_and_together(inner):
    vm, _ = _built(Hadamard(), {"one": {"x": nn.spec.Tensor([1, *inner], "float32")},
                                "rows": {"x": nn.spec.Tensor(["n", *inner], "float32")}})
    x = np.random.default_rng(3).standard_normal((37, *inner)).astype(np.float32)
    together = vm["rows"](tvm.runtime.tensor(x)).numpy()
    alone = np.concatenate([vm["one"](tvm.runtime.tensor(x[i:i + 1])).numpy() for i in range(len(x))])
    assert np.array_equal(together, alone)
    # the float32 sums may differ from numpy's float64 ones in the last bit, which moves a value
    # only where it sits on a rounding boundary: a few of 37 x 1024 at most
    assert np.mean(together != ref_hadamard_fp4(x)) < 1e-3


def test_hadamard_schedule_keeps_one_row_at_a_time():
    """Every stage under one loop nest over the rows (the partial sums of one row at a time, in the
    cache), where each stage was a loop over all rows of its own."""
    mod, _ = Hadamard().export_tvm(spec={"f": {"x": nn.spec.Tensor(["n", 16, 64], "float32"), "$": MODE}})
    func = next(f for _, f in relax.transform.LegalizeOps()(mod).functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert len(_top_loops(func)) == 3
    assert len(_top_loops(_schedule_hadamard(func).mod["main"])) == 1


class HcMix(nn.Module):
    def __init__(self, qtype, shape):
        self.w = QWeight("w", qtype, shape)

    def f(self, x):
        return self.w.linear(x, name="hc_mix")


@pytest.mark.parametrize("qtype,shape", [(QT.F16, (24, 2048)), (QT.F32, (4, 512)), (QT.F16, (40, 256))], ids=str)
def test_row_matmul_rows_alone_and_together(qtype, shape):
    """The float linears of a few output rows (the HC mixes), their rows in blocks: a prefill's or
    verify's rows against decode's one, and numpy."""
    N, K = shape
    module = set_forms(HcMix(qtype, shape), Forms(cpu_linears=CpuLinears(2, blocking_for(tvm.target.Target(TARGET)))))
    sources = parameter_sources(module)
    vm, params = _built(module, {"one": {"x": nn.spec.Tensor([1, K], "float32")},
                                 "rows": {"x": nn.spec.Tensor(["n", K], "float32")}})
    rng = np.random.default_rng(4)
    data = random_blocks(qtype, shape, rng)
    planes = to_planes(data, qtype, shape)
    args = [tvm.runtime.tensor(np.ascontiguousarray(derived_plane(planes, sources[id(p)][1]))) for _, p in params]
    x = rng.standard_normal((19, K)).astype(np.float32)
    together = vm["rows"](tvm.runtime.tensor(x), *args).numpy()
    alone = np.concatenate([vm["one"](tvm.runtime.tensor(x[i:i + 1]), *args).numpy() for i in range(len(x))])
    assert np.array_equal(together, alone)
    want = x.astype(np.float64) @ quants.dequantize(data, qtype).astype(np.float64).T
    np.testing.assert_allclose(together, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_row_blocks_take_a_divisor_that_leaves_every_core_work():
    assert [_row_block(n, 2) for n in (24, 8, 4, 3, 40)] == [8, 4, 2, 1, 8]
