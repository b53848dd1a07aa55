"""DSpark end to end on a tiny DeepSeek-V4: the drafter compiled into the target's artifact,
driven by the speculative loop, against target-only decoding."""

import json

import numpy as np
import pytest

from conftest import run_ds4, run_ds4_compile

pytestmark = pytest.mark.compile
PROMPT = [7, 8, 9, 10, 11]
N = 200


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    d = tmp_path_factory.mktemp("dspark")
    cfg = tiny_config()
    # Residual writers scaled down: the next token is (nearly) a function of the current one, so a
    # Markov-head drafter can follow the target exactly.
    model = write_random_deepseek4(d / "target.gguf", cfg, seed=21, residual_scale=1e-4)
    r = run_ds4_compile(model, "--target", "llvm", "-o", d / "plain", "--max-context", "512", "--max-verify", "8",
                        "--quiet")
    assert r.returncode == 0, r.stderr
    plain = Engine(d / "plain")
    want, _ = generate(plain, PROMPT, N, SamplingParams(0.0), np.random.default_rng(0))
    seq = [PROMPT[-1]] + want
    succ = {}
    for a, b in zip(seq, seq[1:]):
        assert succ.setdefault(a, b) == b, "the target's greedy path is not a function of the last token"
    nxt = np.arange(cfg.n_vocab)
    for a, b in succ.items():
        nxt[a] = b
    return d, cfg, model, plain, want, nxt


def _with_support(pair, name, nxt, **kw):
    from ds4tvm.families.dspark.agreeing import write_markov_dspark
    from ds4tvm.runtime.engine import Engine

    d, cfg, model, *_ = pair
    support = write_markov_dspark(d / f"{name}.gguf", cfg, nxt, seed=5, **kw)
    r = run_ds4_compile(model, "--target", "llvm", "-o", d / name, "--max-context", "512", "--max-verify", "8",
                        "--mtp", support, "--quiet")
    assert r.returncode == 0, r.stderr
    return Engine(d / name)


@pytest.fixture(scope="module")
def agreeing(pair):
    return _with_support(pair, "agree", pair[5])


@pytest.mark.parametrize("block", [1, 2, 3, 4, 5])
def test_identity_every_draft_accepted(pair, agreeing, block):
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    want = pair[4]
    agreeing.reset()
    got, stats = generate(agreeing, PROMPT, N, SamplingParams(0.0), np.random.default_rng(0),
                          drafter=DSparkDrafter(agreeing, max_block=block))
    assert got == want
    assert stats.proposed > 0 and stats.accepted_draft == stats.proposed and stats.miss_first == 0


def test_disagreeing_drafter_rolls_back_to_target_only(pair):
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import Scheduler, generate

    d, cfg, model, plain, want, nxt = pair
    wrong = nxt.copy()
    for t in set(want[10:60:7]):  # the drafter is wrong after these tokens, at varying block positions
        wrong[t] = (wrong[t] + 1) % cfg.n_vocab
    engine = _with_support(pair, "disagree", wrong)
    got, stats = generate(engine, PROMPT, 80, SamplingParams(0.0), np.random.default_rng(0),
                          drafter=DSparkDrafter(engine), scheduler=Scheduler(enabled=False))
    assert got == want[:80]
    assert stats.partial + stats.miss_first > 0 and stats.accepted_draft < stats.proposed
    plain.reset()
    generate(plain, PROMPT, 80, SamplingParams(0.0), np.random.default_rng(0))
    nxt_tok = want[80]
    np.testing.assert_array_equal(engine.decode(nxt_tok), plain.decode(nxt_tok))


def test_theta_zero_proposes_full_blocks(pair, tmp_path):
    from ds4tvm.families.dspark.random_model import write_random_dspark
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import Scheduler, generate

    d, cfg, model, *_ = pair
    support = write_random_dspark(tmp_path / "random.gguf", cfg, seed=9)
    r = run_ds4_compile(model, "--target", "llvm", "-o", tmp_path / "art", "--max-context", "512", "--max-verify", "8",
                        "--mtp", support, "--quiet")
    assert r.returncode == 0, r.stderr
    engine = Engine(tmp_path / "art")
    drafter = DSparkDrafter(engine, theta=0.0)
    _, stats = generate(engine, PROMPT, 40, SamplingParams(0.0), np.random.default_rng(0), drafter=drafter,
                        scheduler=Scheduler(enabled=False))
    assert stats.cycles > 0 and stats.no_draft == 0 and stats.proposed == 5 * stats.cycles


def test_cli_dspark_strict_and_errors(pair, agreeing, tmp_path):
    d, cfg, model, plain, want, nxt = pair
    ids = ",".join(map(str, PROMPT))
    base = run_ds4("run", "-m", d / "agree", "--tokens", ids, "-n", "30", "--temp", "0", "--json")
    spec = run_ds4("-m", d / "agree", "--tokens", ids, "-n", "30", "--temp", "0", "--dspark", "--json")
    strict = run_ds4("run", "-m", d / "agree", "--tokens", ids, "-n", "30", "--temp", "0", "--dspark-strict", "--json")
    for r in (base, spec, strict):
        assert r.returncode == 0, r.stderr
    b, s, st = (json.loads(r.stdout) for r in (base, spec, strict))
    assert b["tokens"] == s["tokens"] == st["tokens"] == want[:30]
    assert "spec" in s and s["spec"]["accepted_draft"] > 0 and "spec" not in st
    r = run_ds4("run", "-m", d / "agree", "--tokens", ids, "-n", "20", "--temp", "0", "--dspark")
    assert "ds4: DSpark stats cycles=" in r.stderr and "accept_rate=" in r.stderr and "t/s=" in r.stderr
    r = run_ds4("run", "-m", model, "--tokens", ids, "--dspark")
    assert r.returncode == 2 and "--mtp" in r.stderr
    r = run_ds4("run", "-m", d / "plain", "--tokens", ids, "--dspark")
    assert r.returncode == 2 and "no DSpark drafter" in r.stderr
    from ds4tvm.families.deepseek4.random_model import tiny_config
    from ds4tvm.families.dspark.random_model import write_random_dspark

    other = write_random_dspark(tmp_path / "other.gguf", tiny_config(n_vocab=1024), seed=2)
    r = run_ds4_compile(model, "--target", "llvm", "-o", tmp_path / "x", "--mtp", other, "--quiet")
    assert r.returncode == 2 and "support file does not match this model" in r.stderr, r.stderr
