"""GLM-5.3's MTP (nextn) layer and its drafter (ds4-spec §4), in both readings of its input (the
target's row before the token: the output head's input, or the trunk's hc streams; the file's
eh_proj width says which). No oracle runs GLM's MTP layer: the compiled step is checked against the
numpy reference written from the spec (ds4tvm/training/glm_reference.nextn_logits, its attention
checked against transformers' GLM layers in test_glm_reference.py and its MoE here), which reads the
file with gguf-py and is fed the trunk's rows from transformers, and the drafter in the speculative
loop against target-only decoding, with test doubles that always and never agree with the target."""

import re

import numpy as np
import pytest

from conftest import always_drafting, exact_sampling_outcomes, run_ds4, shared_tiny_glm, tiny_glm

from ds4tvm.families.glm5next.random_model import tiny_config

pytestmark = pytest.mark.compile
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 512, 41)]   # > 16 positions: the indexer selects
VOCAB = 512


# the default run reads the spec's streams here (§4: HC-shaped), the grammar tests' artifact; the
# hidden reading, the tiny config's default, is the one the GPU check drafts with; here under -m slow
@pytest.fixture(scope="module", params=[pytest.param("hidden", marks=pytest.mark.slow), "streams"])
def model(request, tmp_path_factory):
    """A tiny random GLM-5.3 with its nextn layer (families/glm5next/random_model.py) reading
    `request.param`, compiled (conftest.tiny_glm; the streams one shared with the grammar tests):
    (artifact, GGUF, what the layer reads)."""
    assert tiny_config().n_vocab == VOCAB
    if request.param == "streams":
        return shared_tiny_glm(tmp_path_factory)
    return tiny_glm(tmp_path_factory.mktemp("glm_mtp"), request.param)


def _engine(model):
    from ds4tvm.runtime.engine import Engine

    return Engine(model[0])


def _reference_logits(model, history: list[int], rows: np.ndarray) -> np.ndarray:
    """The reference's logits of the last token of history, each position paired with the
    target's row before it (rows: the target's row of every position but the last)."""
    from ds4tvm.training.glm_reference import nextn_logits, read_nextn

    cfg, layer, top = read_nextn(model[1])
    before = np.concatenate([np.zeros((1, rows.shape[1])), rows[:len(history) - 1]])
    return nextn_logits(layer, top, cfg, history, before)


def _transformers(model):
    """transformers' Glm5Next on the GGUF's trunk weights (dequantized by gguf-py), float64, its
    config from the file's keys read by gguf-py."""
    import torch  # noqa: F401
    from hf_models import TINY_GLM5_VISION, glm5_parameter
    from test_glm5next_quant import _hf_text_config
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from ds4tvm.training.glm_reference import read_config, read_tensors

    cfg = read_config(model[1])
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=_hf_text_config(cfg),
                                                         vision_config=TINY_GLM5_VISION)).eval().double()
    params = {n: t.detach().numpy() for n, t in hf.state_dict(keep_vars=True).items()}
    trunk = read_tensors(model[1], lambda name: not name.startswith(f"blk.{cfg.n_layers}."))  # no MTP layer in HF
    for name, values in trunk.items():
        view = glm5_parameter(params, name, cfg)
        view[...] = values.reshape(view.shape)
    hf.set_experts_implementation("eager")
    return hf


def _transformers_rows(model, ids) -> tuple[np.ndarray, np.ndarray]:
    """What the MTP layer reads at every position, as transformers computes it: the output head's
    input (the trunk's streams collapsed and normed) or the streams before the collapse; in
    float64, and in float32 (how far float32 rounding alone moves these rows on this input)."""
    import torch

    hf, seen = _transformers(model), []
    module = hf.lm_head if model[2] == "hidden" else hf.model.language_model.hc_head
    hook = module.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
        hf.float()(torch.tensor([ids]))
    hook.remove()
    return tuple(s[0].double().reshape(len(ids), -1).numpy() for s in seen)


def _assert_within_trunk_bound(ours, rows, rows32):
    """Each row of ours within GLM's trunk bound (2e-4, test_glm5next_oracle.py) of transformers'
    float64 rows, or, where float32 rounding alone moves a row further, within 3x of what it moves
    transformers' own float32 run: past 16 positions the indexer's selection and the KDA recurrence
    amplify rounding (this prompt's row 16: transformers' float32 run 1.3e-4 from its float64,
    ours 2.5e-4 on an AVX-512 Xeon, 6.9e-5 on a Zen 3)."""
    ours_off = np.abs(ours - rows).max(axis=1)
    bound = np.maximum(2e-4, 3 * np.abs(rows32 - rows).max(axis=1))
    assert (ours_off <= bound).all(), [(i, ours_off[i], bound[i]) for i in np.flatnonzero(ours_off > bound)]


def test_nextn_step_matches_the_numpy_reference(model):
    """After the prompt (rows written by observe), and again after 24 speculative tokens (rows
    written while drafting and observing), the step's logits equal the reference's over the
    whole history. After the prompt the reference reads the trunk's hidden states as transformers
    computes them (the artifact's own, from a separate target-only prefill, checked against those:
    _assert_within_trunk_bound); after 24 more tokens it
    reads the artifact's, because on this random model transformers' trunk departs from ours at
    rows 46, 47 and 57 (up to 0.18) where candidates tie exactly (pool scores of zero, which
    glm5_decision_margins leaves out) and torch.topk breaks the tie otherwise than ours (lowest
    index): with transformers' ties broken toward the lower index the departure drops to 4e-4 at
    rows 46 and 47, still above the bound (issue 41's note)."""
    from ds4tvm.runtime.drafters.glm_mtp import GLMMTPDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    e, plain = _engine(model), _engine(model)
    for n_new in (0, 24):
        e.reset()
        drafter = GLMMTPDrafter(e)
        if n_new:
            generate(e, PROMPT, n_new, SamplingParams(0.0), np.random.default_rng(0), drafter=drafter)
        else:
            drafter.begin(e, e.prefill(PROMPT), frozenset())
        plain.reset()
        step = plain.prefill(e.history)
        t = int(np.argmax(step.logits))
        got = e.call("mtp_step", hidden_prev=drafter.hidden[None], tokens=[t], start=e.pos)["logits"][0]
        rows = step.outputs[model[2]].astype(np.float64)
        if not n_new:   # see the docstring for the longer history
            rows, rows32 = _transformers_rows(model, e.history)
            _assert_within_trunk_bound(step.outputs[model[2]], rows, rows32)
        want = _reference_logits(model, e.history + [t], rows)[-1]
        assert np.abs(want).max() > 0.5
        # measured 3.9e-5 (hidden) and 5.4e-5 (streams) after the prompt, the trunk's departure from
        # transformers carried through the layer; 7e-7 and 1e-6 after 24 tokens, fed the artifact's rows
        assert np.abs(got - want).max() <= 1e-4, (n_new, np.abs(got - want).max())


def test_batched_decode_and_generations_sharing_the_engine(model):
    """Two sequences' decode, a chunk beside a decode, two verify blocks and two MTP steps, each in one
    call: each one's logits, MTP inputs and MTP state bit for bit as alone;
    four generations through the scheduler (with the MTP drafter and without, greedy and seeded)
    as each alone, the greedy ones as target-only decoding."""
    from batching import (assert_batched_call_is_call, assert_batched_decode_is_decode,
                          assert_batched_prefill_is_prefill, assert_batched_verify_is_verify,
                          assert_together_is_alone)

    from ds4tvm.runtime.drafters.glm_mtp import GLMMTPDrafter

    e = _engine(model)
    assert_batched_decode_is_decode(e, [PROMPT, PROMPT[:20]])   # two sequences: the default run's time
    assert_batched_prefill_is_prefill(e, [PROMPT, PROMPT[:20]])   # two sequences: the default run's time
    assert_batched_verify_is_verify(e, [PROMPT, PROMPT[:20]], [PROMPT[5:5 + e.max_verify], PROMPT[9:10]])
    reads = e.drafters["glm_mtp"]["reads"]
    assert_batched_call_is_call(e, "mtp_step", [PROMPT, PROMPT[:20]], lambda engine, step: {
        "hidden_prev": step.outputs[reads][-1:], "tokens": [PROMPT[-1]], "start": engine.pos})
    mtp = lambda: GLMMTPDrafter(e)  # noqa: E731
    calls, _ = assert_together_is_alone(e, [(PROMPT, 0, 0, mtp), (PROMPT[:30], 0, 1, None), (PROMPT[3:], 1, 2, mtp),
                                            (PROMPT[:17], 0.9, 3, None)])
    assert max(calls) > 1


class _Double:
    """The real drafter (its state writes, timing and counters) with the draft replaced: the token
    target-only decoding emits there (`agree`) or another one."""

    def __init__(self, inner, want: list[int], agree: bool, vocab: int):
        self.inner, self.want, self.agree, self.vocab = inner, want, agree, vocab

    def draft(self, engine, token, max_tokens):
        out = self.inner.draft(engine, token, max_tokens)
        i = engine.pos - len(PROMPT) + 1
        if out and i < len(self.want):
            out = [self.want[i] if self.agree else (self.want[i] + 1) % self.vocab]
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("agree", [True, False])
def test_doubles_agreeing_and_not_leave_target_only_state(model, agree):
    """Greedy: the agreeing double is accepted on every cycle (2 tokens per verify), the other
    commits one token per cycle; both emit target-only's tokens and leave the target's state and
    the nextn layer's rows as target-only decoding with the drafter observing leaves them."""
    from ds4tvm.runtime.drafters.glm_mtp import GLMMTPDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    greedy, n = SamplingParams(0.0), 40
    spec, plain, other = _engine(model), _engine(model), _engine(model)
    want, _ = generate(plain, PROMPT, n, greedy, np.random.default_rng(0))
    drafter = _Double(GLMMTPDrafter(spec), want, agree, VOCAB)
    got, stats = generate(spec, PROMPT, n, greedy, np.random.default_rng(0), drafter=drafter)
    assert got == want
    c = stats.counters
    assert c["cost_skips"] == 0 and c["cycles"] == c["proposed"]
    if agree:
        assert c["accepted_draft"] == c["proposed"] == n // 2, c
    else:
        assert c["accepted_draft"] == 0 and c["proposed"] == n - 1, c
    observer = GLMMTPDrafter(other)      # the nextn rows of the same text, written by observe alone
    observer.begin(other, other.prefill(spec.history), frozenset())
    ours = spec.call("mtp_step", hidden_prev=drafter.hidden[None], tokens=[5], start=spec.pos)["logits"]
    theirs = other.call("mtp_step", hidden_prev=observer.hidden[None], tokens=[5], start=other.pos)["logits"]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    if spec.pos == plain.pos + 1:   # the last token was a verified draft: committed, where plain decoding stops
        plain.decode(want[-1])
    assert spec.history == plain.history
    np.testing.assert_array_equal(spec.decode(3).logits, plain.decode(3).logits)


def test_exact_sampling_keeps_the_law_of_plain_sampling(model):
    """T = 1 with top-k 3: the law of the two tokens after a fixed prompt under --mtp-exact-sampling,
    with drafts that the target accepts about half of the time, against plain sampling (a
    chi-square test of homogeneity over the 9 outcomes)."""
    from scipy.stats import chi2_contingency

    from ds4tvm.runtime.drafters.glm_mtp import GLMMTPDrafter

    table = exact_sampling_outcomes(_engine(model), GLMMTPDrafter, PROMPT[:8])
    assert table.shape[1] >= 4 and table.sum() == 1600
    assert chi2_contingency(table).pvalue > 0.01, table


def test_cli_mtp_identity_timing_and_flag_errors(model):
    art, gguf, reads = model
    said = run_ds4("inspect", gguf)
    assert said.returncode == 0, said.stderr
    assert {"hidden": "reads the output head's input", "streams": "reads the trunk's hc streams"}[reads] in said.stdout
    base = ("run", "-m", art, "-p", "The quick brown fox", "-n", "30", "--temp", "0")
    plain = run_ds4(*base)
    assert plain.returncode == 0, plain.stderr
    silent = run_ds4(*base, "--mtp")
    assert silent.returncode == 0 and silent.stdout == plain.stdout, silent.stderr
    assert "glm mtp cycle" not in silent.stderr
    timed = run_ds4(*base, "--mtp-timing", env=always_drafting())
    assert timed.returncode == 0 and timed.stdout == plain.stdout, timed.stderr
    lines = [ln for ln in timed.stderr.splitlines() if ln.startswith("ds4: glm mtp cycle:")]
    assert lines and all(re.fullmatch(r"ds4: glm mtp cycle: verify2 [\d.]+ ms, head\+draft [\d.]+ ms, "
                                      r"(ACCEPT|reject) \(draft \d+ .+ vs true (\d+ .+|none \(generation ended\))\)",
                                      ln) for ln in lines), lines[:3]
    assert re.search(r"ds4: GLM MTP stats cycles=\d+ proposed=\d+ accepted_draft=\d+ accept_rate=[\d.]+%",
                     timed.stderr)
    for flags, says in ((("--mtp", gguf), "read no support file"), (("--dspark",), "has no DSpark drafter"),
                        (("--mtp", "--mtp-draft", "3"), "drafts one token")):
        r = run_ds4(*base, *flags)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
