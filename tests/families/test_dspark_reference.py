"""The DSpark drafter compiled by TVM against the PyTorch reference written from
dspark-crosscheck.md §2 (ds4tvm/training/dspark_reference.py) on a random support file: the ring
rows from a prefill longer than the window and from a direct decode step, then a proposal's block
logits, the Markov head's rows and bias, and the confidences, within 1e-4 (float32 against float64;
the weights are the same dequantized values on both sides, FP8 rounding off). The reference reads
the files with gguf-py and takes the target's captured rows from transformers' DeepseekV4 (which
the artifact's own capture must equal), and its block pieces are checked against transformers'
DeepseekV4 layers on the same weights."""

import numpy as np
import pytest

from conftest import compile_here

pytestmark = pytest.mark.compile
# the DeepSeek-V4 trunk's bound against transformers (float32 sums against float64); measured 2.2e-5
# for the capture, 5.5e-6 for r and 7.7e-6 for the draft logits (of up to 3.9)
TOL = 1e-4
# transformers' HyperConnection runs its Sinkhorn projection in float32 whatever the model's dtype:
# the float64 reference meets it at float32 rounding (measured 4.2e-7 on activations of ~1)
HF_HC_TOL = 5e-6


def _quantized(spec):
    """Q8_0 projections and experts (the tiny widths are not multiples of the K-quants' 256), the
    rest as the random writer has them."""
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.deepseek4.random_model import default_type
    from ds4tvm.gguf.validate import DENSE, ROUTED

    if spec.types in (DENSE, ROUTED) and spec.shape[0] % 32 == 0:
        return QT.Q8_0
    return default_type(spec)


@pytest.fixture(scope="module", params=["q8_0", pytest.param("f16", marks=pytest.mark.slow)])
def pair(tmp_path_factory, request):
    """A random target and support file: Q8_0 projections and experts beside F16 and F32 tensors
    (the default run; the reference reads the same dequantized values, so the tolerance is that of
    f32 arithmetic), or F16 and F32 only (-m slow)."""
    from ds4tvm.families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
    from ds4tvm.families.dspark.random_model import write_random_dspark

    d = tmp_path_factory.mktemp("dspark-ref")
    cfg = tiny_config()
    model = write_random_deepseek4(d / "target.gguf", cfg, seed=31)
    support = write_random_dspark(d / "support.gguf", cfg, seed=32,
                                  type_of=_quantized if request.param != "f16" else default_type)
    compile_here(model, "--target", "llvm", "-o", d / "art", "--max-context", "512", "--max-verify", "8",
                 "--mtp", support, "--no-kv-rounding", "--quiet")
    return model, support, d / "art"


def _transformers_captures(model, ids, layers) -> np.ndarray:
    """The captured rows [n, L, D] as transformers' DeepseekV4 computes them on the same weights
    (gguf-py's dequantizer): the mean over the HC streams of each capture layer's output."""
    import torch
    from hf_models import hf_model_from_gguf

    hf, seen = hf_model_from_gguf(model), {}
    hooks = [hf.model.layers[l].register_forward_hook(lambda mod, args, out, l=l: seen.__setitem__(l, out))
             for l in layers]
    with torch.no_grad():
        hf(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return np.stack([seen[l][0].mean(dim=1).numpy() for l in layers], axis=1)


def test_tvm_drafter_matches_the_pytorch_reference(pair):
    """The reference reads both files with gguf-py (read_config) and is fed the target's captured
    rows as transformers computes them; the artifact's own captured rows are checked against
    those too, so neither side takes a graph output or ds4tvm's parser."""
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.training.dspark_reference import DSparkReference, read_config

    model, support, art = pair
    cfg = read_config(model, support)
    ref = DSparkReference(model, support, cfg)
    e = Engine(art)
    drafter = DSparkDrafter(e, theta=0.0)
    prompt = np.random.default_rng(4).integers(0, e.n_vocab, 150).tolist()   # past the 128-row ring
    step = e.prefill(prompt)
    nxt = int(np.argmax(step.logits))
    hf_rows = _transformers_captures(model, prompt + [nxt], cfg.target_layer_ids)
    assert np.abs(step.outputs["captured"] - hf_rows[:150]).max() <= TOL   # the target's capture
    drafter.begin(e, step, frozenset())
    ref.observe(hf_rows[:150], 0)
    step = e.decode(nxt)                                      # a plain decode step: the direct ring path
    assert np.abs(step.outputs["captured"] - hf_rows[150:]).max() <= TOL
    drafter.observe(e, step, [e.history[-1]])
    drafter.finish(e)                                        # the deferred direct-path row is written
    ref.observe(hf_rows[150:], e.pos - 1, direct=True)

    anchor, P, B = e.history[-1], e.pos - 1, cfg.block_size
    got_r = e.call("dspark_block", captured=drafter.anchor_row[None], tokens=[anchor] + [cfg.noise_token_id] * (B - 1),
                   start=P)["r"]
    got = e.call("dspark_logits", r=got_r)["logits"]
    want_r = ref.block(hf_rows[150], anchor, P).detach()
    want = ref.logits(want_r).detach().numpy()
    assert np.abs(got - want).max() <= TOL
    assert np.abs(got_r - want_r.numpy()).max() <= TOL
    for prev in (anchor, 0, e.n_vocab - 1, int(np.argmax(want[0]))):
        markov = e.call("dspark_markov", prev=[prev])
        m, bias = (x.detach() for x in ref.markov(prev))
        assert np.abs(markov["m"][0] - m.numpy()).max() <= TOL
        assert np.abs(markov["bias"][0] - bias.numpy()).max() <= TOL
    # the fused proposal: the Markov chain over the block's argmaxes and each row's confidence
    drafts, confidences = ref.propose(hf_rows[150], anchor, P, theta=0.0)
    out = e.call("dspark_propose", captured=drafter.anchor_row[None],
                 tokens=[anchor] + [cfg.noise_token_id] * (B - 1), start=P)
    assert out["drafts"].tolist() == drafts
    assert np.abs(out["confidence"] - confidences).max() <= TOL
    tvm_drafts, _ = drafter._propose(e, anchor, B)
    assert tvm_drafts == drafts
    # the θ cut: between the two middle confidences, away from either
    sig = sorted(1 / (1 + np.exp(-np.array(confidences))))
    drafter.theta = (sig[B // 2 - 1] + sig[B // 2]) / 2
    cut, _ = ref.propose(hf_rows[150], anchor, P, theta=drafter.theta)
    assert len(cut) < B and drafter._propose(e, anchor, B)[0] == cut


def test_reference_parameters_train_and_save_back(pair, tmp_path):
    """Every support tensor is a Parameter the proposal depends on (the router biases, which only
    select, aside), and save() writes a file that loads back to the same data (F16 and F32 exactly;
    Q8_0 re-quantized into the same blocks)."""
    import torch

    from ds4tvm.families.deepseek4.config import Config as V4Config
    from ds4tvm.families.dspark.config import Config, paired_with
    from ds4tvm.gguf import open_gguf
    from ds4tvm.training.dspark_reference import DSparkReference

    model, support, _ = pair
    target_cfg = V4Config.from_gguf(open_gguf(model))
    cfg = paired_with(Config.from_gguf(open_gguf(support)), target_cfg)
    ref = DSparkReference(open_gguf(model), open_gguf(support), cfg)
    captured = np.random.default_rng(0).standard_normal((9, len(cfg.target_layer_ids), cfg.n_embd))
    ref.observe(captured[:8], 0)
    r = ref.block(captured[8], 3, 8)
    m, bias = ref.markov(3)
    loss = torch.nn.functional.cross_entropy(ref.logits(r) + bias, torch.tensor([5] * cfg.block_size))
    loss = loss + ref.confidence(r[0], m) ** 2
    loss.backward()
    params = ref.parameters()
    assert len(params) == len(open_gguf(support).tensors)
    names = list(open_gguf(support).tensors)
    untrained = [n for n, p in zip(names, params) if p.grad is None]
    # the router bias only selects experts (no gradient reaches it; DeepSeek balances it apart)
    assert untrained == [f"mtp.{i}.exp_probs_b.bias" for i in range(cfg.n_stages)]
    assert all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    saved = open_gguf(ref.save(tmp_path / "saved.gguf"))
    src = open_gguf(support)
    assert Config.from_gguf(saved) == Config.from_gguf(src)
    for name, t in src.tensors.items():
        assert saved.tensors[name].ggml_type == t.ggml_type
        np.testing.assert_array_equal(np.asarray(saved.tensors[name].data), np.asarray(t.data), err_msg=name)


def test_batched_blocks_equal_one_proposal_at_a_time(tmp_path):
    """blocks() (training's batched form) gives each anchor the r that observe() + block() give,
    anchors near the start (a partly empty ring) and past the 128-row window alike, with ring rows
    from prefill/verify and from plain decode steps (the direct path) mixed."""
    import torch

    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4
    from ds4tvm.families.dspark.config import Config, paired_with
    from ds4tvm.families.dspark.random_model import write_random_dspark
    from ds4tvm.gguf import open_gguf
    from ds4tvm.training.dspark_reference import DSparkReference

    target_cfg = tiny_config()
    model = write_random_deepseek4(tmp_path / "target.gguf", target_cfg, seed=41)
    support = write_random_dspark(tmp_path / "support.gguf", target_cfg, seed=42, n_stages=2)
    cfg = paired_with(Config.from_gguf(open_gguf(support)), target_cfg)
    rng = np.random.default_rng(5)
    L = 150
    captured = rng.standard_normal((L, len(cfg.target_layer_ids), cfg.n_embd))
    tokens = rng.integers(0, target_cfg.n_vocab, L)
    anchors = [0, 3, 127, 128, 149]
    direct = rng.random(L) < 0.3
    ref = DSparkReference(open_gguf(model), open_gguf(support), cfg)
    with torch.no_grad():
        got = ref.blocks(captured, tokens, anchors, direct)
        for a, P in enumerate(anchors):
            ref.rings = [{} for _ in ref.stages]
            for p in range(P):
                ref.observe(captured[p:p + 1], p, direct=bool(direct[p]))
            want = ref.block(captured[P], int(tokens[P]), P)
            assert torch.abs(got[a] - want).max() <= 1e-12, P


def test_reference_block_pieces_equal_transformers_layers(pair):
    """The reference's V4 block pieces against transformers' DeepseekV4 modules holding the same
    weights (float64 both): HC-pre with attn_norm and HC-post on a target layer routed by score, the
    whole MoE sublayer (HC-pre, ffn_norm, sqrt-softplus router with its selection bias, routed and
    shared clamped SwiGLU experts, HC-post), and the HC head with the final norm, given the support
    file's last-stage head. The attention differs from the trunk's by design (the block attends over
    the ring and every block row, without a causal mask): it is checked end to end above."""
    import torch
    from hf_models import hf_model_from_gguf

    from ds4tvm.training.dspark_reference import DSparkReference, Stage, Weights, hc_post, read_config

    model, support, _ = pair
    cfg = read_config(model, support)
    hf = hf_model_from_gguf(model).double()
    hf.set_experts_implementation("eager")   # the grouped-GEMM path takes float32 only
    layer = 1   # layer 0 routes by token hash (tid2eid), which DSpark's stages do not have
    stage, hl = Stage(Weights(model).view(f"blk.{layer}."), cfg.block), hf.model.layers[layer]
    X = torch.randn(7, cfg.block.hc, cfg.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = torch.randn(7, cfg.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        post, comb, collapsed = hl.attn_hc(X[None])
        n_ref, post_ref, comb_ref = stage.attn_input(X)
        torch.testing.assert_close(n_ref, hl.input_layernorm(collapsed)[0], rtol=0, atol=HF_HC_TOL)
        hf_mixed = post[0].unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), X)
        torch.testing.assert_close(hc_post(out, X, post_ref, comb_ref), hf_mixed, rtol=0, atol=HF_HC_TOL)
        post, comb, collapsed = hl.ffn_hc(X[None])
        mlp = hl.mlp(hl.post_attention_layernorm(collapsed), input_ids=torch.zeros(1, 7, dtype=torch.long))
        want = post[0].unsqueeze(-1) * mlp[0].unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), X)
        torch.testing.assert_close(stage.moe(X), want, rtol=0, atol=HF_HC_TOL)
        ref = DSparkReference(model, support, cfg)
        last = f"mtp.{cfg.n_stages - 1}."
        for mine, theirs in (("hc_head_fn.weight", hf.model.hc_head.hc_fn), ("hc_head_base.weight", hf.model.hc_head.hc_base),
                             ("hc_head_scale.weight", hf.model.hc_head.hc_scale), ("norm.weight", hf.model.norm.weight)):
            theirs.copy_(ref.w(last + mine).reshape(theirs.shape))
        torch.testing.assert_close(ref.head(X), hf.model.norm(hf.model.hc_head(X[None]))[0], rtol=0, atol=HF_HC_TOL)
