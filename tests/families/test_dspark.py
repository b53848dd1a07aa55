"""DSpark end to end on a tiny DeepSeek-V4: the drafter compiled into the target's artifact,
driven by the speculative loop, against target-only decoding."""

import json

import numpy as np
import pytest

from conftest import always_drafting, compile_here, run_ds4, run_ds4_compile

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def pair(demo_pair):
    """The demo pair (conftest.demo_pair: a tiny target whose residual writers are scaled down, so
    its next token is (nearly) a function of the current one, and a Markov-head DSpark support file
    that follows its greedy path) with the target-only artifact beside it."""
    from random_demo import N_TOKENS
    from ds4tvm.families.deepseek4.config import Config
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    model, support, art, prompt = demo_pair
    cfg = Config.from_gguf(open_gguf(model))
    plain = Engine(model.parent / "artifact-target-only")
    want, _ = generate(plain, prompt, N_TOKENS, SamplingParams(0.0), np.random.default_rng(0))
    seq = [prompt[-1]] + want
    succ = {}
    for a, b in zip(seq, seq[1:]):
        assert succ.setdefault(a, b) == b, "the target's greedy path is not a function of the last token"
    nxt = np.arange(cfg.n_vocab)
    for a, b in succ.items():
        nxt[a] = b
    return cfg, model, support, art, prompt, plain, want, nxt


@pytest.fixture(scope="module")
def agreeing(pair):
    from ds4tvm.runtime.engine import Engine

    return Engine(pair[3])


@pytest.fixture(scope="module")
def disagreeing(pair, tmp_path_factory):
    """The same Markov head, wrong after a few of the tokens on the path (at varying block positions)."""
    from ds4tvm.families.dspark.agreeing import write_markov_dspark
    from ds4tvm.runtime.engine import Engine

    cfg, model, _, _, _, _, want, nxt = pair
    d = tmp_path_factory.mktemp("dspark")
    wrong = nxt.copy()
    for t in set(want[10:60:7]):
        wrong[t] = (wrong[t] + 1) % cfg.n_vocab
    support = write_markov_dspark(d / "disagree.gguf", cfg, wrong, seed=5)
    compile_here(model, "--target", "llvm", "-o", d / "art", "--max-context", "512", "--max-verify", "8",
                 "--mtp", support, "--quiet")
    return Engine(d / "art")


@pytest.mark.parametrize("block", [1, 2, 3, 4, 5])
def test_identity_every_draft_accepted(pair, agreeing, block):
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    prompt, want = pair[4], pair[6]
    agreeing.reset()
    got, stats = generate(agreeing, prompt, len(want), SamplingParams(0.0), np.random.default_rng(0),
                          drafter=DSparkDrafter(agreeing, max_block=block))
    c = stats.counters
    assert got == want
    assert c["proposed"] > 0 and c["accepted_draft"] == c["proposed"] and c["miss_first"] == 0


def test_disagreeing_drafter_rolls_back_to_target_only(pair, disagreeing):
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter, Scheduler
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    prompt, want = pair[4], pair[6]
    disagreeing.reset()
    got, stats = generate(disagreeing, prompt, 80, SamplingParams(0.0), np.random.default_rng(0),
                          drafter=DSparkDrafter(disagreeing, scheduler=Scheduler(enabled=False)))
    c = stats.counters
    assert got == want[:80]
    assert c["partial"] + c["miss_first"] > 0 and c["accepted_draft"] < c["proposed"]
    # The state after the rejections is the state plain decoding leaves, bit for bit, on the same
    # artifact: verify and decode round alike (tests/unit/test_kernels.py). The target-only artifact
    # (`plain`) is compiled for this CPU (`cpu`: LLVM fuses multiply-adds) and this one for generic
    # `llvm` (no FMA): those two differ by 7e-7 in every kernel, speculation or not.
    nxt_tok = want[80]
    after_speculation = disagreeing.decode(nxt_tok).logits
    disagreeing.reset()
    generate(disagreeing, prompt, 80, SamplingParams(0.0), np.random.default_rng(0))
    np.testing.assert_array_equal(after_speculation, disagreeing.decode(nxt_tok).logits)


def test_theta_zero_proposes_full_blocks_and_theta_one_none(pair, disagreeing):
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter, Scheduler
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    prompt, engine = pair[4], disagreeing
    engine.reset()
    drafter = DSparkDrafter(engine, theta=0.0, scheduler=Scheduler(enabled=False))
    _, stats = generate(engine, prompt, 40, SamplingParams(0.0), np.random.default_rng(0), drafter=drafter)
    c = stats.counters
    assert c["cycles"] > 0 and c["no_draft"] == 0 and c["proposed"] == 5 * c["cycles"]
    # sigma(c_0) < 1 for every row: at theta = 1 every proposal is empty, and the back-off skips
    engine.reset()
    _, stats = generate(engine, prompt, 40, SamplingParams(0.0), np.random.default_rng(0),
                        drafter=DSparkDrafter(engine, theta=1.0))
    c = stats.counters
    assert c["no_draft"] > 0 and c["scheduler_skips"] > 0 and c["proposed"] == 0
    assert c["cycles"] + c["scheduler_skips"] == 40 - 9   # asked while 40..10 tokens remain
    assert "scheduler_skips=" in stats.line() and stats.line().startswith("ds4: DSpark stats cycles=")


def test_cli_dspark_strict_and_errors(pair, tmp_path):
    cfg, model, support, art, prompt, _, want, _ = pair
    ids = ",".join(map(str, prompt))
    base = run_ds4("run", "-m", art, "--tokens", ids, "-n", "30", "--temp", "0", "--json")
    spec = run_ds4("-m", art, "--tokens", ids, "-n", "30", "--temp", "0", "--dspark", "--json", env=always_drafting())
    strict = run_ds4("run", "-m", art, "--tokens", ids, "-n", "30", "--temp", "0", "--dspark-strict", "--json")
    for r in (base, spec, strict):
        assert r.returncode == 0, r.stderr
    b, s, st = (json.loads(r.stdout) for r in (base, spec, strict))
    assert b["tokens"] == s["tokens"] == st["tokens"] == want[:30]
    assert "spec" in s and s["spec"]["accepted_draft"] > 0 and "spec" not in st
    r = run_ds4("run", "-m", art, "--tokens", ids, "-n", "20", "--temp", "0", "--dspark")
    assert "ds4: DSpark stats cycles=" in r.stderr and "accept_rate=" in r.stderr and "t/s=" in r.stderr
    r = run_ds4("run", "-m", model, "--tokens", ids, "--dspark")
    assert r.returncode == 2 and "--mtp" in r.stderr
    r = run_ds4("run", "-m", model.parent / "artifact-target-only", "--tokens", ids, "--dspark")
    assert r.returncode == 2 and "no DSpark drafter" in r.stderr
    r = run_ds4("run", "-m", art, "--tokens", ids, "--mtp-draft", "2")   # a DSpark file, MTP's flag
    assert r.returncode == 2 and f"{support}: holds the dspark drafter; --mtp-draft needs a legacy MTP" in r.stderr
    from ds4tvm.families.deepseek4.random_model import tiny_config
    from ds4tvm.families.dspark.random_model import write_random_dspark

    other = write_random_dspark(tmp_path / "other.gguf", tiny_config(n_vocab=1024), seed=2)
    r = run_ds4_compile(model, "--target", "llvm", "-o", tmp_path / "x", "--mtp", other, "--quiet")
    assert r.returncode == 2 and "support file does not match this model" in r.stderr, r.stderr


def test_a_continued_sequence_drafts_as_a_cold_one(pair, agreeing):
    """Prefix reuse with DSpark (runtime/prefix.py): the second turn continued from a checkpoint
    after the first prompt has bitwise the state of a cold start once the prompt is in (the target's
    and the DSpark rings'), then its tokens and counters. Continued from the kept sequence (DSpark's
    rings allow a rewind of one position) the target's state is a cold start's and so are the ring
    rows of the positions prefilled; the older rows are those the first turn's decode steps wrote by
    ds4's direct path, which differ from batched ones in rounding, so only the tokens are a cold
    start's."""
    from ds4tvm.families.dspark.model import WINDOW
    from ds4tvm.runtime.checkpoint import CheckpointStore
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.prefix import resume
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    prompt, e, greedy = pair[4], agreeing, SamplingParams(0.0)

    store, at_prompt = CheckpointStore(e, "dspark"), []
    e.reset()
    first, _ = generate(e, prompt, 30, greedy, np.random.default_rng(0), drafter=DSparkDrafter(e),
                        on_prompt=lambda: store.add(e.snapshot()))
    turn, kept = prompt + first + [5, 6, 7], e.snapshot()
    e.reset()
    want, cold = generate(e, turn, 50, greedy, np.random.default_rng(0), drafter=DSparkDrafter(e),
                          on_prompt=lambda: at_prompt.append(e.snapshot()))
    for how in ("kept", "checkpoint"):
        e.restore(kept)
        if how == "checkpoint":
            e.prefill([1] * 20)
        held = resume(e, turn, store)
        assert held == (len(prompt) - 1 if how == "checkpoint" else len(kept.history) - 1)
        got, stats = generate(e, turn, 50, greedy, np.random.default_rng(0), drafter=DSparkDrafter(e),
                              on_prompt=lambda: at_prompt.append(e.snapshot()))
        fresh = [q % WINDOW for q in range(held, len(turn))]
        for spec, a, b in zip(e.state_specs, at_prompt[0].arrays, at_prompt[-1].arrays):
            if how == "kept" and spec.group == "dspark":
                a, b = a[fresh], b[fresh]
            np.testing.assert_array_equal(a, b, err_msg=f"{how}: {spec.name}")
        assert got == want, how
        assert how == "kept" or stats.counters == cold.counters


def test_exact_sampling_with_the_real_drafter_keeps_the_law_of_plain_sampling(pair, agreeing):
    """T = 1 with top-k 3: the law of the three tokens after the prompt under --mtp-exact-sampling
    with the real DSpark drafter (its Markov head proposes the target's greedy path, which top-k 3
    sampling leaves often enough for drafts to be both accepted and rejected), against plain
    sampling: a chi-square test of homogeneity over the outcomes (rare ones pooled)."""
    from scipy.stats import chi2_contingency

    from ds4tvm.runtime.drafters.dspark import DSparkDrafter, Scheduler
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    params, prompt = SamplingParams(1.0, top_k=3, min_p=0.0), pair[4]
    counts, proposed, accepted = {}, 0, 0
    for run in range(1600):
        spec = run % 2 == 0
        drafter = DSparkDrafter(agreeing, theta=0.0, scheduler=Scheduler(enabled=False, tail_min_tokens=0)) \
            if spec else None
        agreeing.reset()
        out, stats = generate(agreeing, prompt, 3, params, np.random.default_rng(run), drafter=drafter, exact=spec)
        counts.setdefault(tuple(out), [0, 0])[spec] += 1
        if spec:
            proposed += stats.counters["proposed"]
            accepted += stats.counters["accepted_draft"]
    assert 0 < accepted < proposed, (accepted, proposed)   # drafts both taken and refused
    table = np.array(list(counts.values())).T
    rare = table.sum(0) < 20
    table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)]) if rare.any() else table
    assert table.shape[1] >= 4 and table.sum() == 1600
    assert chi2_contingency(table).pvalue > 0.01, table
