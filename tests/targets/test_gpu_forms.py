"""The GPU forms of the quantized linears (nn/qweight.py, kernels/gpu.py) and `ds4-compile --report`:

- compiled for cuda:sm_90 here (codegen only), the report says which dlight rule scheduled each
  kernel: no linear of any plane format (dense, grouped, routed experts) falls to Fallback;
- the report's errors are one line.
The numerics of the CUDA pipeline's module built for llvm (fused, recorded per width), for every
family and drafter, are the GPU check's, run on this CPU by tests/targets/test_device_check.py.
"""

import json
import sys

import pytest

from conftest import ROOT, run_ds4_compile

pytestmark = pytest.mark.targets
LINEARS = ("qlinear", "hc_mix", "hc_head_mix", "output_lm_head")   # kernel names of the model's linears
KEYS = {"kernels", "n_kernels", "by_rule", "graph_regions", "kernels_in_graphs", "outside_graphs", "weights_only"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device_check import mixed_types   # Q8_0 dense, MXFP4 routed, BF16 shared experts

    d = tmp_path_factory.mktemp("gpu_forms")
    return write_random_deepseek4(d / "tiny.gguf", tiny_config(), seed=4, type_of=mixed_types)


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


def test_report_errors_are_one_line(model, tmp_path):
    for args, says in ((("--package", tmp_path / "p.tar", "--report", tmp_path / "r.json"), "not --package"),
                       (("-o", tmp_path / "art", "--report", tmp_path / "no" / "r.json"), "an existing directory")):
        r = run_ds4_compile(model, "--target", "llvm", *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
