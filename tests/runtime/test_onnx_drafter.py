"""ONNX draft heads (`ds4-compile --draft-onnx`, runtime/drafters/onnx.py): TVM's import of the heads
against onnxruntime, the target's `hidden` output against its own output head (gguf's dequantizer),
the identity of greedy speculation with target-only decoding, heads that agree with the target being
accepted, the flags, packages, and the malformed corpus (one line, exit 2 each)."""

import json

import numpy as np
import pytest
from conftest import always_drafting, compile_here, run_ds4, run_ds4_compile
from gguf.quants import dequantize

import onnx_models
from ds4tvm.gguf import open_gguf
from ds4tvm.runtime.drafters.onnx import ONNXDrafter
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import generate

pytestmark = pytest.mark.compile

D, V, K = 64, 512, 3           # the demo model's width and vocabulary; three heads
N_TOKENS = 96
GREEDY = SamplingParams(temperature=0.0)


def _greedy(engine, prompt, drafter=None, n=N_TOKENS):
    engine.reset()
    return generate(engine, prompt, n, GREEDY, np.random.default_rng(0), drafter=drafter)


@pytest.fixture(scope="module")
def heads_art(demo_pair, tmp_path_factory):
    """The demo target compiled with heads that know its greedy successors (read off its own
    target-only continuation of the demo prompt, as the demo's DSpark Markov head is)."""
    model, _, art, prompt = demo_pair
    d = tmp_path_factory.mktemp("onnx-heads")
    plain, _ = _greedy(Engine(art.parent / "artifact-target-only"), prompt, n=160)
    successor = np.arange(V)
    seq = [prompt[-1]] + plain
    for a, b in zip(seq, seq[1:]):
        successor[a] = b
    heads = onnx_models.save(onnx_models.successor_heads(successor, K, D), d / "successors.onnx")
    compile_here(model, "--draft-onnx", heads, "-o", d / "art", "--max-context", "512", "--max-verify", "8",
                 "--quiet")
    return d / "art", heads, prompt


@pytest.mark.parametrize("tokens, dtype, k", [(True, np.float16, 2), (True, np.float32, K), (False, np.float16, K)])
def test_imported_heads_equal_onnxruntime(tmp_path, tokens, dtype, k):
    """Medusa heads (MatMul, bias, SiLU as Sigmoid x Mul, a residual, a shared output MatMul; with
    and without `tokens`; float32 and float16 weights) through the import, the x @ W^T rewrite to the
    CPU linear kernel, the weights file and the compiled function, against onnxruntime (each case
    compiles the heads alone: under 3 s). Bound 1e-5: both sum float32 products of rows of 64 in
    different orders; measured at most 6.7e-6 on logits up to 16 (float32's spacing there: 1.9e-6)."""
    import onnxruntime as ort
    import tvm
    from tvm import relax

    from ds4tvm.compile import onnx_heads
    from ds4tvm.compile.driver import _compile_module
    from ds4tvm.compile.targets import resolve

    rng = np.random.default_rng(7)
    path = onnx_models.save(onnx_models.medusa(D, V, k, seed=3, tokens=tokens, dtype=dtype), tmp_path / "h.onnx")
    heads = onnx_heads.read(path, D, V, 8)
    model, keep = onnx_heads.prepare(heads.model)
    mod = onnx_heads.add_to_module(tvm.IRModule(), onnx_heads.import_function(model),
                                   cpu=(resolve("llvm").threads, resolve("llvm").blocking()))
    # the products with a weight run the hand-written linear of the weight's type
    linears = [gv.name_hint for gv in mod.functions if gv.name_hint.startswith("onnx_linear_")]
    kind = {np.float32: "f32", np.float16: "f16"}[dtype]
    assert len(linears) == 2 and all(n.startswith(f"onnx_linear_{kind}_") for n in linears), linears
    names = onnx_heads.write_weights(tmp_path / "w.gguf", keep, heads.sha256)
    stored = open_gguf(tmp_path / "w.gguf").tensors
    vm = relax.VirtualMachine(_compile_module(mod, resolve("llvm")), tvm.cpu())
    weights = [tvm.runtime.tensor(np.ascontiguousarray(stored[n].data)) for n in names]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 4, 11):
        feed = {"hidden": rng.standard_normal((n, D)).astype(np.float32)}
        args = [tvm.runtime.tensor(feed["hidden"])]
        if tokens:
            feed["tokens"] = rng.integers(0, V, n).astype(np.int64)
            args.append(tvm.runtime.tensor(feed["tokens"].astype(np.int32)))
        want = session.run(["logits"], feed)[0]
        got = vm[onnx_heads.FUNCTION](*args, *weights).numpy()
        assert got.shape == (n, k, V) and np.abs(want).max() > 1.0
        assert np.abs(got - want).max() <= 1e-5, (tokens, dtype, n, np.abs(got - want).max())


def test_hidden_is_what_the_output_head_reads(heads_art):
    art, _, prompt = heads_art
    e = Engine(art)
    step = e.prefill(prompt, all_logits=True)
    out = e.gguf.tensors["output.weight"]
    W = dequantize(out.data, out.ggml_type).reshape(V, D).astype(np.float64)
    want = step.outputs["hidden"].astype(np.float64) @ W.T
    assert step.outputs["hidden"].shape == (len(prompt), D)
    assert np.abs(step.logits - want).max() <= 1e-4 * np.abs(want).max()


def test_compiled_heads_equal_onnxruntime_and_reject_bad_tokens(heads_art):
    import onnxruntime as ort

    from ds4tvm.errors import Ds4Error

    art, heads, _ = heads_art
    e = Engine(art)
    rng = np.random.default_rng(1)
    hidden, tokens = rng.standard_normal((5, D)).astype(np.float32), rng.integers(0, V, 5)
    want = ort.InferenceSession(str(heads)).run(["logits"], {"hidden": hidden, "tokens": tokens})[0]
    assert np.array_equal(e.call("draft_onnx", hidden=hidden, tokens=tokens)["logits"], want)
    with pytest.raises(Ds4Error, match=f"token id {V} is outside the vocabulary"):
        e.call("draft_onnx", hidden=hidden[:1], tokens=[V])


def test_greedy_speculation_equals_target_only_and_agreeing_heads_are_accepted(heads_art):
    art, _, prompt = heads_art
    e = Engine(art)
    plain, _ = _greedy(e, prompt)
    drafter = ONNXDrafter(e)
    spec, stats = _greedy(e, prompt, drafter)
    assert spec == plain
    c = stats.counters
    assert c["proposed"] > 2 * N_TOKENS // (K + 1) and c["accept_rate"] >= 0.9, c
    assert len(c["head_accept_rate"]) == K and c["head_accept_rate"][0] >= c["head_accept_rate"][-1] > 0.5


def test_exact_sampling_with_heads_keeps_the_counts_consistent(heads_art):
    art, _, prompt = heads_art
    e = Engine(art)
    # the random target spreads its mass even at low temperature: at 0.1 a few drafts still pass
    out, stats = generate(e, prompt, 48, SamplingParams(temperature=0.1), np.random.default_rng(3),
                          drafter=ONNXDrafter(e), exact=True)
    c = stats.counters
    assert len(out) == 48 and all(0 <= t < V for t in out)
    assert 0 < c["accepted_draft"] <= c["proposed"] and sum(c["depth"].values()) == c["cycles"]


def test_run_flags(heads_art, demo_pair):
    art, heads, _ = heads_art
    r = run_ds4("run", "-m", art, "-p", "Hello, world!", "-n", 24, "--temp", 0, "--draft-onnx", "--json",
                env=always_drafting())
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["spec"]
    assert spec["heads"] == K and spec["proposed"] > 0
    plain = run_ds4("run", "-m", art, "-p", "Hello, world!", "-n", 24, "--temp", 0, "--json")
    assert json.loads(plain.stdout)["tokens"] == json.loads(r.stdout)["tokens"]
    for args, expect in ((("--draft-onnx", "--dspark"), "choose one drafter"),
                         (("--draft-onnx", "--mtp", demo_pair[1]), "--draft-onnx and --mtp"),
                         (("--draft-onnx", demo_pair[0]), "not compiled with the draft heads")):
        r = run_ds4("run", "-m", art, "-p", "hi", "-n", 2, *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and expect in lines[0], (args, r.stderr)
    r = run_ds4("run", "-m", demo_pair[2], "-p", "hi", "-n", 2, "--draft-onnx")
    assert r.returncode == 2 and "compile it with ds4-compile --draft-onnx" in r.stderr, r.stderr


def test_package_carries_the_heads_weights(heads_art, tmp_path):
    from ds4tvm.package import build_package, resolve_package

    art, _, _ = heads_art
    pkg = build_package([art], tmp_path / "pkg")
    meta = json.loads((pkg / "package.json").read_text())
    assert "draft_onnx" in meta["weights"] and meta["weights"]["draft_onnx"] in meta["files"]
    packaged = Engine(*resolve_package(pkg))
    hidden = np.zeros((2, D), np.float32)
    assert np.array_equal(packaged.call("draft_onnx", hidden=hidden, tokens=[3, 4])["logits"],
                          Engine(art).call("draft_onnx", hidden=hidden, tokens=[3, 4])["logits"])


@pytest.fixture(scope="module")
def malformed_heads(tmp_path_factory):
    return onnx_models.malformed(tmp_path_factory.mktemp("bad-onnx"), D, V)


# two kinds run through the command line (a file that does not parse, one the frontend cannot take);
# the whole corpus, these included, in-process below
CLI_CASES = ["truncated", "unsupported op"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_malformed_heads_exit_2_with_one_line(malformed_heads, demo_pair, tmp_path, case):
    path, expect = malformed_heads[case]
    r = run_ds4_compile(demo_pair[0], "--draft-onnx", path, "-o", tmp_path / "art", "--max-verify", "8", "--quiet")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (case, r.stderr)
    assert lines[0].startswith("ds4: error: ") and str(path) in lines[0] and expect in lines[0], (case, lines[0])
    assert not (tmp_path / "art").exists()


def test_malformed_heads_corpus(malformed_heads):
    from ds4tvm.compile import onnx_heads
    from ds4tvm.errors import Ds4Error

    assert len(malformed_heads) >= 10
    for case, (path, expect) in malformed_heads.items():
        with pytest.raises(Ds4Error) as e:
            onnx_heads.read(path, D, V, 8)
        assert str(path) in e.value.message and expect in e.value.message and "\n" not in e.value.message, case


@pytest.mark.slow
def test_worked_example_trains_heads_the_target_accepts(demo_pair, tmp_path):
    """scripts/train_onnx_heads.py, shortened: its exported heads compile, match onnxruntime and
    keep the greedy text (the script checks) with most drafts accepted on held-out prompts."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "train_onnx_heads.py"
    r = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "heads.onnx"), "--demo-dir",
                        str(demo_pair[2].parent), "--windows", "64", "--steps", "300", "--eval-windows", "4",
                        "--json", str(tmp_path / "report.json")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    held = json.loads((tmp_path / "report.json").read_text())["held_out"]
    assert held["onnxruntime_max_abs_diff"] <= 1e-5 and held["accept_rate"] > 0.5, held
