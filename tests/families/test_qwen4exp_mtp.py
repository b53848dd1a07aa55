"""Qwen3.8's MTP (nextn) layer and its drafter (ds4-spec §5). No oracle runs Qwen's MTP layer, so the
reference is written from the spec around transformers' own decoder layer: a random 9-layer
`Qwen4ExpForCausalLM` whose last layer is a gated-attention one is the trunk (layers 0-7) plus the
block of the MTP layer (layer 8, run by transformers on the nextn inputs), with enorm / hnorm /
eh_proj and the nextn HC head written here in torch (float64) from §5. Its GGUF is the converted
checkpoint with layer 8 turned into `blk.8` of an integrated MTP file. The drafter in the loop is
checked against target-only decoding, with test doubles that agree with the target, disagree, or
agree on the first draft only."""

import json
import os
import re
from dataclasses import replace

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import always_drafting, compile_here, exact_sampling_outcomes, run_ds4

pytestmark = [pytest.mark.compile, pytest.mark.oracle]
EOS = 7
# the Qwen3.8 trunk's bound against transformers (test_qwen4exp_oracle.py); the nextn step measured 1.9e-6
TOLERANCE = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, 512, 41)]   # > 35 positions: QSA selects


def _layer_types():
    return ["indexed_attention" if (i + 1) % 4 == 0 or i == 8 else "linear_attention" for i in range(9)]


def _nextn_weights(cfg, seed: int) -> dict:
    """The nextn tensors (GGUF names after blk.8., numpy order, gammas folded as the GGUF stores them)."""
    rng = np.random.default_rng(seed)
    E, W = cfg.n_embd, cfg.hc * cfg.n_embd
    return {"nextn.eh_proj.weight": rng.standard_normal((E, 2 * E)) / np.sqrt(2 * E),
            "nextn.enorm.weight": 1.0 + 0.1 * rng.standard_normal(E),
            "nextn.hnorm.weight": 1.0 + 0.1 * rng.standard_normal(W),
            "nextn.hc_head_norm.weight": 1.0 + 0.1 * rng.standard_normal(W),
            "nextn.hc_head_down.weight": rng.standard_normal((cfg.hc_rank, W)) / np.sqrt(W),
            "nextn.hc_head_up.weight": rng.standard_normal((W, cfg.hc_rank)) / np.sqrt(cfg.hc_rank)}


def _integrated(src, dst, nextn: dict):
    """The converted 9-layer file as 8 trunk layers + the MTP layer blk.8 with its nextn tensors."""
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.qwen4exp.config import ARCH, Config
    from ds4tvm.families.qwen4exp.tensors import tensor_specs
    from ds4tvm.gguf import open_gguf
    from ds4tvm.gguf.vocab import synthetic_vocab
    from ds4tvm.gguf.writer import TensorOut, write_gguf

    f = open_gguf(src)
    cfg = replace(Config.from_gguf(f), n_layers=8, n_nextn=1)
    tensors = []
    for spec in tensor_specs(cfg):
        shape = tuple(reversed(spec.shape))
        if spec.name in f.tensors:
            t = f.tensors[spec.name]
            tensors.append(TensorOut(spec.name, QT(t.ggml_type), shape, lambda t=t: np.asarray(t.data)))
        else:
            value = np.asarray(nextn[spec.name.split(".", 2)[2]], np.float32)
            tensors.append(TensorOut(spec.name, QT.F32, shape, lambda v=value: v))
    meta = {"general.architecture": ARCH, "general.name": "qwen mtp", **cfg.to_metadata(),
            **synthetic_vocab(cfg.n_vocab)}
    write_gguf(dst, ARCH, meta, tensors)
    return cfg


def _rms(x, gamma, groups=1):
    x = x.reshape(*x.shape[:-1], groups, -1)
    y = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)
    return y.reshape(*y.shape[:-2], -1) * gamma


class Reference:
    """Trunk logits and streams (transformers), and the MTP layer's logits and streams of every
    row: row p drafts position p + 1 from token p and the streams of p - 1 (`before` overrides
    those of chosen rows: a chained step reads the layer's own)."""

    def __init__(self, model, w: dict):
        import torch

        self.torch, self.model, self.w = torch, model, {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}
        self.text = model.model
        self.hc, self.E = model.config.hc_count, model.config.hidden_size

    def _run(self, ids, layers: int, pre=None, mixer=None):
        torch, captured = self.torch, {}
        self.model.config.num_hidden_layers = layers
        hooks = [self.text.hyper_connection_mixer.register_forward_pre_hook(
            lambda mod, args: captured.setdefault("streams", args[0]))]
        if pre is not None:
            hooks.append(self.text.layers[8].register_forward_pre_hook(pre))
        if mixer is not None:
            hooks.append(self.text.hyper_connection_mixer.register_forward_hook(lambda mod, args, out: mixer(args[0])))
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor(np.asarray(ids)[None]), use_cache=False).logits[0]
        finally:
            for h in hooks:
                h.remove()
        return logits.numpy(), captured["streams"][0].numpy()

    def trunk(self, ids):
        return self._run(ids, 8)

    def head(self, X):
        t, w = self.torch, self.w
        xn = t.tensor(_rms(X.numpy(), w["nextn.hc_head_norm.weight"].numpy(), self.hc))
        lo = t.nn.functional.silu(xn @ w["nextn.hc_head_down.weight"].T / self.hc)
        gate = t.sigmoid(lo @ w["nextn.hc_head_up.weight"].T).unflatten(-1, (self.hc, self.E))
        return (gate * xn.unflatten(-1, (self.hc, self.E))).mean(-2)

    def mtp(self, ids, streams, before: dict | None = None):
        t, w, hc, E = self.torch, self.w, self.hc, self.E
        prev = np.concatenate([np.zeros_like(streams[:1]), streams[:-1]])
        for row, value in (before or {}).items():
            prev[row] = value
        e = _rms(self.text.embed_tokens.weight.detach().numpy()[np.asarray(ids)], w["nextn.enorm.weight"].numpy())
        h = _rms(prev, w["nextn.hnorm.weight"].numpy(), hc).reshape(len(ids), hc, E)
        pairs = np.concatenate([np.broadcast_to(e[:, None], h.shape), h], axis=2)
        X = t.tensor(pairs) @ w["nextn.eh_proj.weight"].T

        def pre(mod, args, kwargs=None):
            return (X.reshape(1, len(ids), hc * E), *args[1:])

        return self._run(ids, 9, pre=pre, mixer=self.head)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("transformers")
    import torch
    from hf_models import tiny_qwen4exp

    from ds4tvm.families.qwen4exp.convert import convert_hf

    d = tmp_path_factory.mktemp("qwen_mtp")
    hf = tiny_qwen4exp(seed=2, num_hidden_layers=9, layer_types=_layer_types())
    hf.save_pretrained(d / "hf")
    convert_hf(d / "hf", d / "nine.gguf", dense_type="f32", progress=False)
    c = hf.config
    w = _nextn_weights(SimpleNamespace(n_embd=c.hidden_size, hc=c.hc_count, hc_rank=c.hc_lowrank), seed=5)
    cfg = _integrated(d / "nine.gguf", d / "model.gguf", w)
    hf.set_experts_implementation("eager")
    hf = hf.double()
    compile_here(d / "model.gguf", "--target", "llvm", "-o", d / "art", "--max-context", "256", "--max-batch", "2",
                 "--quiet")
    torch.manual_seed(0)
    return d / "art", d / "model.gguf", cfg, Reference(hf, w)


def _engine(model):
    from ds4tvm.runtime.engine import Engine

    return Engine(model[0])


def test_nextn_step_matches_the_reference(model):
    """The step after the prompt's rows (written by mtp_observe), the same step as one 3-row pass
    over two unwritten rows, a chained step from the layer's own streams, and the target's logits
    and streams, all within 1e-4 of the reference."""
    from ds4tvm.runtime.drafters.qwen_mtp import QwenMTPDrafter

    from hf_models import recorded_topk_gaps

    ref = model[3]
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 512, 60)]
    ids[20] = EOS
    m = len(ids) - 2
    with recorded_topk_gaps() as gaps:
        trunk_logits, streams = ref.trunk(ids)
        mtp_logits, mtp_streams = ref.mtp(ids, streams)
        chained_logits, _ = ref.mtp(ids, streams, before={m + 1: mtp_streams[m]})
    print(f"top-k gaps: router {min(gaps['router']):.2e}, indexer {min(gaps['indexer']):.2e}")
    assert min(gaps["router"]) >= 3e-5 and min(gaps["indexer"]) >= 3e-5   # float32 noise cannot flip a choice
    e = _engine(model)
    step = e.prefill(ids[:m], all_logits=True)
    assert np.abs(step.logits - trunk_logits[:m]).max() <= TOLERANCE
    assert np.abs(step.outputs["streams"] - streams[:m]).max() <= TOLERANCE
    QwenMTPDrafter(e).begin(e, step, frozenset())
    out = e.call("mtp_step", streams_prev=streams[m - 1:m].astype(np.float32), tokens=[ids[m]], start=m)
    print(f"nextn step: max |delta| {np.abs(out['logits'][0] - mtp_logits[m]).max():.3g}")
    assert np.abs(mtp_logits[m]).max() > 0.5
    assert np.abs(out["logits"][0] - mtp_logits[m]).max() <= TOLERANCE
    assert np.abs(out["streams"][0] - mtp_streams[m]).max() <= TOLERANCE
    chained = e.call("mtp_step", streams_prev=out["streams"], tokens=[ids[m + 1]], start=m + 1)
    assert np.abs(chained["logits"][0] - chained_logits[m + 1]).max() <= TOLERANCE

    e.reset()
    step = e.prefill(ids[:m])
    e.call("mtp_observe", streams_prev=np.concatenate([np.zeros_like(streams[:1]), streams[:m - 3]]).astype(np.float32),
           tokens=ids[:m - 2], start=0)
    batched = e.call("mtp_step", streams_prev=streams[m - 3:m].astype(np.float32), tokens=ids[m - 2:m + 1], start=m - 2)
    assert np.abs(batched["logits"][0] - mtp_logits[m]).max() <= TOLERANCE


class _Double:
    """The real drafter (its state writes, depth policy and counters) with its drafts replaced by
    the tokens target-only decoding emits there (`agree`), other tokens (`disagree`), or the
    right first draft and a wrong second (`first`)."""

    def __init__(self, inner, want: list[int], mode: str, vocab: int):
        self.inner, self.want, self.mode, self.vocab = inner, want, mode, vocab

    def draft(self, engine, token, max_tokens):
        out = self.inner.draft(engine, token, max_tokens)
        for i in range(len(out)):
            j = engine.pos + 1 + i - len(PROMPT)
            right = self.want[j] if j < len(self.want) else 0
            ok = self.mode == "agree" or (self.mode == "first" and i == 0)
            out[i] = right if ok else (right + 1) % self.vocab
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("depth", ["2", "3"])
def test_batched_decode_and_generations_sharing_the_engine(model, depth, monkeypatch):
    """Two sequences' decode, and a chunk beside a decode, in one call (each one's PLE rows from its own history): logits and
    MTP inputs bit for bit as alone; four generations through the scheduler, the MTP drafter at
    depth 2 or 3 in two of them, greedy and seeded, as each alone (greedy: target-only)."""
    from batching import (assert_batched_decode_is_decode, assert_batched_prefill_is_prefill,
                          assert_batched_verify_is_verify, assert_together_is_alone)

    from ds4tvm.runtime.drafters.qwen_mtp import QwenMTPDrafter

    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", depth)
    e = _engine(model)
    if depth == "2":
        assert_batched_decode_is_decode(e, [PROMPT, PROMPT[:20]])   # two sequences: the default run's time
        assert_batched_prefill_is_prefill(e, [PROMPT, PROMPT[:20]])   # two sequences: the default run's time
        assert_batched_verify_is_verify(e, [PROMPT, PROMPT[:20]], [PROMPT[5:5 + e.max_verify], PROMPT[9:10]])
    mtp = lambda: QwenMTPDrafter(e)  # noqa: E731
    calls, _ = assert_together_is_alone(e, [(PROMPT, 0, 0, mtp), (PROMPT[:30], 0, 1, None), (PROMPT[3:], 1, 2, mtp),
                                            (PROMPT[:17], 0.9, 3, None)])
    assert max(calls) > 1


@pytest.mark.parametrize("depth,mode", [("0", "agree"), ("3", "first"), pytest.param("3", "disagree", marks=pytest.mark.slow),
                                        pytest.param("2", "agree", marks=pytest.mark.slow)])
def test_doubles_leave_target_only_tokens_and_state(model, depth, mode, monkeypatch):
    """Greedy: every double emits target-only's tokens and leaves the target's state and the nextn
    layer's rows as target-only decoding with the drafter observing leaves them; the adaptive
    policy promotes an always-right drafter to depth 3 after 8 cycles."""
    from ds4tvm.runtime.drafters.qwen_mtp import QwenMTPDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", depth)
    greedy, n = SamplingParams(0.0), 40
    spec, plain, other = _engine(model), _engine(model), _engine(model)
    want, _ = generate(plain, PROMPT, n, greedy, np.random.default_rng(0))
    drafter = _Double(QwenMTPDrafter(spec), want, mode, model[2].n_vocab)
    got, stats = generate(spec, PROMPT, n, greedy, np.random.default_rng(0), drafter=drafter)
    assert got == want
    c = stats.counters
    d2, d3 = c["by_depth"]["2"], c["by_depth"]["3"]
    assert c["cost_skips"] == 0 and d2["cycles"] + d3["cycles"] == c["cycles"]
    if mode == "agree":
        assert c["accepted_draft"] == c["proposed"], c
    if depth == "0":   # 8 cycles at depth 2, then 3 (and 2 again where one token is left)
        assert d2["cycles"] in (8, 9) and d3["cycles"] > 0, c
    if depth == "2":
        assert d3["cycles"] == 0, c
    if depth == "3":   # every cycle at depth 3 but a last one with room for one draft
        assert d3["cycles"] >= c["cycles"] - 1 and d3["depth"] == {("0" if mode == "disagree" else "1"): d3["cycles"]}, c
    observer = QwenMTPDrafter(other)      # the nextn rows of the same text, written by observe alone
    observer.begin(other, other.prefill(spec.history), frozenset())
    ours = spec.call("mtp_step", streams_prev=drafter.streams[None], tokens=[5], start=spec.pos)["logits"]
    theirs = other.call("mtp_step", streams_prev=observer.streams[None], tokens=[5], start=other.pos)["logits"]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    while plain.pos < spec.pos:   # verified drafts commit past where plain decoding stopped
        plain.decode(spec.history[plain.pos])
    assert spec.history == plain.history
    np.testing.assert_array_equal(spec.decode(3).logits, plain.decode(3).logits)


def test_exact_sampling_keeps_the_law_of_plain_sampling(model):
    """T = 1 with top-k 3: the law of the two tokens after a fixed prompt under --mtp-exact-sampling,
    with drafts that the target accepts about
    half of the time, against plain sampling (a chi-square test of homogeneity over the outcomes)."""
    from scipy.stats import chi2_contingency

    from ds4tvm.runtime.drafters.qwen_mtp import QwenMTPDrafter

    table = exact_sampling_outcomes(_engine(model), QwenMTPDrafter, PROMPT[:8])
    assert table.shape[1] >= 4 and table.sum() == 1600
    assert chi2_contingency(table).pvalue > 0.01, table


def test_cli_mtp_identity_at_every_depth_timing_json_and_flag_errors(model):
    art, gguf, _, _ = model
    base = ("run", "-m", art, "-p", "The quick brown fox", "-n", "30", "--temp", "0")
    plain = run_ds4(*base)
    assert plain.returncode == 0, plain.stderr
    for depth in ("2", "3", "0"):
        env = always_drafting(DS4_QWEN4_MTP_DEPTH=depth)
        r = run_ds4(*base, "--mtp", env=env)
        assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
        assert re.search(r"ds4: Qwen3\.8 MTP stats cycles=\d+ proposed=\d+ accepted_draft=\d+ accept_rate=[\d.]+% "
                         r"avg_accept=[\d.]+ depth[23]=\d+/\d+@\d+", r.stderr), r.stderr
        assert "qwen mtp cycle" not in r.stderr
    timed = run_ds4(*base, "--mtp-timing", env=always_drafting(DS4_QWEN4_MTP_DEPTH="3"))
    assert timed.returncode == 0 and timed.stdout == plain.stdout, timed.stderr
    lines = [ln for ln in timed.stderr.splitlines() if ln.startswith("ds4: qwen mtp cycle:")]
    assert lines and all(re.fullmatch(r"ds4: qwen mtp cycle: depth [23], draft [\d.]+ ms, verify[23] [\d.]+ ms, "
                                      r"accepted \d/[12] \(drafts \d+( \d+)?\)", ln) for ln in lines), lines[:3]
    r = run_ds4(*base, "--mtp", "--json", env=always_drafting())
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["spec"]
    assert set(spec["by_depth"]) == {"2", "3"} and spec["cycles"] == sum(d["cycles"] for d in spec["by_depth"].values())
    for flags, env, says in ((("--mtp", gguf), None, "read no support file"),
                             (("--dspark",), None, "has no DSpark drafter"),
                             (("--mtp", "--mtp-draft", "4"), None, "drafts 1 or 2 tokens"),
                             (("--mtp",), {**os.environ, "DS4_QWEN4_MTP_DEPTH": "5"}, "DS4_QWEN4_MTP_DEPTH=5")):
        r = run_ds4(*base, *flags, env=env)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
