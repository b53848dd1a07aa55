"""schedules/llvm._rows_on_cores: which loops of a kernel it puts on the cores, and that the result
computes what the kernel as written computes, bit for bit."""

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

from ds4tvm.schedules.llvm import (FEW_ROWS, MIN_ROW_WORK, _row_work, _rows_on_cores, _top_loops, few_rows_copies,
                                   schedule_kernels)


@T.prim_func(s_tir=True)
def norm_rows(a: T.handle, b: T.handle):
    n = T.int64()
    x = T.match_buffer(a, (n, T.int64(64)), "float32")
    y = T.match_buffer(b, (n, T.int64(64)), "float32")
    ss = T.sblock_alloc_buffer((n,))
    for i, k in T.grid(n, T.int64(64)):
        with T.sblock("ss"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                ss[vi] = T.float32(0)
            ss[vi] = ss[vi] + x[vi, vk] * x[vi, vk]
    for i, k in T.grid(n, T.int64(64)):
        with T.sblock("norm"):
            vi, vk = T.axis.remap("SS", [i, k])
            y[vi, vk] = x[vi, vk] / T.sqrt(ss[vi] + T.float32(1e-6))


@T.prim_func(s_tir=True)
def scatter_rows(a: T.handle, p: T.handle, b: T.handle):
    """Rows written where an index says (a ring write): two rows may land on one, so not apart."""
    n = T.int64()
    x = T.match_buffer(a, (n, T.int64(8)), "float32")
    at = T.match_buffer(p, (n,), "int64")
    y = T.match_buffer(b, (T.int64(4), T.int64(8)), "float32")
    for i, k in T.grid(n, T.int64(8)):
        with T.sblock("write"):
            vi, vk = T.axis.remap("SS", [i, k])
            y[at[vi], vk] = x[vi, vk]


@T.prim_func(s_tir=True)
def one_row(a: T.handle, b: T.handle):
    x = T.match_buffer(a, (T.int64(1), T.int64(64)), "float32")
    y = T.match_buffer(b, (T.int64(1), T.int64(64)), "float32")
    for i, k in T.grid(T.int64(1), T.int64(64)):
        with T.sblock("double"):
            vi, vk = T.axis.remap("SS", [i, k])
            y[vi, vk] = x[vi, vk] * T.float32(2)


def _kinds(func):
    return [s.kind for s in _top_loops(func)]


def test_apart_row_loops_go_on_the_cores_and_compute_the_same_bits():
    rows = _rows_on_cores(norm_rows, 2, min_row_work=64)
    assert _kinds(rows) == [tirx.ForKind.PARALLEL, tirx.ForKind.PARALLEL]
    assert _rows_on_cores(norm_rows, 1, min_row_work=64) is None   # one core: nothing to share
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    x = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    outs = []
    for f in (norm_rows, rows):
        lib = tvm.compile(tvm.IRModule({"main": f}), target=target)
        y = tvm.runtime.tensor(np.zeros_like(x))
        lib["main"](tvm.runtime.tensor(x), y)
        outs.append(y.numpy())
    assert np.array_equal(outs[0], outs[1])
    assert np.allclose(outs[0], x / np.sqrt((x * x).sum(1, keepdims=True) + 1e-6), rtol=1e-5)


@pytest.mark.parametrize("func", [scatter_rows, one_row], ids=["scatter", "constant-rows"])
def test_rows_written_elsewhere_or_a_constant_count_stay_on_one_core(func):
    assert _rows_on_cores(func, 2, min_row_work=0) is None


def test_rows_of_little_work_stay_on_one_core():
    """64 iterations per row (the norm's sum, then its division): below a launch's worth, the rows
    run on the calling core; counted per row, the loops go on the cores from that much work on."""
    assert _row_work(_top_loops(norm_rows)[0].body) == 64
    assert _rows_on_cores(norm_rows, 2, min_row_work=65) is None
    assert MIN_ROW_WORK > 64


def test_verify_takes_copies_that_keep_little_work_per_row_on_one_core():
    """A kernel both prefill and verify call: prefill's rows share the cores, verify's copy
    (few_rows_copies) keeps its loops of little work per row on the calling core."""
    from tvm import relax, te

    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    for fn in ("prefill", "verify"):
        x = relax.Var("x", relax.TensorType((n, 64), "float32"))
        with bb.function(fn, [x]):
            y = bb.emit_te(lambda t: te.compute(t.shape, lambda i, j: t[i, j] * 2.0, name="double"), x)
            bb.emit_func_output(y)
    mod = tvm.transform.Sequential([few_rows_copies(lambda name: name == "verify"), schedule_kernels(2)])(bb.get())
    called = {fn: [b.value.args[0].name_hint for block in mod[fn].body.blocks for b in block.bindings
                   if isinstance(b.value, relax.Call) and b.value.op.same_as(tvm.ir.Op.get("relax.call_tir"))]
              for fn in ("prefill", "verify")}
    assert called["verify"] != called["prefill"] and FEW_ROWS in mod[called["verify"][0]].attrs
    kinds = {name: _kinds(mod[name]) for name in (called["prefill"][0], called["verify"][0])}
    assert kinds[called["prefill"][0]] == [tirx.ForKind.PARALLEL]
    assert kinds[called["verify"][0]] == [tirx.ForKind.SERIAL]

