"""The GPU check (benchmarks/device_check.py, scripts/device_check.sh) run end to end on this CPU,
so the code the device runs cannot rot unseen: `selftest` prepares tiny DeepSeek-V4 + DSpark
(the default run), GLM-5.3 + MTP and Qwen3.8 + MTP models (-m slow), compiles their GPU forms for
llvm (the CUDA pipeline's fused, recorded module; the kernels the GPU runs with serial loops),
records the CPU artifact's logits and greedy tokens, then `check` compares, times, profiles and
reports exactly as on a GPU.
Every field of the report is asserted; the check must fail on a reference it does not meet, and
on a recorded function given other tensors than at its first call (what a CUDA graph's replay
would read and write)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "device_check.py"
MODELS = ("deepseek4-tiny", "glm5next-tiny", "qwen4exp-tiny")
TOP = {"plan", "target", "device", "arch", "copy_bandwidth_gb_s", "models", "failures"}
MODEL_KEYS = {"gguf_seconds", "load_seconds", "logits_vs_cpu", "speculation", "timed"}
LOGIT_KEYS = {"max_abs_diff", "limit", "max_abs_logit", "argmax_equal", "rows"}
LIMITS = {"deepseek4-tiny": 1e-4, "glm5next-tiny": 2e-4, "qwen4exp-tiny": 1e-4}   # why GLM's: device_check.GLM_LIMIT
# batched: 16 rows of batched decodes, a chunk's last and two decodes, verify blocks of 3, 1 and 2 rows
ROWS = {"prefill": 40, "decode": 40, "verify": 40, "interleaved": 12, "batched": 25}
ARM_KEYS = {"tokens", "tok_s", "functions", "proposed", "accepted", "drafter_ms_per_token", "ms_per_token",
            "equal_prefix", "speedup"}
# what the drafters verify and write at full acceptance, as copies recorded per width (max_verify 4):
# DSpark a block of [t, 3 drafts] and its rings; GLM's MTP [t, d]; Qwen's [t, d] and, at depth 3, [t, d, d2]
RECORDED_RUN = {"deepseek4-tiny": {"verify_w4", "dspark_observe_w4"}, "glm5next-tiny": {"verify_w2"},
                "qwen4exp-tiny": {"verify_w2", "verify_w3"}}
TIMED_KEYS = {"weights_gib", "bytes_per_token_gib", "prefill_tokens", "prefill_tok_s", "decode_tok_s",
              "decode_weight_gb_s", "bandwidth_fraction", "decode_kernels", "decode_calls", "decode_graph_regions",
              "decode_kernels_in_graphs", "decode_outside_graphs", "verify6_kernels", "verify6_graph_regions",
              "verify6_outside_graphs", "verify_cost_vs_decode", "batch_cost_vs_decode", "batch_graph_regions",
              "decode_profile"}


def _run(*args, timeout=1500):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# the default run checks DeepSeek-V4 + DSpark (recorded verify widths, the drafter's recorded
# step, batched decodes); GLM-5.3's and Qwen3.8's GPU forms (KDA, GDN, PLE) with -m slow, for the
# default run's time (each model is two compiles: 65-75 s on a 2-core Zen 3)
@pytest.fixture(scope="module", params=[MODELS[:1], pytest.param(MODELS, marks=pytest.mark.slow)],
                ids=["deepseek4", "every-family"])
def selftest(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("device_check")
    r = _run("selftest", d / "work", "--out", d / "report.json", "--only", *request.param)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d, json.loads((d / "report.json").read_text()), r.stdout


def _check_arms(name, spec, gen):
    assert set(spec) == {"prompt_tokens", "target_only", "target_only_tokens", "cpu_equal_prefix", "drafter",
                         "agreeing"}, name
    assert spec["target_only"]["tokens"] == len(spec["target_only_tokens"]) == spec["cpu_equal_prefix"] == gen
    assert "decode" in spec["target_only"]["functions"] and not [f for f in spec["target_only"]["functions"]
                                                                 if f.startswith("verify")], name
    for arm in ("drafter", "agreeing"):
        a = spec[arm]
        assert set(a) == ARM_KEYS and a["tokens"] == gen and a["equal_prefix"] == gen, (name, arm, a)
        assert 0 <= a["accepted"] <= a["proposed"] and 0 < a["drafter_ms_per_token"] < a["ms_per_token"], (name, arm)
        assert "verify" not in a["functions"], (name, arm)   # the symbolic verify: never at these widths
    # drafts replaced by target-only's tokens: every proposal accepted, through the recorded copies
    assert spec["agreeing"]["accepted"] == spec["agreeing"]["proposed"] > 0, name
    assert RECORDED_RUN[name] <= set(spec["agreeing"]["functions"]), (name, spec["agreeing"]["functions"])


def test_selftest_runs_every_step_of_the_gpu_check_and_reports_every_field(selftest, request):
    from ds4tvm.artifact import Manifest

    d, r, stdout = selftest
    work = d / "work"
    assert set(r) == TOP and r["plan"] == "cpu" and r["target"] == "llvm" and r["failures"] == []
    assert r["copy_bandwidth_gb_s"] > 0 and list(r["models"]) == list(request.node.callspec.params["selftest"])
    for name, m in r["models"].items():
        assert set(m) == MODEL_KEYS, name
        assert set(m["logits_vs_cpu"]) == set(ROWS), name
        for mode, c in m["logits_vs_cpu"].items():
            assert set(c) == LOGIT_KEYS and c["rows"] == ROWS[mode] and c["limit"] == LIMITS[name], (name, mode)
            assert c["max_abs_diff"] <= c["limit"] and c["argmax_equal"] == c["rows"], (name, mode)
            assert c["max_abs_logit"] > 0.1, (name, mode)
        _check_arms(name, m["speculation"], 32)
        t = m["timed"]
        assert set(t) == TIMED_KEYS, name
        assert 0 < t["bytes_per_token_gib"] < t["weights_gib"] and t["prefill_tokens"] == 128, name
        assert min(t["prefill_tok_s"], t["decode_tok_s"], t["decode_weight_gb_s"], t["bandwidth_fraction"]) > 0, name
        assert t["decode_calls"] > 0 and t["decode_kernels"] >= t["decode_calls"], name
        assert t["verify6_kernels"] > 0, name   # the widest recorded copy (max_verify 4 here)
        # llvm has no CUDA graphs: nothing inside one, every instruction outside
        assert t["decode_graph_regions"] == t["decode_kernels_in_graphs"] == t["verify6_graph_regions"] == 0, name
        assert t["decode_outside_graphs"] > 0 and t["verify6_outside_graphs"] > 0, name
        assert set(t["verify_cost_vs_decode"]) == {"1", "2", "3", "4"}, name
        assert all(v > 0 for v in t["verify_cost_vs_decode"].values()), name
        assert set(t["batch_cost_vs_decode"]) == set(t["batch_graph_regions"]) == {"2"}, name
        assert all(v > 0 for v in t["batch_cost_vs_decode"].values()), name
        assert set(t["batch_graph_regions"].values()) == {0}, name
        profile = t["decode_profile"]
        assert profile[0][0] == "all" and profile[0][1] >= len(profile) - 1 and profile[0][2] > 0, name
        assert all(isinstance(k, str) and n > 0 for k, n, _ in profile[1:]), name
        assert f"{name}:" in stdout
        functions = Manifest.read(work / name / "artifact").functions
        recorded = {f["name"] for f in functions if f.get("recorded")}
        assert {"decode", "verify_w1", "verify_w2", "verify_w3", "verify_w4", "decode_batch2"} <= recorded, name
        assert not [f for f in functions if f["name"].startswith("prefill_batch")]   # GPU forms: chunks alone (Declared.exported)
        kernels = json.loads((work / name / "report.json").read_text())["functions"]["decode"]["kernels"]
        assert [k for k in kernels if k["kernel"].startswith("fused_")], name   # the CUDA pipeline's fusion ran
    assert stdout.strip().endswith("device_check: every logit and token as the CPU's")


def test_check_fails_naming_the_model_and_mode_when_a_logit_is_off(selftest, tmp_path):
    """A reference the device does not meet (one logit moved by 1e-3) makes `check` exit 1."""
    d, _, _ = selftest
    work = d / "work"
    plan = json.loads((work / "plan.json").read_text())
    ref_path = work / "deepseek4-tiny" / "reference.npz"
    ref = dict(np.load(ref_path))
    try:
        (work / "plan.json").write_text(json.dumps({**plan, "models": ["deepseek4-tiny"]}))
        moved = {**ref, "verify": ref["verify"].copy()}
        moved["verify"][3, 17] += 1e-3
        np.savez(ref_path, **moved)
        r = _run("check", work, "--out", tmp_path / "r.json", timeout=600)
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
        failures = json.loads((tmp_path / "r.json").read_text())["failures"]
        assert len(failures) == 1 and failures[0].startswith("deepseek4-tiny: verify logits differ"), failures
    finally:
        (work / "plan.json").write_text(json.dumps(plan))
        np.savez(ref_path, **ref)


def test_check_catches_a_recorded_function_given_other_tensors(selftest, monkeypatch):
    """RecordedArguments (what `check` runs every comparison under) names the recorded functions a
    call gave other tensors than their first call: none with the engine's residency, decode and
    the batched decode once sequences no longer take their rows' tensors."""
    from ds4tvm.runtime import residency
    from ds4tvm.runtime.engine import Engine

    sys.path.insert(0, str(SCRIPT.parent))
    import device_check as dc

    d, _, _ = selftest
    m = {x.name: x for x in dc.plans()["cpu"]}["deepseek4-tiny"]
    model, support = m.write(d / "work" / m.name)
    engine = Engine(d / "work" / m.name / "artifact", weights={"model": model, "support": support})
    ids = dc.tiny_ids(engine.n_vocab)

    def moved():
        engine.vm = watched = dc.RecordedArguments(engine)
        try:
            dc.batched(engine, ids)
            dc.interleaved(engine, ids)
        finally:
            engine.vm = watched.vm
        return watched.moved

    assert moved() == set()
    monkeypatch.setattr(residency.Residency, "hold", lambda self, seq, group, slot: None)
    assert moved() == {"decode", "decode_batch2"}


@pytest.mark.device   # pytest -m device, on a machine with an NVIDIA GPU and TVM's compiler
def test_the_gpu_gives_the_cpus_logits_and_tokens(tmp_path):
    """The whole GPU check (scripts/device_check.sh: prepare for the GPU found, then check): every
    logit within its limit of the CPU artifact's, every greedy token equal."""
    import os
    import shutil

    if not shutil.which("nvidia-smi"):
        pytest.skip("no nvidia-smi on this machine")
    out = tmp_path / "device_check.json"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")], capture_output=True, text=True,
                       timeout=900, env={**os.environ, "DEVICE_CHECK_OUT": str(out), "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["plan"] == "cuda" and report["failures"] == [] and len(report["models"]) == 7, report["failures"]
