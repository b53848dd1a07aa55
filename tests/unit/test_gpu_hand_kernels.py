"""The hand-written GPU kernels of the GPU forms (kernels/gpu.py), run here with their loops
serial (bind=False, as Forms(gpu=True, on_gpu=False) exports them), against the CPU's kernels for the
same blocks (TE, scheduled by schedules/llvm.py) and against numpy."""

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
pytestmark = pytest.mark.compile


def build(fn, specs: dict, gpu: bool):
    """fn(*tensors, start) exported with the given argument specs ({name: (shape, dtype)}, then
    the int start), in the GPU forms with serial loops when gpu, for llvm."""
    from tvm import relax
    from tvm.relax.frontend import nn

    from ds4tvm.kernels.forms import TE, Forms

    names = ", ".join(specs)
    scope = {"fn": fn}
    exec(f"def f(self, {names}, start):\n    return fn({names}, start, forms=self.forms)", scope)   # the exporter reads the signature
    M = type("M", (nn.Module,), {"f": scope["f"]})
    spec = {name: nn.spec.Tensor(list(shape), dtype) for name, (shape, dtype) in specs.items()}
    spec = {"f": {**spec, "start": int, "$": {"param_mode": "none", "effect_mode": "none"}}}
    m = M()
    m.forms = Forms(gpu=True, on_gpu=False) if gpu else TE
    mod, _ = m.export_tvm(spec=spec)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())

    def run(*arrays, start):
        out = vm["f"](*[tvm.runtime.tensor(a) for a in arrays], tvm_ffi.Shape([start]))
        return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]
    return run


@pytest.mark.parametrize("rounding,at", [("fp8", {}), ("fp8", {"offset": -3}), ("fp8", {"stride": 4}),
                                         ("fp4", {"offset": -3}), ("fp4", {"stride": 4})], ids=str)
def test_rms_rope_rounding_forms_equal_the_cpu_kernels(rounding, at):
    """rms_rope with fp8 (the hand kernel gpu_kernels.rms_rope_fp8) or fp4 (the Hadamard transform
    reading the normalized, rotated rows inline: the indexer compressor's rows) against the CPU's
    rms, rope and rounding kernels."""
    from ds4tvm.nn.norm_rope import rms_rope, rope_inv_freq

    freq = rope_inv_freq(16, 10000.0, None)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((5, 128)) * np.exp(rng.uniform(-3, 3, (5, 1)))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 128).astype(np.float32)
    specs = {"x": ((5, 128), "float32"), "w": ((128,), "float32")}

    def fn(xt, wt, start, forms):
        return rms_rope(xt, 1e-6, wt, start, freq, **{rounding: True}, **at, forms=forms)

    ours = build(fn, specs, gpu=True)(x, w, start=37)
    cpu = build(fn, specs, gpu=False)(x, w, start=37)
    assert np.abs(ours - cpu).max() <= 1e-6 * np.abs(cpu).max()
    if rounding == "fp8":   # the rounding happened
        assert len(np.unique(ours[:, :112])) < len(np.unique(x[:, :112]))
    else:   # E2M1: 8 magnitudes times each block's scale
        assert max(len(np.unique(b)) for row in np.abs(ours).reshape(5, 4, 32) for b in row) <= 8


def test_choose_experts_kernel_ranks_like_topk_and_weighs_like_route_weights():
    from tvm import tirx

    from ds4tvm.nn.moe import choose_experts

    E, k = 16, 6
    rng = np.random.default_rng(6)
    scores = rng.uniform(0.1, 1.0, (4, E)).astype(np.float32)
    scores[1, [2, 7, 9]] = scores[1, 4]          # ties: the lower index first
    bias = rng.uniform(-0.05, 0.05, E).astype(np.float32)
    specs = {"scores": ((4, E), "float32"), "bias": ((E,), "float32")}

    def fn(s, b, start, forms):
        return choose_experts(s, k, b, lambda total: tirx.max(total, tirx.const(6.1e-5, "float32")), 2.5, forms=forms)

    ids, weights = build(fn, specs, gpu=True)(scores, bias, start=0)
    biased = scores + bias
    want = np.argsort(-biased, axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids, want)
    chosen = np.take_along_axis(scores, want, axis=1)
    assert np.allclose(weights, chosen / np.maximum(chosen.sum(1, keepdims=True), 6.1e-5) * 2.5, rtol=1e-6)
    cpu_ids, cpu_weights = build(fn, specs, gpu=False)(scores, bias, start=0)
    assert np.array_equal(ids, cpu_ids) and np.array_equal(weights, cpu_weights)
    scores[2, 3] = np.nan                        # ranks collide: ids stay experts all the same
    ids, _ = build(fn, specs, gpu=True)(scores, bias, start=0)
    assert ids.min() >= 0 and ids.max() < E


@pytest.mark.parametrize("kind", ["window", "window+all rows", "window+selected rows"])
def test_window_attention_kernel_equals_the_te_attention(kind):
    """The one-kernel attention reading the ring in place (nn/state.RingRows), with the inverse
    RoPE, against the TE attention over gather_context's rows and a rope() after it."""
    from ds4tvm.nn.attention import sparse_window_attention
    from ds4tvm.nn.norm_rope import rope_inv_freq
    from ds4tvm.nn.state import context_rows

    H, D, window, ratio, n, start = 4, 64, 16, 4, 3, 41
    size, rows, M = window + 4, 32, 5
    freq = rope_inv_freq(16, 10000.0, None)
    rng = np.random.default_rng(7)
    arrays = {"q": rng.standard_normal((n, H, D)), "ring": rng.standard_normal((size, D)),
              "new": rng.standard_normal((n, D)), "sinks": rng.standard_normal(H),
              "comp": rng.standard_normal((rows, D)),
              "sel": rng.integers(0, (start + n) // ratio + 2, (n, M))}   # some not visible yet
    arrays = {k: v.astype(np.int32 if k == "sel" else np.float32) for k, v in arrays.items()}
    names = ["q", "ring", "new", "sinks"] + (["comp"] if "rows" in kind else []) \
        + (["sel"] if "selected" in kind else [])
    specs = {name: (arrays[name].shape, str(arrays[name].dtype)) for name in names}

    def fn(q, ring, new, sinks, *rest, forms):
        *tables, start_ = rest
        comp = tables[0] if tables else None
        sel = tables[1] if len(tables) > 1 else None
        ctx = context_rows(ring, new, start_, window - 1, name="ctx", forms=forms)
        return sparse_window_attention(q, ctx, comp, sel, sinks, start_, window, ratio, "attention", rope_back=freq, forms=forms)

    args = [arrays[name] for name in names]
    ours = build(fn, specs, gpu=True)(*args, start=start)
    theirs = build(fn, specs, gpu=False)(*args, start=start)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    assert np.abs(theirs).max() > 0.1


def test_window_attention_kernel_writes_a_decode_steps_row_into_the_ring():
    """A decode step's attention kernel also writes its K=V row into the ring (in place): the
    same output and the same ring as attention then ring_write."""
    from ds4tvm.nn.attention import sparse_window_attention
    from ds4tvm.nn.norm_rope import rope_inv_freq
    from ds4tvm.nn.state import context_rows

    H, D, window, start = 4, 64, 16, 45
    freq = rope_inv_freq(16, 10000.0, None)
    rng = np.random.default_rng(8)
    shapes = ((1, H, D), (window + 4, D), (1, D), (H,))
    q, ring, new, sinks = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    specs = {"q": ((1, H, D), "float32"), "ring": (ring.shape, "float32"), "new": ((1, D), "float32"),
             "sinks": ((H,), "float32")}

    def fn(q_, ring_, new_, sinks_, start_, forms):
        ctx = context_rows(ring_, new_, start_, window - 1, name="ctx", forms=forms)
        return sparse_window_attention(q_, ctx, None, None, sinks_, start_, window, 1, "attention", rope_back=freq,
                                       write_ring=(ring_, new_), forms=forms)

    ours = build(fn, specs, gpu=True)(q, ring.copy(), new, sinks, start=start)
    theirs = build(fn, specs, gpu=False)(q, ring.copy(), new, sinks, start=start)
    assert np.abs(ours[0] - theirs[0]).max() <= 1e-5 * np.abs(theirs[0]).max()
    want = ring.copy()
    want[start % len(ring)] = new[0]
    assert np.array_equal(ours[1], want) and np.array_equal(theirs[1], want)


def test_table_experts_kernel_reads_the_table_rows_and_weighs_like_route_weights():
    from tvm import tirx

    from ds4tvm.nn.moe import table_experts

    E, V, k = 16, 10, 4
    rng = np.random.default_rng(8)
    table = np.stack([rng.permutation(E)[:k] for _ in range(V)]).astype(np.int32)
    ids = np.array([3, 0, 9], np.int32)
    scores = rng.uniform(0.1, 1.0, (3, E)).astype(np.float32)
    specs = {"scores": ((3, E), "float32"), "table": ((V, k), "int32"), "ids": ((3,), "int32")}

    def fn(s, tb, i, start, forms):
        return table_experts(tb, i, s, lambda total: tirx.max(total, tirx.const(6.1e-5, "float32")), 1.5, forms=forms)

    experts, weights = build(fn, specs, gpu=True)(scores, table, ids, start=0)
    assert np.array_equal(experts, table[ids])
    chosen = np.take_along_axis(scores, table[ids], axis=1)
    assert np.allclose(weights, chosen / np.maximum(chosen.sum(1, keepdims=True), 6.1e-5) * 1.5, rtol=1e-6)
    cpu_experts, cpu_weights = build(fn, specs, gpu=False)(scores, table, ids, start=0)
    assert np.array_equal(experts, cpu_experts) and np.array_equal(weights, cpu_weights)
