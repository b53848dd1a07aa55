"""schedules/fusion.py: fusing a decode whose state is written in place keeps every read of the old
rows before the write (gpu-guide.md section 3). A toy step reads ring row 0, writes a new row at
`start` (0) in place, then adds the old row to ring row 1; its fused build must give the old row,
not the new one. The same module fused without the writers' read dependencies (TVM's passes
alone, the writer only made opaque) reads the new row: the check can fail."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, te, tirx
from tvm.relax import transform as rt

from ds4tvm.nn.state import _ring_write_func

RING, K = 8, 16


def _toy():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, K), "float32"))
    ring = relax.Var("ring", relax.TensorType((RING, K), "float32"))
    s = tirx.Var("s", "int64")
    start = relax.Var("start", relax.ShapeType(values=[s]))
    with bb.function("decode", [x, start, ring], attrs={"num_input": 3}):
        with bb.dataflow():
            old = bb.emit_te(lambda rg, sv: te.compute(
                (1, K), lambda i, j: rg[0, j] + tirx.const(0, "float32") * sv.astype("float32"), name="read_old"), ring, s)
            new = bb.emit_te(lambda a: te.compute(a.shape, lambda i, j: a[i, j] * 2.0, name="scale"), x)
            gv = bb.add_func(_ring_write_func(RING, K), "ring_write")
            ring2 = bb.emit(relax.call_tir_inplace(gv, [ring, new, s], [0], relax.TensorType((RING, K), "float32")))
            nxt = bb.emit_te(lambda rg: te.compute((1, K), lambda i, j: rg[1, j], name="read_next"), ring2)
            out = bb.emit_te(lambda a, b: te.compute(a.shape, lambda i, j: a[i, j] + b[i, j], name="use"), old, nxt)
            o = bb.emit_output(relax.Tuple([out, ring2]))
        bb.emit_func_output(o)
    return bb.finalize()


def _run(fusion) -> np.ndarray:
    mod = tvm.transform.Sequential([rt.LegalizeOps(), *fusion])(_toy())
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(0)
    x, ring = rng.standard_normal((1, K)).astype("float32"), rng.standard_normal((RING, K)).astype("float32")
    out, _ = vm["decode"](tvm.runtime.tensor(x), tvm_ffi.Shape([0]), tvm.runtime.tensor(ring.copy()))
    return out.numpy(), ring[0] + ring[1], 2 * x[0] + ring[1]


def test_fused_reads_of_old_rows_stay_before_the_in_place_write():
    from ds4tvm.schedules.fusion import fusion_passes

    got, old_row, new_row = _run(fusion_passes())
    np.testing.assert_allclose(got[0], old_row, rtol=1e-6)


def test_without_the_read_dependencies_the_fused_read_sees_the_new_row():
    from ds4tvm.kernels.tags import OPAQUE

    @tvm.transform.module_pass(opt_level=0)
    def writer_opaque(mod, _ctx):
        for gv, f in list(mod.functions_items()):
            if gv.name_hint == "ring_write":
                mod[gv] = f.with_attr("op_pattern", OPAQUE)
        return mod

    got, old_row, new_row = _run([rt.AnnotateTIROpPattern(), writer_opaque, rt.FuseOps(), rt.FuseTIR()])
    if np.allclose(got[0], old_row):
        pytest.fail("TVM's fusion kept the read before the write on its own: this test no longer shows the hazard")
    np.testing.assert_allclose(got[0], new_row, rtol=1e-6)


def _gemv_then_hc_post(n):
    """A GEMV [n, D] and hc_post's GPU form after it: one function of n tokens."""
    from ds4tvm.nn.hyper import _hc_post_te
    from ds4tvm.kernels.tags import ELEMWISE, PRESET

    D, Kx, hc = 32, 16, 4
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, Kx), "float32"))
    w = relax.Var("w", relax.TensorType((D, Kx), "float32"))
    X = relax.Var("X", relax.TensorType((n, hc, D), "float32"))
    post = relax.Var("post", relax.TensorType((n, hc), "float32"))
    comb = relax.Var("comb", relax.TensorType((n, hc, hc), "float32"))

    def gemv(a, b):
        k = te.reduce_axis((0, Kx), name="k")
        return te.compute((a.shape[0], D), lambda t, i: te.sum(a[t, k] * b[i, k], axis=k), name="matmul")

    with bb.function("f", [x, w, X, post, comb]):
        with bb.dataflow():
            out = bb.emit_te(gemv, x, w, primfunc_name_hint="qlinear")
            o = bb.emit_output(bb.emit_te(_hc_post_te, out, X, post, comb, primfunc_name_hint="hc_post"))
        bb.emit_func_output(o)
    mod = bb.finalize()
    gv = mod.get_global_var("hc_post")
    mod[gv] = mod[gv].with_attr(PRESET, ELEMWISE)
    return mod


def _fused_names(mod):
    from ds4tvm.schedules.fusion import fusion_passes

    mod = tvm.transform.Sequential(fusion_passes())(mod)
    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))


def test_hc_post_is_the_gemvs_epilogue_in_one_token_calls_only():
    """preset_patterns: hc_post's preset kElemWise lets FuseOps take it into the GEMV before it in
    a call of one token (dlight's GEMV schedules that); with several tokens its analysed pattern
    stays (dlight's Matmul cannot take the epilogue), and so do the two kernels."""
    assert _fused_names(_gemv_then_hc_post(1)) == ["fused_qlinear_hc_post_one_token"]
    assert _fused_names(_gemv_then_hc_post(tirx.Var("n", "int64"))) == ["hc_post", "qlinear"]
