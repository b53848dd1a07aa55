"""What a user coming from llama.cpp types: its spellings work (`-c/--ctx-size`, `-t`, `-s`,
`--temperature`, `-f FILE` and `-f -`, `-n -1`, `--version`), and options that would be accepted and
ignored are refused with one line and exit 2 (`--target` on an artifact or an unknown target, a GPU
target on a machine without that GPU before any compile, `--ctx` beyond the compiled context, a bare
`--mtp` that enables no drafter, `ds4-compile -o` onto another model's artifact)."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import run_ds4, run_ds4_compile

pytestmark = pytest.mark.compile


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ds4: error: "), r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def _tokens(r) -> list[int]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["tokens"]


def test_version():
    from conftest import run_ds4_compile

    for r in (run_ds4("--version"), run_ds4_compile("--version")):
        assert r.returncode == 0 and r.stdout.startswith("ds4tvm ") and "apache-tvm" in r.stdout, r.stderr


@pytest.mark.parametrize("args, says", [(("run", "--bogus"), "No such option: --bogus (see 'ds4 run --help')"),
                                        (("run", "--temp", "abc", "-p", "x"), "Invalid value for '--temp'"),
                                        (("nosuch",), "No such command 'nosuch'"),
                                        (("compile", "--bogus"), "No such option: --bogus")])
def test_usage_errors_are_one_line(args, says):
    """click's usage errors, which typer draws as a box of several lines, are one line and exit 2."""
    from conftest import run_ds4_compile

    r = run_ds4_compile(*args[1:]) if args[0] == "compile" else run_ds4(*args)
    assert r.returncode == 2 and r.stderr.startswith("ds4: error: ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_llama_cpp_spellings_mean_what_ours_do(tiny_artifact, tmp_path):
    base = ("run", "-m", tiny_artifact, "--raw", "-n", 6, "--json")
    ours = _tokens(run_ds4(*base, "-p", "hello there", "--temp", 0.8, "--seed", 3, "--ctx", 256, "--threads", 1))
    theirs = _tokens(run_ds4(*base, "-p", "hello there", "--temperature", 0.8, "-s", 3, "-c", 256, "-t", 1))
    assert ours == theirs
    (tmp_path / "prompt.txt").write_text("hello there")
    assert _tokens(run_ds4(*base, "-f", tmp_path / "prompt.txt", "--temp", 0.8, "-s", 3)) == ours
    piped = subprocess.run([sys.executable, "-m", "ds4tvm.cli", *map(str, base), "-f", "-", "--temp", "0.8", "-s", "3"],
                           input="hello there", capture_output=True, text=True, timeout=120)
    assert _tokens(piped) == ours
    _one_line_error(run_ds4(*base, "-p", "x", "-f", tmp_path / "prompt.txt"), "one of -p/--prompt and -f/--file")
    _one_line_error(run_ds4(*base, "-f", tmp_path / "missing.txt"), "missing.txt")


def test_n_minus_one_generates_to_the_end_of_the_context(tiny_artifact):
    r = run_ds4("run", "-m", tiny_artifact, "--tokens", "5,6,7", "-n", -1, "--temp", 0, "--json", timeout=300)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and 0 < len(out["tokens"]) <= 512 - 3, r.stderr
    assert len(out["tokens"]) == 512 - 3 or out["finish_reason"] == "stop", (len(out["tokens"]), out.get("finish_reason"))


def test_options_that_would_be_ignored_are_refused(tiny_artifact, tmp_path):
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    base = ("run", "-m", tiny_artifact, "--tokens", "5,6", "-n", 2, "--temp", 0)
    _one_line_error(run_ds4(*base, "--target", "foo"), "--target 'foo' is not a target")
    _one_line_error(run_ds4(*base, "--target", "llvm"), "is compiled already")
    _one_line_error(run_ds4(*base, "--ctx", 100000), "--ctx 100000", "context of 512")
    _one_line_error(run_ds4(*base, "--mtp"), "--mtp: enables no drafter of deepseek4", "--dspark")
    gguf = write_random_deepseek4(tmp_path / "m.gguf", tiny_config(), seed=1)
    for target in ("cuda:sm_90", "cuda"):   # a bare `cuda`: this machine's CUDA GPU
        r = run_ds4("run", "-m", gguf, "--tokens", "5", "-n", 1, "--target", target, timeout=60)
        _one_line_error(r, "this machine has no CUDA device")   # before a compile of tens of seconds
    _one_line_error(run_ds4("run", "-m", gguf, "--tokens", "5", "-n", 1, "--target", "rocm", timeout=60),
                    "this machine has no ROCm GPU", "rocm:gfx")


def test_target_auto_is_this_machines_device():
    from ds4tvm.compile.targets import detect
    from ds4tvm.devices import probe_device, rocm_arches

    cuda, gfx = probe_device("cuda"), rocm_arches()
    assert detect("auto") == (f"cuda:{cuda[1]}" if cuda is not None else f"rocm:{gfx[0]}" if gfx else "cpu")
    assert detect("cuda:sm_80") == "cuda:sm_80" and detect("llvm") == "llvm"


def test_a_rocm_gpu_is_named_from_the_kernel_drivers_topology(tmp_path):
    """A KFD topology like an MI300 machine's (a CPU node, then GPU nodes): rocm and auto name gfx942;
    an RDNA2 card (gfx1030) is named and refused; no GPU node: rocm is refused, auto is the CPU."""
    from ds4tvm.compile.targets import detect
    from ds4tvm.devices import probe_device, rocm_arches
    from ds4tvm.errors import Ds4Error

    def topology(name, *versions):
        for i, v in enumerate(versions):
            (tmp_path / name / str(i)).mkdir(parents=True)
            (tmp_path / name / str(i) / "properties").write_text(f"cpu_cores_count 8\ngfx_target_version {v}\n")
        return tmp_path / name

    mi300, mi200 = topology("mi300", 0, 90402, 90402), topology("mi200", 90010)
    assert rocm_arches(mi300) == ["gfx942", "gfx942"] and rocm_arches(mi200) == ["gfx90a"]
    assert detect("rocm", mi300) == "rocm:gfx942"
    if probe_device("cuda") is None:
        assert detect("auto", mi300) == "rocm:gfx942" and detect("auto", topology("cpu", 0)) == "cpu"
    with pytest.raises(Ds4Error, match="this GPU is gfx1030, which ds4tvm does not compile for"):
        detect("rocm", topology("rdna2", 100300))
    with pytest.raises(Ds4Error, match="this machine has no ROCm GPU"):
        detect("rocm", topology("none", 0))


def test_compile_output_onto_another_models_artifact_is_refused(tiny_artifact, tmp_path):
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    gguf = write_random_deepseek4(tmp_path / "other.gguf", tiny_config(), seed=2)
    taken = tmp_path / "taken"
    shutil.copytree(tiny_artifact, taken)
    before = sorted(p.name for p in taken.iterdir())
    r = run_ds4_compile(gguf, "--target", "llvm", "-o", taken, "--quiet")
    _one_line_error(r, "the artifact of another model file", "--force")
    assert sorted(p.name for p in taken.iterdir()) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _one_line_error(run_ds4_compile(gguf, "--target", "llvm", "-o", mine, "--quiet"), "not an artifact of this model")
    assert (mine / "notes.txt").read_text() == "mine"


def test_inspect_an_artifact_directory(tiny_artifact):
    import numpy as np

    from ds4tvm.artifact import Manifest

    r = run_ds4("inspect", tiny_artifact, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    m = Manifest.read(tiny_artifact)
    states = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in m.state_specs())
    assert info["title"] == "DeepSeek-V4-Flash" and info["bounds"]["max_context"] == 512
    assert info["memory_bytes"] == info["state_bytes_per_sequence"] + m.model["gguf_size"] and states > 0
    text = run_ds4("inspect", tiny_artifact).stdout
    assert "DeepSeek-V4-Flash" in text and "context       512" in text


def test_interactive_chat_continues_each_turn_and_answers_as_sessions_do(tiny_artifact, tmp_path):
    """`ds4 run -i` at temperature 0: each turn continues the state the last left (only new tokens
    prefilled) and answers as `ds4 run --session` does turn by turn."""
    cmd = [sys.executable, "-m", "ds4tvm.cli", "run", "-m", str(tiny_artifact), "-i", "--temp", "0", "-n", "6"]
    r = subprocess.run(cmd, input="hello there\nand again\n\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    turns = [line for line in r.stderr.splitlines() if line.startswith("ds4: turn")]
    assert len(turns) == 2 and "(0 continued)" in turns[0] and "(0 continued)" not in turns[1], turns
    answers = r.stdout.split("\n")[:2]
    session = tmp_path / "s.ds4state"
    said = []
    for text in ("hello there", "and again"):
        one = run_ds4("run", "-m", tiny_artifact, "-p", text, "--temp", 0, "-n", 6, "--session", session, "--json")
        assert one.returncode == 0, one.stderr
        said.append(json.loads(one.stdout)["text"])
    assert answers == said, (answers, said)


def test_sampling_defaults_are_the_model_familys_and_the_seed_is_random(tiny_artifact):
    """ds4's defaults per family (temperature 1, top-p 1, min-p 0.05; GLM-5.3 top-p 0.95, min-p 0),
    flags over them; without -s each run draws a seed, which --json prints and -s repeats."""
    from types import SimpleNamespace

    from ds4tvm.cli.common import sampling_params

    def engine(family):
        return SimpleNamespace(manifest=SimpleNamespace(family=family))

    for family, want in (("deepseek4", (1.0, 1.0, 0.05)), ("qwen4exp", (1.0, 1.0, 0.05)), ("glm5next", (1.0, 0.95, 0.0))):
        p = sampling_params(engine(family), None, None, 0, None)
        assert (p.temperature, p.top_p, p.min_p) == want, family
    p = sampling_params(engine("glm5next"), 0.5, 0.8, 40, 0.1)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.8, 40, 0.1)
    base = ("run", "-m", tiny_artifact, "--raw", "-p", "hello there", "-n", 8, "--json")
    first, second = (json.loads(run_ds4(*base).stdout) for _ in range(2))
    assert first["seed"] != second["seed"]
    again = json.loads(run_ds4(*base, "-s", first["seed"]).stdout)
    assert again["tokens"] == first["tokens"] and again["seed"] == first["seed"]
