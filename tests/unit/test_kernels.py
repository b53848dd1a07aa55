"""TVM kernels that read GGUF planes: every format, dense, expert-gathered and row lookups."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ds4tvm.gguf.quant import derived_plane, random_blocks, to_planes
from ds4tvm.kernels import cpu_int8, cpu_interleaved

tvm = pytest.importorskip("tvm")
pytestmark = pytest.mark.compile

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q4_K, QT.Q2_K, QT.Q6_K, QT.MXFP4, QT.IQ2_XXS]


# The GPU forms (nn/qweight.py, kernels/gpu.py) exported for llvm: the same kernels as on a GPU
# without their thread bindings; K = 256 sends the K-quants' experts to the flat form.
PLANE_CASES = ([pytest.param(t, 512, False, id=t.name) for t in TYPES]
               + [pytest.param(t, 512, True, id=f"{t.name}-gpu-forms") for t in TYPES]
               + [pytest.param(t, 256, True, id=f"{t.name}-gpu-forms-flat") for t in (QT.Q4_K, QT.Q2_K, QT.Q6_K)])


@pytest.mark.parametrize("qtype,K,gpu", PLANE_CASES)
def test_plane_kernels_match_gguf_dequantize(qtype, K, gpu):

    from tvm import relax
    from tvm.relax.frontend import nn

    from ds4tvm.kernels.forms import TE, Forms
    from ds4tvm.nn.qweight import QWeight, set_forms

    E, N = 3, 8
    rng = np.random.default_rng(int(qtype))

    class M(nn.Module):
        def __init__(self):
            self.w = QWeight("w", qtype, (N, K))
            self.we = QWeight("we", qtype, (E, N, K))

        def f(self, x, ids, sel):
            return self.w.linear(x), self.we.expert_linear(x, sel), self.w.rows(ids)

    spec = {"f": {"x": nn.spec.Tensor(["t", K], "float32"), "ids": nn.spec.Tensor(["t"], "int32"),
                  "sel": nn.spec.Tensor(["t", 2], "int32"), "$": {"param_mode": "plain", "effect_mode": "none"}}}
    mod, params = set_forms(M(), Forms(gpu=True, on_gpu=False) if gpu else TE).export_tvm(spec=spec)
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


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.Q8_0], ids=lambda t: t.name)
def test_expert_swiglu_gpu_forms_match_numpy(qtype):
    """The routed experts' up projection with the clamped SwiGLU as its epilogue (QWeight.
    expert_swiglu) in the GPU forms built for llvm: the flat form (IQ2_XXS, HandGEMV on GPUs) and
    the blockized one (Q8_0), against numpy's SiLU(min(g, limit)) * clip(x @ W[e]^T, +-limit)."""
    from tvm import relax
    from tvm.relax.frontend import nn

    from ds4tvm.kernels.forms import Forms
    from ds4tvm.nn.qweight import QWeight, set_forms

    E, N, K, J, limit = 3, 8, 512, 2, 1.5
    rng = np.random.default_rng(11)

    class M(nn.Module):
        def __init__(self):
            self.we = QWeight("we", qtype, (E, N, K))

        def f(self, x, gate, sel):
            return self.we.expert_swiglu(gate, x, sel, limit)

    spec = {"f": {"x": nn.spec.Tensor(["t", K], "float32"), "gate": nn.spec.Tensor(["t", J, N], "float32"),
                  "sel": nn.spec.Tensor(["t", J], "int32"), "$": {"param_mode": "plain", "effect_mode": "none"}}}
    mod, params = set_forms(M(), Forms(gpu=True, on_gpu=False)).export_tvm(spec=spec)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    raw = random_blocks(qtype, (E, N, K), rng)
    planes = to_planes(raw, qtype, (E, N, K))
    args = [tvm.runtime.tensor(np.ascontiguousarray(planes.fields[n.split("plane_")[1]])) for n, _ in params]
    x = rng.standard_normal((4, K)).astype(np.float32) * 0.1
    gate = rng.standard_normal((4, J, N)).astype(np.float32) * 2
    sel = rng.integers(0, E, (4, J)).astype(np.int32)
    act = vm["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(gate), tvm.runtime.tensor(sel), *args).numpy()
    up = np.einsum("tk,tjnk->tjn", x, quants.dequantize(raw, qtype)[sel])
    g = np.minimum(gate, limit)
    want = g / (1 + np.exp(-g)) * np.clip(up, -limit, limit)
    assert np.abs(up).max() > limit and gate.max() > limit   # both clamps are exercised
    assert np.abs(act - want).max() <= 1e-5 * np.abs(want).max()


# One of each kind of kernel in the default run (one plane with a scale, a K-quant super-block,
# bits decoded to values, 8-lane grid rows; F16's one plane is Q8_0's path without the scale); the
# rest under -m slow.
CPU_DEFAULT = (QT.Q8_0, QT.Q4_K, QT.MXFP4, QT.IQ2_XXS)


@pytest.mark.parametrize("qtype", [t if t in CPU_DEFAULT else pytest.param(t, marks=pytest.mark.slow) for t in TYPES],
                         ids=lambda t: t.name)
def test_cpu_kernels_match_gguf_dequantize(qtype):
    """kernels/cpu.py (chosen when exporting for a CPU target): dense, grouped and routed-expert
    linears, for token counts that take every path (register dequantization, a dequantized tile
    from 12 tokens, every leftover of blocks of 6 in blocks of 4/2/1, experts with no, one, few and
    many slots)."""
    _check_cpu_kernels(qtype, int8=None)


@pytest.mark.parametrize("qtype", (pytest.param(QT.Q8_0, marks=pytest.mark.slow), QT.IQ2_XXS), ids=lambda t: t.name)
def test_cpu_kernels_round_alike_in_every_register_blocking(qtype):
    """The AVX2 and SSE/NEON blockings (2 rows x 3 or 1 tokens: other token blocks and leftovers) against gguf's
    dequantizer as above, and bit for bit equal to the AVX-512 blocking's outputs: the order of a
    token's sums does not depend on the blocking."""
    from ds4tvm.kernels.cpu import BLOCKINGS

    outputs = {bits: _check_cpu_kernels(qtype, int8=None, blocking=BLOCKINGS[bits]) for bits in (512, 256, 128)}
    for bits in (256, 128):
        assert all(np.array_equal(a, b) for a, b in zip(outputs[512], outputs[bits], strict=True)), bits


# (format, dot instruction) in the default run: IQ2_XXS's gathered codes on VNNI, its magnitudes
# and signs apart on AVX2, MXFP4's looked-up signed codes on AVX2; the others (Q8_0's signed codes,
# Q4_K's and Q2_K's unsigned ones with offsets) under -m slow
INT8_DEFAULT = {(QT.IQ2_XXS, "vpdpbusd"), (QT.IQ2_XXS, "vpmaddubsw"), (QT.MXFP4, "vpmaddubsw")}
FEATURE = {"vpdpbusd": "avx512vnni", "vpmaddubsw": "avx2"}


@pytest.mark.parametrize("qtype,dot", [pytest.param(t, d, marks=() if (t, d) in INT8_DEFAULT else pytest.mark.slow,
                                                    id=f"{t.name}-{d}")
                                       for d in FEATURE for t in cpu_int8.FORMATS[d]])
def test_int8_activation_kernels_match_gguf_q8_0_inputs(qtype, dot):
    """The --int8-activations kernels (kernels/cpu_int8.py) with each dot instruction this CPU has (an
    AVX-512 VNNI CPU runs the AVX2 one too), in every form and token count as above, against gguf's
    dequantized weights times the inputs as gguf's Q8_0 quantizer rounds them (its codes, with the
    block scale kept in float32). Their difference from the float inputs' product (~1e-3 of the
    largest output) is 100x the tolerance, so a kernel that skipped the rounding fails."""
    from tvm.target import codegen

    from ds4tvm.compile.targets import resolve

    if not codegen.target_has_features(FEATURE[dot], tvm.target.Target(resolve("cpu").tvm)):
        pytest.skip(f"this CPU has no {FEATURE[dot]}, which the {dot} kernels need")
    _check_cpu_kernels(qtype, int8=dot, interleaved=False)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.MXFP4, QT.Q4_K, QT.Q2_K, QT.IQ2_XXS], ids=lambda t: t.name)
def test_interleaved_kernels_match_gguf_q8_0_inputs(qtype):
    """Q8_0, MXFP4, Q4_K, Q2_K and IQ2_XXS on AVX-512 VNNI (kernels/cpu_interleaved.py, 16 rows interleaved, the
    default there): every form and token count against the same reference as the row-major int8
    kernels, a token's outputs bit for bit alike whatever the tokens beside it, and an embedding's
    rows read from the interleaved planes equal to gguf's dequantized rows, bit for bit."""
    from tvm.target import codegen

    from ds4tvm.compile.targets import resolve
    from ds4tvm.kernels.cpu import BLOCKINGS
    from ds4tvm.kernels.dequant import tables
    from ds4tvm.kernels.forms import CpuLinears, Forms
    from ds4tvm.nn.qweight import QWeight, set_forms

    if not codegen.target_has_features("avx512vnni", tvm.target.Target(resolve("cpu").tvm)):
        pytest.skip("this CPU has no avx512vnni, which the interleaved kernels need")
    _check_cpu_kernels(qtype, int8="vpdpbusd")
    N, K = 48, 512
    w = set_forms(QWeight("w", qtype, (N, K)), Forms(cpu_linears=CpuLinears(2, BLOCKINGS[512], "vpdpbusd")))
    assert w.derive == "r16"
    raw = random_blocks(qtype, (N, K), np.random.default_rng(5))
    planes = to_planes(raw, qtype, (N, K))
    P = {f: tvm.te.placeholder(getattr(w, f"plane_{f}").shape, getattr(w, f"plane_{f}").dtype, f) for f in w.fields}
    consts = tables(qtype)   # the TE expressions' lookup tables (IQ2_XXS)
    P.update({n: tvm.te.placeholder(v.shape, str(v.dtype), n) for n, v in consts.items()})
    ids = tvm.te.placeholder((N,), "int32", "ids")
    rows = tvm.te.compute((N, K), lambda t, k: w._deq(P, (ids[t],), k))
    f = tvm.compile(tvm.te.create_prim_func([ids, *P.values(), rows]), target="llvm")
    order = np.random.default_rng(6).permutation(N).astype(np.int32)
    out = tvm.runtime.empty((N, K), "float32")
    f(tvm.runtime.tensor(order), *(tvm.runtime.tensor(derived_plane(planes, f"{n}:r16")) for n in w.fields),
      *(tvm.runtime.tensor(v) for v in consts.values()), out)
    assert np.array_equal(out.numpy(), quants.dequantize(raw, qtype)[order])


def q8_0_inputs(x: np.ndarray) -> np.ndarray:
    """x as the int8 path sees it: gguf's Q8_0 codes per 32 values times amax / 127 in float32."""
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    codes = quants.quantize(rows, QT.Q8_0).reshape(len(rows), K // 32, 34)[..., 2:].view(np.int8)
    d = np.abs(rows.reshape(len(rows), K // 32, 32)).max(-1, keepdims=True) / np.float32(127)
    return (codes.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def _check_cpu_kernels(qtype, int8: str | None, blocking=None, interleaved: bool = True) -> list:
    """Checks the kernels of one format (by default in the AVX-512 blocking, whose token blocks of
    6 have every leftover) and returns their outputs."""
    from tvm import relax
    from tvm.relax.frontend import nn
    from tvm.target import codegen

    from ds4tvm.compile.targets import llvm_json
    from ds4tvm.kernels import cpu as cpu_kernels
    from ds4tvm.kernels.forms import CpuLinears, Forms
    from ds4tvm.nn.qweight import QWeight, parameter_sources, set_forms

    blocking = blocking or cpu_kernels.BLOCKINGS[512]
    from ds4tvm.schedules.llvm import pipeline

    E, N, K, G, J = 4, 64, 256, 2, 3
    rng = np.random.default_rng(int(qtype) + 100)

    class M(nn.Module):
        def __init__(self):
            self.w = QWeight("w", qtype, (N, K))
            self.we = QWeight("we", qtype, (E, N, K))

        def f(self, x, xg, xe, sel):
            return (self.w.linear(x), self.w.grouped_linear(xg, G), self.we.expert_linear(x, sel),
                    self.we.expert_linear(xe, sel))

        def f1(self, x, xg, xe, sel):
            return self.f(x, xg, xe, sel)

    def inputs(t):   # t tokens: "t" for any number (verify, prefill), 1 for decode's static shape
        return {"x": nn.spec.Tensor([t, K], "float32"), "xg": nn.spec.Tensor([t, G, K], "float32"),
                "xe": nn.spec.Tensor([t, J, K], "float32"), "sel": nn.spec.Tensor([t, J], "int32"),
                "$": {"param_mode": "plain", "effect_mode": "none"}}

    forms = Forms(cpu_linears=CpuLinears(2, blocking, int8, interleaved))
    model = set_forms(M(), forms)
    sources = parameter_sources(model)
    mod, params = model.export_tvm(spec={"f": inputs("t"), "f1": inputs(1)})
    script = mod.script()
    assert "row_matmul" not in script   # no TE linear left but one-token experts in one-plane formats
    assert ("expert_matmul" in script) == (qtype in cpu_kernels.ONE_PLANE and not int8)
    assert ("vpdpbusd" in script) == (int8 == "vpdpbusd") and ("pmadd.ub.sw" in script) == (int8 == "vpmaddubsw")
    assert all((sources[id(p)][1].endswith(":r16")) == (interleaved and int8 == "vpdpbusd"
                                                         and qtype in cpu_interleaved.FORMATS) for _, p in params)
    target = tvm.target.Target(llvm_json({"num-cores": 2, **({"mcpu": codegen.llvm_get_system_cpu()} if int8 else {})}))
    vm = relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=pipeline(target)), tvm.cpu())
    raw, raw_e = random_blocks(qtype, (N, K), rng), random_blocks(qtype, (E, N, K), rng)
    W, We = quants.dequantize(raw, qtype).astype(np.float64), quants.dequantize(raw_e, qtype).astype(np.float64)
    planes = {"w": to_planes(raw, qtype, (N, K)), "we": to_planes(raw_e, qtype, (E, N, K))}
    args = [tvm.runtime.tensor(np.ascontiguousarray(derived_plane(planes[sources[id(p)][0]], sources[id(p)][1])))
            for _, p in params]   # as the runtime binds them (gguf.quant.derived_plane)
    seen = q8_0_inputs if int8 else (lambda a: a)
    outputs = []
    for T in (1, 2, 3, 4, 5, 7, 11, 12, 13, 17, 23, 30):
        x = rng.standard_normal((T, K)).astype(np.float32)
        xg = rng.standard_normal((T, G, K)).astype(np.float32)
        xe = rng.standard_normal((T, J, K)).astype(np.float32)
        sel = rng.integers(0, E - 1, (T, J)).astype(np.int32)   # expert E-1 is never chosen
        y, yg, ye, ye2 = vm["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(xg), tvm.runtime.tensor(xe),
                                 tvm.runtime.tensor(sel), *args)
        refs = [seen(x) @ W.T, np.einsum("tgk,gok->tgo", seen(xg), W.reshape(G, N // G, K)),
                np.einsum("tk,tjnk->tjn", seen(x), We[sel]), np.einsum("tjk,tjnk->tjn", seen(xe), We[sel])]
        outputs += [a.numpy() for a in (y, yg, ye, ye2)]
        for got, ref in zip((y, yg, ye, ye2), refs):
            assert np.abs(got.numpy() - ref).max() <= 1e-5 * np.abs(ref).max(), (T, qtype)
        # a token's outputs do not depend on the tokens beside it, bit for bit, whichever kernel a
        # shape takes: decode (f1), verify and prefill round alike (the rollback and identity
        # tests rely on it)
        t = T - 1
        for fn in ("f", "f1"):
            one = vm[fn](*(tvm.runtime.tensor(a[t:t + 1]) for a in (x, xg, xe, sel)), *args)
            for got, alone in zip((y, yg, ye, ye2), one):
                assert np.array_equal(got.numpy()[t:t + 1], alone.numpy()), (T, qtype, fn)
    return outputs


def test_parsed_kernels_are_kept_on_disk_and_a_damaged_one_is_parsed_again(tmp_path, monkeypatch):
    """cpu_kernels keeps each parsed kernel in the cache folder: a second process loads the same
    TIR, and a damaged file is parsed again and replaced."""
    import tvm_ffi

    from ds4tvm.kernels import cpu as cpu_kernels

    monkeypatch.setenv("DS4TVM_CACHE", str(tmp_path))
    parse_or_load = cpu_kernels.dense_linear.__wrapped__   # past the in-process cache, as a new process
    args = (QT.Q8_0, 32, 64, 1, cpu_kernels.BLOCKINGS[128])
    first = parse_or_load(*args)
    files = list((tmp_path / "kernels").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    assert tvm_ffi.structural_equal(parse_or_load(*args), first)
    files[0].write_text('{"damaged": ')
    assert tvm_ffi.structural_equal(parse_or_load(*args), first)
    assert tvm_ffi.structural_equal(tvm.ir.load_json(files[0].read_text()), first)
    assert list((tmp_path / "kernels").iterdir()) == files   # no temporary file left


@pytest.mark.parametrize("comp,sel", [(None, None), (6, None), (6, 3)], ids=["window", "all-compressed", "selected"])
def test_cpu_window_attention_matches_the_te_form(comp, sel):
    """kernels/cpu_attention.py against nn/attention's TE form (attend_with_sinks over
    kernels/slots.window_slots) on the same inputs: windows still filling (start 0) and full,
    compressed rows all or selected, one token (decode) and several (prefill, on the cores), to
    float32 rounding (the sums run in another order); and a token's outputs alike bit for bit
    whatever the tokens beside it."""
    from tvm import te, tirx

    from ds4tvm.kernels import cpu_attention
    from ds4tvm.kernels.slots import window_slots
    from ds4tvm.nn.attention import attend_with_sinks

    H, D, W, ratio = 2, 32, 8, 4
    nv = te.var("n", "int64")
    q, ctx = te.placeholder((nv, H, D), "float32", "q"), te.placeholder((nv + W - 1, D), "float32", "ctx")
    comp_te = te.placeholder((comp, D), "float32", "comp") if comp else None
    sel_te = te.placeholder((nv, sel), "int32", "sel") if sel else None
    sinks, s = te.placeholder((H,), "float32", "sinks"), tirx.Var("s", "int64")
    A, valid, key = window_slots(lambda r, c: ctx[r, c], ctx.shape[0], comp_te, sel_te, s, W, ratio)
    out = attend_with_sinks(q, key, valid, A, sinks, "attention")
    te_args = [q, ctx, *([comp_te] if comp else []), *([sel_te] if sel else []), sinks, s, out]
    ref = tvm.compile(te.create_prim_func(te_args), target="llvm")
    hand = {p: tvm.compile(cpu_attention.window_attention(H, D, W, ratio, comp, sel, p).with_attr("global_symbol", "main"),
                           target=tvm.target.Target({"kind": "llvm", "num-cores": 2})) for p in (True, False)}
    rng = np.random.default_rng(3)
    for n, start in ((1, 0), (5, 0), (5, 30), (1, 41)):
        x = [rng.standard_normal(shape).astype(np.float32) for shape in ((n, H, D), (n + W - 1, D), (comp or 1, D))]
        chosen = rng.integers(0, comp or 1, (n, sel) if sel else (1, 1)).astype(np.int32)
        sink = rng.standard_normal(H).astype(np.float32)
        want = tvm.runtime.empty((n, H, D), "float32")
        ref(*map(tvm.runtime.tensor, [x[0], x[1], *([x[2]] if comp else []), *([chosen] if sel else []), sink]),
            start, want)
        for parallel, f in hand.items():
            got = tvm.runtime.empty((n, H, D), "float32")
            f(*map(tvm.runtime.tensor, (x[0], x[1], sink)), start, tvm.runtime.tensor(x[2]), tvm.runtime.tensor(chosen), got)
            assert np.abs(got.numpy() - want.numpy()).max() <= 2e-6 * np.abs(want.numpy()).max(), (n, start, parallel)
            last = tvm.runtime.empty((1, H, D), "float32")
            f(tvm.runtime.tensor(x[0][-1:]), tvm.runtime.tensor(x[1][n - 1:]), tvm.runtime.tensor(sink), start + n - 1,
              tvm.runtime.tensor(x[2]), tvm.runtime.tensor(chosen[-1:] if sel else chosen), last)
            assert np.array_equal(last.numpy(), got.numpy()[-1:]), (n, start, parallel)


def test_cpu_indexer_scores_equal_the_row_at_a_time_form():
    """kernels/cpu_attention.indexer_scores (rows of the table on the lanes) against nn/attention's
    row-at-a-time kernel, bit for bit: tables empty, filling and full, a decode's token scored on
    one core and split over the cores (SPLIT_ROWS or more rows visible), several tokens; the rows
    not yet visible NEG_INF in both."""
    from ds4tvm.kernels import cpu_attention
    from ds4tvm.nn.attention import _indexer_scores_func

    heads, dim, rows, ratio = 4, 32, 384, 4
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    before = tvm.compile(_indexer_scores_func(heads, dim, rows, ratio), target=target)
    hand = {threads: tvm.compile(cpu_attention.indexer_scores(heads, dim, rows, ratio, threads)
                                 .with_attr("global_symbol", "main"), target=target) for threads in (1, 2)}
    rng = np.random.default_rng(7)
    table = tvm.runtime.tensor(rng.standard_normal((rows, dim)).astype(np.float32))
    for n, start in ((1, 0), (1, 2), (1, 70), (1, 4 * cpu_attention.SPLIT_ROWS + 5), (1, 4 * rows + 40), (6, 61)):
        q = tvm.runtime.tensor(rng.standard_normal((n, heads, dim)).astype(np.float32))
        w = tvm.runtime.tensor(rng.standard_normal((n, heads)).astype(np.float32))
        want = tvm.runtime.empty((n, rows), "float32")
        before(q, w, table, start, want)
        for threads, f in hand.items():
            got = tvm.runtime.empty((n, rows), "float32")
            f(q, w, table, start, got)
            assert np.array_equal(got.numpy(), want.numpy()), (n, start, threads)


def test_cpu_window_attention_split_over_the_cores_equals_one_core():
    """A decode's token with its blocks of heads on the cores (kernels/cpu_attention split_heads,
    from two blocks of HB heads) gives the outputs of the blocks one after another, bit for bit."""
    from ds4tvm.kernels import cpu_attention

    H, D, W, ratio, C, M = 2 * cpu_attention.HB, 32, 8, 4, 6, 3
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    outs = []
    for split in (False, True):
        func = cpu_attention.window_attention(H, D, W, ratio, C, M, False, split)
        assert ("T.parallel" in func.script()) == split
        f = tvm.compile(func.with_attr("global_symbol", "main"), target=target)
        got = tvm.runtime.empty((1, H, D), "float32")
        rng = np.random.default_rng(11)
        x = [rng.standard_normal(shape).astype(np.float32) for shape in ((1, H, D), (W, D), (H,), (C, D))]
        f(*map(tvm.runtime.tensor, x[:3]), 30, tvm.runtime.tensor(x[3]),
          tvm.runtime.tensor(rng.integers(0, C, (1, M)).astype(np.int32)), got)
        outs.append(got.numpy())
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    assert np.array_equal(outs[0], outs[1])
