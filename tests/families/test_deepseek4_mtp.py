"""Legacy one-stage MTP for DeepSeek-V4 (ds4-spec §7): the graph against a numpy reference written
from the spec, and the drafter in the speculative loop and the CLI against target-only decoding."""

import json

import numpy as np
import pytest

from conftest import always_drafting, compile_here, run_ds4

pytestmark = pytest.mark.compile
PROMPT = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    d = tmp_path_factory.mktemp("mtp")
    cfg = tiny_config()
    # residual writers scaled down: the next token is nearly a function of the current one, so an
    # identity-like MTP block agrees with the target (families/deepseek4_mtp/agreeing.py)
    return d, cfg, write_random_deepseek4(d / "target.gguf", cfg, seed=21, residual_scale=1e-4)


def _compile(d, model, support, name, *extra):
    compile_here(model, "--target", "llvm", "-o", d / name, "--max-context", "512", "--max-verify", "8",
                 "--mtp", support, "--quiet", *extra)
    return d / name


@pytest.fixture(scope="module")
def agreeing(target):
    from ds4tvm.families.deepseek4_mtp.agreeing import write_agreeing_mtp

    d, cfg, model = target
    support = write_agreeing_mtp(d / "agree.gguf", model, seed=5)
    return _compile(d, model, support, "agree", "--max-batch", "2"), support


@pytest.fixture(scope="module")
def random_mtp(target):
    """A random support file (its block reads the target's streams), compiled without FP8 rounding."""
    from ds4tvm.families.deepseek4_mtp.random_model import write_random_mtp

    d, cfg, model = target
    support = write_random_mtp(d / "random.gguf", cfg, seed=3)
    return _compile(d, model, support, "random", "--no-kv-rounding"), support


def _transformers_streams(model, ids) -> np.ndarray:
    """The target's hc streams before its output head [S, hc, D], as transformers' DeepseekV4
    computes them on the GGUF's weights (read by gguf-py), float64."""
    import torch
    from hf_models import hf_model_from_gguf

    hf, seen = hf_model_from_gguf(model).double(), []
    hf.set_experts_implementation("eager")
    hook = hf.model.hc_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    hook.remove()
    return seen[0][0].numpy()


def test_draft_logits_match_the_reference(target, random_mtp):
    """A random support file, no FP8 rounding: the rows written for a 24-token prompt (longer than
    the 16-row window), then two recursive draft steps, against tests/mtp_reference.py (transformers'
    DeepseekV4 layer and HC head on the support file's weights) fed the target's streams as
    transformers computes them (the artifact's own checked against those). Bound 1e-4: the
    DeepSeek-V4 trunk's against transformers (test_deepseek4_oracle.py); measured here 1.7e-7 for
    the trunk's streams, 9e-7 for the draft logits and 2.0e-6 for the block's streams. In
    the default run: the agreeing file's block is near an identity, so only a random one shows a
    wrong block."""
    from mtp_reference import MTPReference

    from ds4tvm.runtime.drafters.mtp import MTPDrafter
    from ds4tvm.runtime.engine import Engine

    d, cfg, model = target
    art, support = random_mtp
    e = Engine(art)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.n_vocab, 24)]
    step = e.prefill(prompt)
    MTPDrafter(e, n_draft=3, margin=0.0).begin(e, step, frozenset())
    hc = _transformers_streams(model, prompt)
    assert np.abs(step.outputs["hc_state"] - hc).max() <= 1e-4
    ref = MTPReference(model, support)
    for p, tok in enumerate(prompt):
        ref.observe(hc[p - 1] if p else np.zeros_like(hc[0]), tok, p)
    t, streams, ref_streams = int(np.argmax(step.logits)), step.outputs["hc_state"][-1], hc[-1]
    for i in range(2):   # the chosen token, then the first draft
        out = e.call("mtp_step", hc_prev=streams[None].astype(np.float32), tokens=[t], start=e.pos + i)
        want, ref_streams = ref.step(ref_streams, t, e.pos + i)
        assert np.abs(out["logits"][0] - want).max() <= 1e-4, i
        assert np.abs(out["hc_state"][0] - ref_streams).max() <= 1e-4, i
        t, streams = int(np.argmax(want)), out["hc_state"][0]


def test_agreeing_drafter_equals_target_only_and_is_accepted(agreeing):
    from ds4tvm.runtime.drafters.mtp import MTPDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    e = Engine(agreeing[0])
    want, _ = generate(e, PROMPT, 120, SamplingParams(0.0), np.random.default_rng(0))
    for n_draft in (2, 4):
        e.reset()
        got, stats = generate(e, PROMPT, 120, SamplingParams(0.0), np.random.default_rng(0),
                              drafter=MTPDrafter(e, n_draft, margin=0.0))
        c = stats.counters
        assert got == want
        assert c["proposed"] >= 40 and c["accepted_draft"] >= 0.9 * c["proposed"], c
        assert stats.line().startswith("ds4: MTP stats cycles=")


def test_generations_sharing_the_engine_with_the_legacy_drafter(agreeing):
    """Four generations through the scheduler, two with the legacy MTP drafter, greedy and seeded:
    each as alone (greedy: target-only); the batched decode carries the hc streams it reads, and
    two sequences' MTP steps in one call give each one's logits, streams and ring as alone."""
    from batching import (assert_batched_call_is_call, assert_batched_decode_is_decode,
                          assert_batched_prefill_is_prefill, assert_batched_verify_is_verify,
                          assert_together_is_alone)

    from ds4tvm.runtime.drafters.mtp import MTPDrafter
    from ds4tvm.runtime.engine import Engine

    e = Engine(agreeing[0])
    assert_batched_decode_is_decode(e, [PROMPT, [3, 4, 5, 6, 7, 8, 9, 10]])
    assert_batched_prefill_is_prefill(e, [PROMPT, [3, 4, 5, 6, 7, 8, 9, 10]], chunk=3)
    assert_batched_verify_is_verify(e, [PROMPT, [3, 4, 5, 6, 7, 8, 9, 10]], [[5, 6, 7], [9]])
    assert_batched_call_is_call(e, "mtp_step", [PROMPT, [3, 4, 5, 6, 7, 8, 9, 10]], lambda engine, step: {
        "hc_prev": step.outputs["hc_state"][-1:], "tokens": [11], "start": engine.pos})
    mtp = lambda: MTPDrafter(e, 3, margin=0.0)  # noqa: E731
    calls, _ = assert_together_is_alone(e, [(PROMPT, 0, 0, mtp), (PROMPT[:3], 0, 1, None), (PROMPT[1:], 1, 2, mtp),
                                            ([9, 8, 7], 0.9, 3, None)])
    assert max(calls) == 2


def test_disagreeing_drafter_rolls_back_to_target_only(target, agreeing):
    """The agreeing drafter with every third draft made wrong: every rejected block leaves the
    state target-only decoding leaves (same tokens, same next logits)."""
    from ds4tvm.runtime.drafters.mtp import MTPDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    d, cfg, model = target
    plain, spec = Engine(agreeing[0]), Engine(agreeing[0])
    want, _ = generate(plain, PROMPT, 60, SamplingParams(0.0), np.random.default_rng(0))
    got, stats = generate(spec, PROMPT, 60, SamplingParams(0.0), np.random.default_rng(0),
                          drafter=_Wrong(MTPDrafter(spec, 4, margin=0.0), cfg.n_vocab))
    assert got == want
    assert 0 < stats.counters["accepted_draft"] < stats.counters["proposed"]
    if spec.pos == plain.pos + 1:   # the last token was a verified draft: committed, where plain decoding stops
        plain.decode(want[-1])
    assert spec.history == plain.history
    np.testing.assert_array_equal(spec.decode(3).logits, plain.decode(3).logits)


class _Wrong:
    """Every third drafted token is replaced by another one."""

    def __init__(self, inner, vocab):
        self.inner, self.vocab, self.n = inner, vocab, 0

    def draft(self, engine, token, max_tokens):
        out = self.inner.draft(engine, token, max_tokens)
        for i in range(len(out)):
            self.n += 1
            if self.n % 3 == 0:
                out[i] = (out[i] + 1) % self.vocab
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_cli_mtp_draft_identity_json_and_errors(target, agreeing):
    d, cfg, model = target
    art, support = agreeing
    ids = ",".join(map(str, PROMPT))
    always = always_drafting()
    base = run_ds4("run", "-m", art, "--tokens", ids, "-n", "40", "--temp", "0", "--json")
    spec = run_ds4("run", "-m", art, "--mtp", support, "--tokens", ids, "-n", "40", "--temp", "0", "--mtp-draft", "2",
                   "--mtp-margin", "0", "--json", env=always)
    # ds4's default margin (3.0) is wider than this random model's top-1/top-2 gaps: margin-skips
    skips = run_ds4("run", "-m", art, "--tokens", ids, "-n", "40", "--temp", "0", "--mtp-draft", "2", "--json",
                    env=always)
    for r in (base, spec, skips):
        assert r.returncode == 0, r.stderr
    b, s, k = (json.loads(r.stdout) for r in (base, spec, skips))
    assert b["tokens"] == s["tokens"] == k["tokens"] and len(b["tokens"]) == 40
    assert s["spec"]["accepted_draft"] > 0.9 * s["spec"]["proposed"] > 0 and s["spec"]["margin_skips"] == 0, s["spec"]
    assert k["spec"]["margin_skips"] > 0, k["spec"]
    r = run_ds4("run", "-m", art, "--tokens", ids, "-n", "8", "--temp", "0", "--mtp-draft", "3", "--mtp-timing",
                env=always)
    assert r.returncode == 0 and "ds4: mtp timing decode2 drafted=" in r.stderr and "ds4: MTP stats" in r.stderr, \
        r.stderr
    for args, words in ((("--dspark",), (str(support), "mtp drafter", "--dspark")),
                        (("--mtp-draft", "17"), ("--mtp-draft 17", "2..16")),
                        (("--mtp-draft", "2", "--mtp-margin", "-1"), ("--mtp-margin -1",))):
        r = run_ds4("run", "-m", art, "--tokens", ids, "-n", "4", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    r = run_ds4("run", "-m", model, "--tokens", ids, "--mtp-draft", "2")
    assert r.returncode == 2 and "--mtp SUPPORT.gguf" in r.stderr, r.stderr
    # a GGUF is refused before it is compiled on first use
    r = run_ds4("run", "-m", model, "--mtp", support, "--tokens", ids, "--dspark")
    assert r.returncode == 2 and f"{support}: holds the mtp drafter; --dspark needs a DSpark" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_continued_sequence_drafts_as_a_cold_one(random_mtp):
    """Prefix reuse with MTP (runtime/prefix.py): the second turn continued from the kept sequence,
    or from a checkpoint, has bitwise the state of a cold start on the whole prompt once the prompt
    is in (the target's and the MTP ring: the drafter's first rows after a kept prefix come from the
    re-evaluated position), then its tokens and acceptance."""
    from ds4tvm.runtime.checkpoint import CheckpointStore
    from ds4tvm.runtime.drafters.mtp import MTPDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.prefix import resume
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    e, greedy = Engine(random_mtp[0]), SamplingParams(0.0)
    store = CheckpointStore(e, "mtp")
    first, _ = generate(e, PROMPT, 40, greedy, np.random.default_rng(0), drafter=MTPDrafter(e, 2, margin=0.0),
                        on_prompt=lambda: store.add(e.snapshot()))
    turn = PROMPT + first + [12, 13, 14]
    kept = e.snapshot()
    e.reset()
    at_prompt = []
    want, cold = generate(e, turn, 60, greedy, np.random.default_rng(0), drafter=MTPDrafter(e, 2, margin=0.0),
                          on_prompt=lambda: at_prompt.append(e.snapshot()))
    for how in ("kept", "checkpoint"):
        e.restore(kept)
        if how == "checkpoint":
            e.prefill([1] * 20)           # diverge beyond the rewind: only the checkpoint after PROMPT helps
        held = resume(e, turn, store)
        assert held == (len(PROMPT) - 1 if how == "checkpoint" else len(kept.history) - 1)
        got, stats = generate(e, turn, 60, greedy, np.random.default_rng(0), drafter=MTPDrafter(e, 2, margin=0.0),
                              on_prompt=lambda: at_prompt.append(e.snapshot()))
        for spec, a, b in zip(e.state_specs, at_prompt[0].arrays, at_prompt[-1].arrays):
            np.testing.assert_array_equal(a, b, err_msg=f"{how}: {spec.name}")
        assert got == want, how
        assert stats.counters == cold.counters, how
