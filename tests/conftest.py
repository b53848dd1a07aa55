import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("DS4_FIXTURES", ROOT.parent / "shared" / "fixtures"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The tiny models' CPU code built at LLVM -O1 (ds4tvm/compile/targets.py): a compile takes about
# three quarters of its -O3 time, and compiles are half of this run; the numbers computed are the same.
# DS4_LLVM_OPT_LEVEL=3 pytest builds them as users' artifacts are built.
os.environ.setdefault("DS4_LLVM_OPT_LEVEL", "1")

# The files that take longest, handed out first (pyproject: --dist loadfile --no-loadscope-reorder
# gives files to the two workers in collection order): left to the end, one of them ran alone for
# minutes while the other worker sat idle (the GPU check's selftest, six compiles). Those first
# build what they use themselves; the shared fixtures (demo_pair, tiny_artifact) come later.
LONGEST_FIRST = ("targets/test_device_check.py", "runtime/test_grammar.py", "unit/test_kernels.py",
                 "targets/test_gpu_targets.py", "runtime/test_speculative.py", "families/test_qwen4exp_mtp.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))


def fixtures_dir(sub: str) -> Path:
    d = FIXTURES / sub
    if not d.is_dir():
        pytest.skip(f"fixtures folder {d} is absent (set DS4_FIXTURES to ../shared/fixtures)")
    return d


def run_ds4(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs the real `ds4` command line in a fresh process."""
    return subprocess.run([sys.executable, "-m", "ds4tvm.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def always_drafting(**extra: str) -> dict:
    """The environment of a `ds4 run` whose drafter is asked every cycle (DS4_SPEC_COST_MODEL=0):
    on the tiny models a verify costs about as much as the decodes it saves, so whether the cost
    model (runtime/costs.py) lets a drafter propose depends on the machine's load (beside a compile
    it skipped every cycle), and a check that drafts are made and accepted would fail with it."""
    return {**os.environ, "DS4_SPEC_COST_MODEL": "0", **extra}


def run_ds4_compile(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs the real `ds4-compile` command line in a fresh process."""
    return subprocess.run([sys.executable, "-c", "from ds4tvm.cli import compile_main; compile_main()",
                           *map(str, args)], capture_output=True, text=True, timeout=timeout)


def compile_here(*args: str) -> None:
    """`ds4-compile ARGS` for a fixture's artifact, run in this process: a fresh one spends ~7 s
    importing TVM (and PyTorch, which tvm_ffi imports when it is installed). CPU targets only (a
    CUDA compile sets its toolchain up before TVM is imported); the command line's own exit codes
    and messages are tested through run_ds4_compile."""
    from ds4tvm.cli import compile_app
    from ds4tvm.errors import Ds4Error

    try:
        compile_app(list(map(str, args)), standalone_mode=False)
    except Ds4Error as e:
        pytest.fail(f"ds4-compile {' '.join(map(str, args))}: {e.message}")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import write_tiny_deepseek_v4

    return write_tiny_deepseek_v4(tmp_path_factory.mktemp("hf") / "tiny-v4")


def _once_per_run(tmp_path_factory, name: str, build):
    """build(folder) run once for all the test workers of this run (the first runs it under a
    lock, the others wait and reuse what it wrote); its result returned in every worker."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent   # shared by the workers of this run
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build(root / f"{name}-shared")


def _tiny_artifact(d: Path) -> Path:
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    if not (d / "art" / "manifest.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        model = write_random_deepseek4(d / "tiny.gguf", tiny_config(), seed=21)
        compile_here(model, "--target", "llvm", "-o", d / "art", "--max-context", "512", "--max-verify", "8",
                     "--max-batch", "3", "--quiet")
    return d / "art"


def tiny_glm(d: Path, mtp_input: str = "streams") -> tuple[Path, Path, str]:
    """A tiny random GLM-5.3 (float32 weights) whose nextn layer reads mtp_input, compiled for llvm
    with batched decodes of 2 into d (once: a second call reuses it): (artifact, GGUF, mtp_input).
    The streams reading is shared by the GLM MTP and grammar tests (shared_tiny_glm)."""
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.glm5next.random_model import tiny_config, write_random_glm5next

    if not (d / "art" / "manifest.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        write_random_glm5next(d / "glm.gguf", tiny_config(mtp_input=mtp_input), seed=3, type_of=lambda spec: QT.F32)
        compile_here(d / "glm.gguf", "--target", "llvm", "-o", d / "art", "--max-context", "256", "--max-batch", "2",
                     "--quiet")
    return d / "art", d / "glm.gguf", mtp_input


def shared_tiny_glm(tmp_path_factory) -> tuple[Path, Path, str]:
    """tiny_glm's streams reading, built once for all the test workers of this run."""
    return _once_per_run(tmp_path_factory, "glm-streams", tiny_glm)


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory):
    """A small random DeepSeek-V4 (every layer kind) compiled for llvm with batched decodes of 2
    and 3 sequences, shared by runtime tests (and by the test workers)."""
    return _once_per_run(tmp_path_factory, "tiny-art", _tiny_artifact)


@pytest.fixture(scope="session")
def demo_pair(tmp_path_factory):
    """The random demo pair (tests/random_demo.py): tiny DeepSeek-V4 + agreeing DSpark support, one
    artifact holding both; built once for all test workers."""
    from random_demo import build_random_demo

    return _once_per_run(tmp_path_factory, "demo", build_random_demo)


def rows_through_rejections(engine, ids, n_vocab: int, seed: int = 7):
    """The logits rows of ids fed as verify blocks of random widths with rejections: a wrong draft
    in a block's tail (its row and later rejected: commit of the prefix), or the whole block
    dropped by rollback; only committed rows are kept. State left by rejected rows must not leak
    into them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows, i = [], 0
    while i < len(ids):
        k = min(int(rng.integers(1, engine.max_verify + 1)), len(ids) - i)
        drafts = np.array(ids[i:i + k])
        j = k
        if k > 1 and rng.random() < 0.5:
            j = int(rng.integers(1, k))
            drafts[j] = (drafts[j] + 1) % n_vocab
        if rng.random() < 0.2:
            engine.verify(drafts)
            engine.rollback()
            continue
        out = engine.verify(drafts).logits
        engine.commit(j)
        rows.append(out[:j])
        i += j
    return np.concatenate(rows)


def ds4_logits(art, ids, mode: str, tmp_path):
    """`ds4 logits -m ART --tokens IDS --mode MODE`: the float32 logits of every token."""
    import numpy as np

    out = Path(tmp_path) / f"{Path(art).name}-{mode}.npy"
    r = run_ds4("logits", "-m", art, "--tokens", ",".join(map(str, ids)), "--mode", mode, "--out", out)
    assert r.returncode == 0, r.stderr
    return np.load(out)


def exact_sampling_outcomes(engine, drafter_class, prompt, runs: int = 1600):
    """The law check of --mtp-exact-sampling for an MTP drafter: at T = 1 with top-k 3, the two tokens
    after `prompt`, every other run plain and every other speculative with drafter_class(engine,
    exact=True) whose draft is replaced by the target's second choice after the chosen token (one it
    accepts about half of the time). Returns the [2, outcomes] count table (plain, speculative) for a
    chi-square test of homogeneity."""
    import numpy as np

    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    params = SamplingParams(1.0, top_k=3, min_p=0.0)
    engine.reset()
    first = np.argsort(-engine.prefill(prompt).logits)[:3]
    second = {}
    for a in first:
        engine.reset()
        engine.prefill(prompt)
        second[int(a)] = int(np.argsort(-engine.decode(int(a)).logits)[1])

    class Drafts(drafter_class):
        def draft(self, engine, token, max_tokens):
            super().draft(engine, token, max_tokens)
            return [second.get(token, 0)] if max_tokens else []

    counts = {}
    for run in range(runs):
        spec = run % 2 == 0
        engine.reset()
        out, _ = generate(engine, prompt, 2, params, np.random.default_rng(run),
                          drafter=Drafts(engine, exact=True) if spec else None, exact=spec)
        counts.setdefault(tuple(out), [0, 0])[spec] += 1
    return np.array(list(counts.values())).T
