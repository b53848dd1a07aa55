"""`ds4-compile` for every GPU target on this GPU-less machine: the tiny DeepSeek-V4 + DSpark pair
compiles, with ONNX draft heads beside them, and a tiny GLM-5.3 with its MTP layer; the CUDA library holds SASS for exactly the named architectures (NVIDIA's cuobjdump
reads the fatbin), the ROCm one an AMD code object for the named gfx (the ELF machine flags, as
LLVM's ELF.h numbers them), the Metal one MSL source; every artifact's manifest reloads, and
`ds4 run` refuses it here with one line. The default run compiles for CUDA (sm_90) only; ROCm,
Metal and the other CUDA architectures run with `-m slow`, all of them with `python -m pytest -m
targets`."""

import json
import re
import shutil
import struct
import subprocess
import sysconfig
import tarfile
from pathlib import Path

import onnx_models
import pytest
from conftest import run_ds4, run_ds4_compile

from ds4tvm.artifact import Manifest

pytestmark = pytest.mark.targets

# EF_AMDGPU_MACH_* (llvm/include/llvm/BinaryFormat/ELF.h)
AMDGPU_MACH = {"gfx942": 0x04C, "gfx1151": 0x04A}
EM_AMDGPU = 224


def _cuobjdump() -> Path:
    tool = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "cuobjdump"
    if not tool.is_file():
        pytest.skip("cuobjdump is absent (test extra nvidia-cuda-cuobjdump, x86-64 only)")
    return tool


def _compile(demo_pair, tmp_path, target):
    model, support = demo_pair[0], demo_pair[1]
    out = tmp_path / "art"
    heads = onnx_models.save(onnx_models.medusa(64, 512, 3, tokens=True), tmp_path / "heads.onnx")
    r = run_ds4_compile(model, "--mtp", support, "--draft-onnx", heads, "--target", target, "-o", out,
                        "--max-context", "512", "--max-verify", "8", "--quiet", "--report", tmp_path / "report.json")
    if r.returncode == 2 and " need " in r.stderr:
        pytest.skip(f"toolchain for {target} absent: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    m = Manifest.read(out)
    assert "dspark" in m.drafters and "dspark_block" in {f["name"] for f in m.functions}
    assert m.drafters["onnx"]["k"] == 3 and "draft_onnx" in {f["name"] for f in m.functions}
    refused = run_ds4("run", "-m", out, "-p", "hi", "-n", 2)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and m.target_name in lines[0], refused.stderr
    return out, m


def _fatbin(library: Path, tmp_path: Path) -> Path:
    data = library.read_bytes()
    i = data.find(struct.pack("<I", 0xBA55ED50))
    assert i >= 0, "no fatbin in the library"
    _, _, header, size = struct.unpack_from("<IHHQ", data, i)
    out = tmp_path / "device.fatbin"
    out.write_bytes(data[i:i + header + size])
    return out


CUDA = [pytest.param("cuda:sm_80,sm_90", ["sm_80", "sm_90"], marks=pytest.mark.slow),
        pytest.param("cuda:sm_80", ["sm_80"], marks=pytest.mark.slow),
        pytest.param("cuda:sm_90", ["sm_90"], marks=pytest.mark.slow),
        pytest.param("cuda:sm_121", ["sm_121"], marks=pytest.mark.slow)]


@pytest.mark.parametrize("target,arches", CUDA)
def test_cuda_artifact_holds_sass_for_each_architecture(demo_pair, tmp_path, target, arches):
    tool = _cuobjdump()
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is absent")
    art, m = _compile(demo_pair, tmp_path, target)
    assert m.device == "cuda" and m.arches == arches
    decode = json.loads((tmp_path / "report.json").read_text())["functions"]["decode"]
    # decode replays one CUDA graph; outside it: the copy of its outputs, their allocations, the replay
    assert decode["graph_regions"] == 1 and decode["outside_graphs"] <= 20, decode["outside_by_kind"]
    assert [k["kernel"] for k in decode["kernels"] if not k["in_graph"]] == ["output_copy0"] or \
        len([k for k in decode["kernels"] if not k["in_graph"]]) == 1
    listing = subprocess.run([str(tool), "--list-elf", str(_fatbin(art / m.library, tmp_path))],
                             capture_output=True, text=True, check=True).stdout
    assert sorted(re.findall(r"\.(sm_\d+)\.cubin", listing)) == sorted(arches), listing


# under -m slow for the default run's time (Qwen3.8's CUDA compile below stays in it)
@pytest.mark.parametrize("gfx", [pytest.param("gfx1151", marks=pytest.mark.slow),
                                 pytest.param("gfx942", marks=pytest.mark.slow)])
def test_rocm_artifact_holds_an_amd_code_object_for_the_gfx(demo_pair, tmp_path, gfx):
    art, m = _compile(demo_pair, tmp_path, f"rocm:{gfx}")
    assert m.device == "rocm" and m.arches == [gfx]
    data = (art / m.library).read_bytes()
    machs = [struct.unpack_from("<I", data, x.start() + 48)[0] & 0xFF
             for x in re.finditer(rb"\x7fELF\x02\x01\x01", data)
             if struct.unpack_from("<H", data, x.start() + 18)[0] == EM_AMDGPU]
    assert machs and set(machs) == {AMDGPU_MACH[gfx]}, [hex(x) for x in machs]


@pytest.mark.slow   # for the default run's time: CUDA stays in it
def test_metal_artifact_is_a_tar_with_msl_source(demo_pair, tmp_path):
    art, m = _compile(demo_pair, tmp_path, "metal")
    assert m.device == "metal" and m.library.endswith(".tar")
    with tarfile.open(art / m.library) as tar:
        sources = [tar.extractfile(x).read() for x in tar.getmembers() if x.isfile()]
    msl = [s for s in sources if b"#include <metal_stdlib>" in s]
    assert msl and sum(s.count(b"kernel void") for s in msl) > 50


# all under -m slow for the default run's time: Qwen3.8's CUDA compile (below) has the GPU delta rule
@pytest.mark.parametrize("target", [pytest.param("cuda:sm_90", marks=pytest.mark.slow),
                                    pytest.param("rocm:gfx942", marks=pytest.mark.slow),
                                    pytest.param("metal", marks=pytest.mark.slow)])
def test_glm5next_with_its_mtp_layer_compiles(tmp_path, target):
    """GLM-5.3's kernels on GPUs: the delta rule's GPU form (one block per head, a thread per value
    channel), the DSA latent attention and the pooled indexer, and the nextn layer's functions."""
    from ds4tvm.families.glm5next.random_model import tiny_config, write_random_glm5next

    gguf = write_random_glm5next(tmp_path / "glm.gguf", tiny_config(), seed=1)
    out = tmp_path / "art"
    r = run_ds4_compile(gguf, "--target", target, "-o", out, "--max-context", "256", "--quiet")
    if r.returncode == 2 and " need " in r.stderr:
        pytest.skip(f"toolchain for {target} absent: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    m = Manifest.read(out)
    assert m.family == "glm5next" and "glm_mtp" in m.drafters
    assert {"verify", "mtp_observe", "mtp_step"} <= {f["name"] for f in m.functions}
    lib = out / m.library
    if m.library.endswith(".tar"):
        with tarfile.open(lib) as tar:
            code = b"".join(tar.extractfile(x).read() for x in tar.getmembers() if x.isfile())
    else:
        code = lib.read_bytes()
    assert b"delta_rule_gpu" in code


def test_target_list_and_bad_targets():
    r = run_ds4_compile("--target", "list")
    assert r.returncode == 0
    for value in ("llvm", "cpu", "cuda:sm_80", "cuda:sm_90", "cuda:sm_121", "cuda:sm_80,sm_90", "rocm:gfx942",
                  "rocm:gfx1151", "metal"):
        assert re.search(rf"^{re.escape(value)}\s", r.stdout, re.M), value
    for bad in ("cuda", "cuda:sm_91", "cuda:sm_90,sm_90", "rocm:gfx9999", "vulkan", "metal:m4"):
        r = run_ds4_compile("model.gguf", "--target", bad)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "cuda:sm_80,sm_90" in lines[0], (bad, r.stderr)


def test_llvm_opt_level_reaches_every_llvm_code_and_a_bad_one_is_refused(monkeypatch):
    """DS4_LLVM_OPT_LEVEL (the tests build at 1: conftest) sets a CPU target's optimisation level
    and a GPU target's host code's; unset, the targets are LLVM's default; anything but 0-3 is one
    line naming the variable, before any compile."""
    from ds4tvm.compile.targets import resolve
    from ds4tvm.errors import Ds4Error

    monkeypatch.setenv("DS4_LLVM_OPT_LEVEL", "2")
    assert resolve("llvm").tvm["opt-level"] == resolve("cpu").tvm["opt-level"] == 2
    assert all(resolve(t).tvm["host"]["opt-level"] == 2 for t in ("cuda:sm_90", "rocm:gfx942", "metal"))
    monkeypatch.delenv("DS4_LLVM_OPT_LEVEL")
    assert "opt-level" not in resolve("cpu").tvm and "opt-level" not in resolve("cuda:sm_90").tvm["host"]
    for bad in ("fast", "4", "-1", ""):
        monkeypatch.setenv("DS4_LLVM_OPT_LEVEL", bad)
        with pytest.raises(Ds4Error) as e:
            resolve("llvm")
        assert e.value.message == f"DS4_LLVM_OPT_LEVEL={bad!r}: expected an LLVM optimisation level, 0, 1, 2 or 3"


def test_device_check_says_so_on_a_machine_without_gpu():
    import os

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: run scripts/device_check.sh itself")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["bash", str(root / "scripts" / "device_check.sh")], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ))
    assert r.returncode == 0 and "no NVIDIA GPU" in r.stdout, (r.stdout, r.stderr)


def test_shapes_only_takes_no_model():
    r = run_ds4_compile("model.gguf", "--shapes-only", "--target", "metal")
    assert r.returncode == 2 and "--shapes-only takes no MODEL" in r.stderr


# kernel names of Qwen3.8's linears (model.py, mtp.py) and the rules that may take them (--report)
LINEARS = {"gdn_qkv", "gdn_z", "gdn_alpha", "gdn_beta", "attn_q", "attn_k", "attn_v", "attn_output", "idx_q", "idx_k",
           "router", "ple_key", "ple_value", "nextn_eh_proj", "output_lm_head", "mtp_lm_head",
           *(f"{part}_{p}" for part in ("hc_attn", "hc_ffn", "output_hc", "nextn_hc_head") for p in ("down", "up", "inject"))}


def _is_linear(kernel: str) -> bool:
    return kernel.startswith("qlinear") or kernel.rstrip("0123456789") in LINEARS
GEMV_RULES = {"GEMV", "LowBatchGEMV", "HandGEMV", "Matmul", "LowBatchGEMV|Matmul"}


@pytest.mark.parametrize("target", ["cuda:sm_90", pytest.param("rocm:gfx942", marks=pytest.mark.slow),
                                    pytest.param("metal", marks=pytest.mark.slow)])
def test_qwen4exp_compiles(tmp_path, target):
    """Qwen3.8's kernels on GPUs: the delta rule's GPU form, the grouped-query QSA attention, the
    NEOX RoPE, the HC mixer and the PLE conv (the PLE rows come in as an input), and the MTP
    layer's functions."""
    from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp

    gguf = write_random_qwen4exp(tmp_path / "qwen.gguf", tiny_config(n_nextn=1), seed=1)
    out = tmp_path / "art"
    r = run_ds4_compile(gguf, "--target", target, "-o", out, "--max-context", "256", "--max-batch", "2", "--quiet",
                        "--report", tmp_path / "report.json")
    if r.returncode == 2 and " need " in r.stderr:
        pytest.skip(f"toolchain for {target} absent: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    m = Manifest.read(out)
    assert m.family == "qwen4exp" and "qwen_mtp" in m.drafters and "decode_batch2" in {f["name"] for f in m.functions}
    assert {"prefill", "decode", "verify", "mtp_observe", "mtp_step"} <= {f["name"] for f in m.functions}
    assert all(("ple", "host") in [tuple(i) for i in f["inputs"]] for f in m.functions if not f["name"].startswith("mtp"))
    report = json.loads((tmp_path / "report.json").read_text())["functions"]
    assert {f["name"] for f in m.functions} == set(report)
    for fn, f in report.items():   # every linear in a GEMV-family or Matmul rule, no kernel reading weights only
        linears = [k for k in f["kernels"] if _is_linear(k["kernel"])]
        assert linears and all(k["rule"] in GEMV_RULES for k in linears), (fn, [k for k in linears if k["rule"] not in
                                                                                 GEMV_RULES])
        assert f["weights_only"] == [] and f["n_kernels"] == sum(f["by_rule"].values()), fn
    if target.startswith("cuda"):   # decode, the batched decode, verify and mtp_observe at each width replay
        # one CUDA graph each; the symbolic verify none
        recorded = {f["name"] for f in m.functions if f.get("recorded")}
        widths = list(range(1, m.bounds["max_verify"] + 1))
        specs = {f["name"]: f for f in m.functions}
        assert specs["verify"]["widths"] == specs["mtp_observe"]["widths"] == widths and "verify" not in recorded
        copies = [f"{fn}_w{w}" for fn in ("verify", "mtp_observe") for w in widths]
        assert {"decode", "decode_batch2", *copies} <= recorded
        for fn in ("decode", "decode_batch2", *copies):
            # outside the graph: the copy of the outputs, their allocations, the replay
            f = report[fn]
            assert f["graph_regions"] == 1 and f["outside_graphs"] <= 20, (fn, f["outside_by_kind"])
            assert len([k for k in f["kernels"] if not k["in_graph"]]) == 1, fn
        assert report["verify"]["graph_regions"] == 0
        decode = report["decode"]
        # launches per kernel against the device functions code generation made of it (TOPI's
        # sorts launch some of theirs in loops: left out)
        symbols = _device_functions(next(out.glob("lib-*.so")))
        counted = [k for k in decode["kernels"] if not k["kernel"].startswith("topk")]
        assert counted and [k["launches"] for k in counted] == [symbols[k["kernel"]] for k in counted]
        assert decode["n_launches"] >= decode["n_kernels"]


def _device_functions(library: Path) -> dict:
    """PrimFunc name -> how many device functions (`NAME_kernel`, `NAME_kernel_1`, ...) the library holds."""
    found = {}
    for m in re.finditer(rb"([A-Za-z_][A-Za-z0-9_]*?)_kernel(_\d+)?\x00", library.read_bytes()):
        found.setdefault(m.group(1).decode(), set()).add(m.group(2))
    return {k: len(v) for k, v in found.items()}


HAND_KERNELS_AT_PUBLISHED_SHAPES = """
from ds4tvm.compile.toolchains import prepare
prepare("cuda")
import tvm
from ds4tvm.families.deepseek4.published import flash_config
from ds4tvm.kernels import gpu as g
from ds4tvm.nn import hyper
c = flash_config()
ring = (c.sliding_window + 16, c.head_dim)
kernels = [g.window_attention(c.n_head, c.head_dim, ring, c.sliding_window - 1, (65536 // 4, c.head_dim), c.idx_top_k,
                              c.sliding_window, 4, c.n_rot, True, True),
           g.window_attention(c.n_head, c.head_dim, ring, c.sliding_window - 1, (65536 // 128, c.head_dim), None,
                              c.sliding_window, 128, c.n_rot, True, False),
           hyper._hc_norm_func(c.hc, c.n_embd, c.hc_sinkhorn_iters, c.hc_eps, c.rms_eps, True),
           hyper._hc_norm_func(c.hc, c.n_embd, 0, c.hc_eps, c.rms_eps, True, head=True),
           g.table_experts(c.n_expert, c.n_vocab, c.n_expert_used, None, 1.0, True),
           g.rms_rope_fp8(c.head_dim, c.n_rot, c.rms_eps, True, 0, 1, True),
           g.top_k(c.n_expert, c.n_expert_used, True, None, 1.0, True), g.top_k(1024, c.idx_top_k, False)]
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
for f in kernels:
    with target:
        tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)
print("compiled", len(kernels))
"""


def test_hand_kernels_compile_for_cuda_at_the_published_shapes():
    """The GPU forms' hand kernels at DeepSeek-V4-Flash's sizes (slot loops of several rounds, 64
    heads, 256 experts, a 129 K-row token table), which the tiny models do not reach: CUDA code generation accepts them."""
    import sys

    r = subprocess.run([sys.executable, "-c", HAND_KERNELS_AT_PUBLISHED_SHAPES], capture_output=True, text=True)
    if r.returncode and " need " in r.stderr:
        pytest.skip(f"toolchain for CUDA absent: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0 and "compiled 8" in r.stdout, r.stderr[-2000:]
