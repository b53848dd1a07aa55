"""The GPU forms of the quantized linears (nn/qweight.py, nn/gpu_kernels.py) and `ds4-compile --report`:

- compiled for cuda:sm_90 here (codegen only), the report says which dlight rule scheduled each
  kernel: no linear of any plane format (dense, grouped, routed experts) falls to Fallback;
- the CUDA pipeline's module (the same forms, fused, decode's arguments recorded for CUDA graphs)
  built for llvm gives the CPU artifact's logits within 1e-4 in prefill, decode and verify (the
  kernels are the GPU's; only the schedule differs), so their numerics are checked without a GPU;
- the report's keys are the same for every target (graph fields zero where there are no graphs).
"""

import json
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from conftest import ROOT, run_ds4_compile

pytestmark = pytest.mark.targets
LINEARS = ("qlinear", "hc_mix", "hc_head_mix", "output_lm_head")   # kernel names of the model's linears
KEYS = {"kernels", "n_kernels", "by_rule", "graph_regions", "kernels_in_graphs", "outside_graphs", "weights_only"}


def _types(spec):
    """Several GPU paths at once: Q8_0 dense, MXFP4 routed experts, BF16 shared experts, F16/F32 the rest."""
    from ds4tvm.families.deepseek4.random_model import default_type
    from ds4tvm.gguf.validate import DENSE, ROUTED

    if spec.types == ROUTED:
        return QT.MXFP4
    if "shexp" in spec.name:
        return QT.BF16
    if spec.types == DENSE and spec.shape[0] % 32 == 0:
        return QT.Q8_0
    return default_type(spec)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    d = tmp_path_factory.mktemp("gpu_forms")
    return write_random_deepseek4(d / "tiny.gguf", tiny_config(), seed=4, type_of=_types)


@pytest.mark.slow   # the default run checks a model's report on Qwen3.8's CUDA compile (test_gpu_targets.py)
def test_no_linear_falls_to_fallback_on_cuda(model, tmp_path):
    r = run_ds4_compile(model, "--target", "cuda:sm_90", "-o", tmp_path / "art", "--max-context", "256",
                        "--report", tmp_path / "report.json", "--quiet")
    if r.returncode == 2 and " need " in r.stderr:
        pytest.skip(f"toolchain for CUDA absent: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["target"] == "cuda-sm_90" and {"prefill", "decode", "verify"} <= set(report["functions"])
    for fn, f in report["functions"].items():
        assert KEYS <= set(f) and f["n_kernels"] == len(f["kernels"]) == sum(f["by_rule"].values()), fn
        linears = [k for k in f["kernels"] if k["kernel"].startswith(LINEARS)]
        assert linears, fn
        assert not [k for k in linears if k["rule"] == "Fallback"], (fn, [k for k in linears if k["rule"] == "Fallback"])
    decode = report["functions"]["decode"]
    experts = [k for k in decode["kernels"] if k["kernel"].startswith("qlinear_experts")]
    assert experts and {k["rule"] for k in experts} == {"GEMV"}
    print({fn: (f["n_kernels"], f["by_rule"]) for fn, f in report["functions"].items()})


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """Every layer kind (window only, ratio 4 with its indexer, ratio 128, a hash layer) in three layers."""
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    d = tmp_path_factory.mktemp("gpu_forms_small")
    cfg = tiny_config(n_layers=3, compress_ratios=(0, 4, 128), swiglu_clamp=(10.0,) * 3)
    return write_random_deepseek4(d / "small.gguf", cfg, seed=5, type_of=_types)


def _interleaved(engine, ids) -> np.ndarray:
    """Logits of two sequences decoded in turns on one engine (attach between every step)."""
    first = engine.seq
    engine.prefill(ids[:12])
    second = engine.new_sequence()
    engine.attach(second)
    engine.prefill(ids[20:26])
    rows = []
    for i in range(6):
        for seq, tok in ((first, ids[12 + i]), (second, ids[26 + i])):
            engine.attach(seq)
            rows.append(engine.decode(tok).logits)
    return np.array(rows)


@pytest.mark.slow   # two compiles (one to two minutes); the default run checks Qwen3.8's CUDA graph (test_gpu_targets.py)
def test_fused_recorded_gpu_graph_on_llvm_gives_the_cpu_artifacts_logits(small_model, tmp_path):
    """The CUDA pipeline's module (GPU forms, fusion with the state writers kept after their reads,
    decode's and each verify width's arguments recorded with the position as a tensor) built for
    llvm: prefill, decode and verify logits equal the CPU artifact's within 1e-4, also with two
    sequences decoded in turns (the engine keeps a recorded function's state tensors attached by
    exchanging contents)."""
    from ds4tvm.artifact import Bounds, Manifest
    from ds4tvm.compile.driver import compile_gguf
    from ds4tvm.runtime.engine import Engine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device_check import all_logits   # prefill, decode and verify logits of every token

    bounds = Bounds(max_context=256, max_verify=4)
    cpu = compile_gguf(small_model, "llvm", tmp_path / "cpu", bounds)
    gpu = compile_gguf(small_model, "llvm", tmp_path / "gpu-forms", bounds, gpu_forms=True,
                       report=tmp_path / "report.json")
    recorded = {f["name"]: f.get("recorded", False) for f in Manifest.read(gpu).functions}
    copies = {f"verify_w{w}": True for w in range(1, 5)}   # all_logits verifies at each width
    assert recorded == {"prefill": False, "prefill_all": False, "decode": True, "verify": False, **copies}
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 512, 40)]
    ours, theirs = all_logits(Engine(gpu), ids), all_logits(Engine(cpu), ids)
    ours["interleaved"], theirs["interleaved"] = _interleaved(Engine(gpu), ids), _interleaved(Engine(cpu), ids)
    for mode in ("prefill", "decode", "verify", "interleaved"):
        err = np.abs(ours[mode] - theirs[mode]).max()
        print(f"GPU graph on llvm, {mode}: max |delta| {err:.3g} (logits up to {np.abs(theirs[mode]).max():.2f})")
        assert err <= 1e-4, mode
    report = json.loads((tmp_path / "report.json").read_text())["functions"]
    fused = [k["kernel"] for k in report["decode"]["kernels"] if k["kernel"].startswith("fused_")]
    assert fused, "nothing was fused"
    assert KEYS <= set(report["decode"]) and report["decode"]["graph_regions"] == 0   # graphs are CUDA's


class _Calls:
    """An engine's VM, noting the name of every function called."""

    def __init__(self, vm):
        self.vm, self.names = vm, []

    def __getitem__(self, fn):
        self.names.append(fn)
        return self.vm[fn]


def _greedy(engine, prompt, options, model, n=40):
    """Greedy speculative tokens with the drafter the options ask for, and the functions run."""
    from ds4tvm.runtime.drafters import choose_drafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    engine.vm = calls = _Calls(engine.vm)
    toks, stats = generate(engine, prompt, n, SamplingParams(temperature=0.0), np.random.default_rng(0),
                           drafter=choose_drafter(engine, options, model))
    return toks, stats, set(calls.names)


@pytest.mark.slow   # a compile of the demo pair in the GPU forms (two minutes)
def test_dspark_speculation_through_the_width_copies_on_llvm_gives_the_cpus_tokens(demo_pair, tmp_path):
    """The demo DeepSeek-V4 + DSpark pair in the CUDA pipeline's module built for llvm: greedy DSpark
    decoding runs verify and dspark_observe as their copies recorded per width, and gives the CPU
    artifact's tokens."""
    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import compile_gguf
    from ds4tvm.runtime.drafters import SpecOptions
    from ds4tvm.runtime.engine import Engine

    model, support, cpu, prompt = demo_pair
    gpu = compile_gguf(model, "llvm", tmp_path / "gpu", Bounds(max_context=512, max_verify=8, prefill_chunk=256),
                       support=support, gpu_forms=True)
    options = SpecOptions(dspark=True)
    ours, stats, ran = _greedy(Engine(gpu), prompt, options, model)
    theirs, _, _ = _greedy(Engine(cpu), prompt, options, model)
    assert ours == theirs and stats.counters["accepted_draft"] > 0
    # a block of 5 verified as [t, 4 drafts]; the prompt's rows observed by the symbolic function
    assert {"verify_w5", "dspark_observe_w5"} <= ran and "verify" not in ran, sorted(ran)


def test_report_errors_are_one_line(model, tmp_path):
    for args, says in ((("--package", tmp_path / "p.tar", "--report", tmp_path / "r.json"), "not --package"),
                       (("-o", tmp_path / "art", "--report", tmp_path / "no" / "r.json"), "an existing directory")):
        r = run_ds4_compile(model, "--target", "llvm", *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow   # two compiles per family (three minutes)
@pytest.mark.parametrize("family", ["glm5next", "qwen4exp"])
def test_glm_and_qwen_gpu_graph_on_llvm_give_the_cpu_artifacts_logits(family, tmp_path):
    """GLM-5.3's and Qwen3.8's CUDA pipeline module built for llvm: their delta rule in its GPU form
    (serial loops here), recurrent snapshot writes at position start + 1 read from the position
    tensor, fused, decode recorded; prefill, decode and verify logits equal the CPU artifact's."""
    from ds4tvm.artifact import Bounds, Manifest
    from ds4tvm.compile.driver import compile_gguf
    from ds4tvm.runtime.engine import Engine

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device_check import all_logits

    if family == "glm5next":
        from ds4tvm.families.glm5next.random_model import tiny_config, write_random_glm5next
        gguf = write_random_glm5next(tmp_path / "m.gguf", tiny_config(), seed=1)
    else:
        from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp
        gguf = write_random_qwen4exp(tmp_path / "m.gguf", tiny_config(n_nextn=1), seed=1)
    bounds = Bounds(max_context=256, max_verify=4)
    cpu = compile_gguf(gguf, "llvm", tmp_path / "cpu", bounds)
    gpu = compile_gguf(gguf, "llvm", tmp_path / "gpu", bounds, gpu_forms=True)
    assert {f["name"] for f in Manifest.read(gpu).functions if f.get("recorded")} >= {"decode"}
    ids = [int(t) for t in np.random.default_rng(3).integers(4, 500, 30)]
    ours, theirs = all_logits(Engine(gpu), ids), all_logits(Engine(cpu), ids)
    for mode in ("prefill", "decode", "verify"):
        err = np.abs(ours[mode] - theirs[mode]).max()
        print(f"{family} GPU graph on llvm, {mode}: max |delta| {err:.3g} (logits up to {np.abs(theirs[mode]).max():.2f})")
        assert err <= 1e-4, mode
    # greedy MTP speculation ([t, draft] verified by its copy recorded at width 2): the CPU's tokens. The
    # random MTP layer's drafts are rejected, so mtp_observe runs only on the prompt (wider than max_verify)
    from ds4tvm.runtime.drafters import SpecOptions

    mtp_ours, _, ran = _greedy(Engine(gpu), ids[:8], SpecOptions(mtp=""), gguf, n=24)
    mtp_theirs, _, _ = _greedy(Engine(cpu), ids[:8], SpecOptions(mtp=""), gguf, n=24)
    assert mtp_ours == mtp_theirs
    assert "verify_w2" in ran and "verify" not in ran, sorted(ran)
