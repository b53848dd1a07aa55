"""Tiny random transformers checkpoints of the real architectures, for conversion and oracle tests.

Every parameter is randomised, 1-D ones and tid2eid included: at their initial values (zeros,
ones) index-order mistakes in sinks, HC base/scale, position biases or routing bias stay hidden.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

TINY_V4 = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, head_dim=64, q_lora_rank=32, partial_rotary_factor=16 / 64,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, o_groups=2, o_lora_rank=32,
    index_n_heads=16, index_head_dim=64, index_topk=8, sliding_window=16,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
    rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
)


def write_tiny_deepseek_v4(out_dir: Path, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**TINY_V4, **overrides})
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = _randomise(model, seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                n_tok, k = b.shape
                ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(n_tok)])
                b.copy_(ids)
    model.save_pretrained(out_dir)
    return Path(out_dir)


# GGUF name -> transformers' in-memory parameter (its own module names, independent of the
# on-disk names the converter reads). {L} is the layer.
HF_PARAMS = {
    "token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight", "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base", "output_hc_scale.weight": "model.hc_head.hc_scale",
    "blk.{L}.hc_attn_fn.weight": "model.layers.{L}.attn_hc.fn", "blk.{L}.hc_attn_base.weight": "model.layers.{L}.attn_hc.base",
    "blk.{L}.hc_attn_scale.weight": "model.layers.{L}.attn_hc.scale", "blk.{L}.hc_ffn_fn.weight": "model.layers.{L}.ffn_hc.fn",
    "blk.{L}.hc_ffn_base.weight": "model.layers.{L}.ffn_hc.base", "blk.{L}.hc_ffn_scale.weight": "model.layers.{L}.ffn_hc.scale",
    "blk.{L}.attn_norm.weight": "model.layers.{L}.input_layernorm.weight",
    "blk.{L}.ffn_norm.weight": "model.layers.{L}.post_attention_layernorm.weight",
    "blk.{L}.attn_q_a.weight": "model.layers.{L}.self_attn.q_a_proj.weight",
    "blk.{L}.attn_q_a_norm.weight": "model.layers.{L}.self_attn.q_a_norm.weight",
    "blk.{L}.attn_q_b.weight": "model.layers.{L}.self_attn.q_b_proj.weight",
    "blk.{L}.attn_kv.weight": "model.layers.{L}.self_attn.kv_proj.weight",
    "blk.{L}.attn_kv_a_norm.weight": "model.layers.{L}.self_attn.kv_norm.weight",
    "blk.{L}.attn_sinks.weight": "model.layers.{L}.self_attn.sinks",
    "blk.{L}.attn_output_a.weight": "model.layers.{L}.self_attn.o_a_proj.weight",
    "blk.{L}.attn_output_b.weight": "model.layers.{L}.self_attn.o_b_proj.weight",
    "blk.{L}.attn_compressor_ape.weight": "model.layers.{L}.self_attn.compressor.position_bias",
    "blk.{L}.attn_compressor_kv.weight": "model.layers.{L}.self_attn.compressor.kv_proj.weight",
    "blk.{L}.attn_compressor_gate.weight": "model.layers.{L}.self_attn.compressor.gate_proj.weight",
    "blk.{L}.attn_compressor_norm.weight": "model.layers.{L}.self_attn.compressor.kv_norm.weight",
    "blk.{L}.indexer.attn_q_b.weight": "model.layers.{L}.self_attn.compressor.indexer.q_b_proj.weight",
    "blk.{L}.indexer.proj.weight": "model.layers.{L}.self_attn.compressor.indexer.scorer.weights_proj.weight",
    "blk.{L}.indexer_compressor_ape.weight": "model.layers.{L}.self_attn.compressor.indexer.position_bias",
    "blk.{L}.indexer_compressor_kv.weight": "model.layers.{L}.self_attn.compressor.indexer.kv_proj.weight",
    "blk.{L}.indexer_compressor_gate.weight": "model.layers.{L}.self_attn.compressor.indexer.gate_proj.weight",
    "blk.{L}.indexer_compressor_norm.weight": "model.layers.{L}.self_attn.compressor.indexer.kv_norm.weight",
    "blk.{L}.ffn_gate_inp.weight": "model.layers.{L}.mlp.gate.weight",
    "blk.{L}.exp_probs_b.bias": "model.layers.{L}.mlp.gate.e_score_correction_bias",
    "blk.{L}.ffn_gate_tid2eid.weight": "model.layers.{L}.mlp.gate.tid2eid",
    "blk.{L}.ffn_gate_shexp.weight": "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
    "blk.{L}.ffn_up_shexp.weight": "model.layers.{L}.mlp.shared_experts.up_proj.weight",
    "blk.{L}.ffn_down_shexp.weight": "model.layers.{L}.mlp.shared_experts.down_proj.weight",
    "blk.{L}.ffn_down_exps.weight": "model.layers.{L}.mlp.experts.down_proj",
}


def hf_tensor(state, name, n_ff):
    if name.startswith("blk."):
        layer, rest = name.split(".", 2)[1:]
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"].numpy()
            return gate_up[:, :n_ff] if rest.startswith("ffn_gate") else gate_up[:, n_ff:]
        return state[HF_PARAMS["blk.{L}." + rest].format(L=layer)].numpy()
    return state[HF_PARAMS[name]].numpy()




def hf_config_from_gguf(reader, **extra):
    """The transformers config of a deepseek4 GGUF (for GGUFs written without HF), from its keys as
    gguf-py reads them: the file format, not ds4tvm's parser."""
    from transformers import DeepseekV4Config

    def key(name, default=None):
        field = reader.fields.get(f"deepseek4.{name}")
        return default if field is None else field.contents()

    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    n, head_dim, n_hash = key("block_count"), key("attention.key_length"), key("hash_layer_count")
    vocab = key("vocab_size") or next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    return DeepseekV4Config(**{**dict(
        vocab_size=vocab, hidden_size=key("embedding_length"), moe_intermediate_size=key("expert_feed_forward_length"),
        num_hidden_layers=n, num_attention_heads=key("attention.head_count"), head_dim=head_dim,
        q_lora_rank=key("attention.q_lora_rank"), partial_rotary_factor=key("rope.dimension_count") / head_dim,
        n_routed_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        n_shared_experts=key("expert_shared_count"), o_groups=key("attention.output_group_count"),
        o_lora_rank=key("attention.output_lora_rank"), index_n_heads=key("attention.indexer.head_count"),
        index_head_dim=key("attention.indexer.key_length"), index_topk=key("attention.indexer.top_k"),
        sliding_window=key("attention.sliding_window"),
        layer_types=[kinds[r] for r in key("attention.compress_ratios")],
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (n - n_hash),
        rope_theta=key("rope.freq_base"), compress_rope_theta=key("attention.compress_rope_freq_base"),
        rope_parameters={"rope_type": "yarn", "factor": key("rope.scaling.factor"),
                         "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                         "beta_fast": key("rope.scaling.yarn_beta_fast"), "beta_slow": key("rope.scaling.yarn_beta_slow")},
        routed_scaling_factor=key("expert_weights_scale"), rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        hc_eps=key("hyper_connection.epsilon"), swiglu_limit=key("swiglu_clamp_exp")[0]), **extra})


def gguf_values(reader) -> dict:
    """Every tensor of a GGUF by name, dequantized by gguf-py (integer tables as they are)."""
    import numpy as np
    from gguf import quants

    return {t.name: np.asarray(t.data) if t.tensor_type.name in ("I32",) else
            quants.dequantize(np.asarray(t.data), t.tensor_type) for t in reader.tensors}


def hf_load(model, values: dict) -> None:
    """Copy GGUF tensors (canonical names, numpy order) into a DeepseekV4ForCausalLM: through
    HF_PARAMS, the routed experts' gate and up joined as transformers holds them."""
    import numpy as np
    import torch

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, v in values.items():
            layer, rest = (name.split(".", 2)[1:] if name.startswith("blk.") else (None, name))
            if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
                continue
            key = (HF_PARAMS["blk.{L}." + rest].format(L=layer) if layer is not None else HF_PARAMS[name])
            state[key].copy_(torch.from_numpy(np.array(v)).to(state[key].dtype))
        for il in range(model.config.num_hidden_layers):
            gate, up = values[f"blk.{il}.ffn_gate_exps.weight"], values[f"blk.{il}.ffn_up_exps.weight"]
            state[f"model.layers.{il}.mlp.experts.gate_up_proj"].copy_(torch.from_numpy(np.concatenate([gate, up], 1)))


def hf_model_from_gguf(path):
    """A transformers DeepseekV4ForCausalLM holding the GGUF's weights, its config and weights read
    (and dequantized) with gguf-py."""
    from gguf import GGUFReader
    from transformers import DeepseekV4ForCausalLM

    reader = GGUFReader(path)
    model = DeepseekV4ForCausalLM(hf_config_from_gguf(reader)).eval()
    hf_load(model, gguf_values(reader))
    return model


TINY_GLM5 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    kv_lora_rank=64, q_lora_rank=48, qk_rope_head_dim=0, v_head_dim=32, qk_nope_head_dim=32, index_topk=16,
    index_head_dim=32, index_n_heads=16, index_kpool=4, routed_scaling_factor=2.5,
    layer_types=["linear_attention", "linear_attention", "indexed_attention"] * 2,
    mlp_layer_types=["dense"] + ["sparse"] * 5, swiglu_limit=1.5, linear_head_dim=16, linear_num_heads=4,
    linear_conv_kernel_dim=4, linear_lower_bound=-5.0, pad_token_id=None, max_position_embeddings=4096,
)
TINY_GLM5_VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, projection_intermediate_size=64,
                        intermediate_size=64)


def tiny_glm5_next(seed: int = 0, **overrides):
    """A random `Glm5NextForConditionalGeneration` (a one-block vision tower beside the text model),
    every text parameter and the router bias randomised."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config={**TINY_GLM5, **overrides}, vision_config=TINY_GLM5_VISION)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    _randomise(model, seed + 1, skip="visual")
    return model


def _randomise(model, seed: int, skip: str | None = None):
    """Norm weights 1 + 0.1 N, other 1-D parameters and the router bias 0.5 N, matrices N / sqrt(in);
    parameters whose name holds `skip` keep their values. Returns the generator, for more."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if skip is not None and skip in name:
                continue
            if p.ndim == 1 and "norm" in name and not name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    return g


def glm5_parameter(params: dict, name: str, cfg):
    """What the GGUF tensor `name` (ds4's canonical name) must hold, in numpy order, from
    transformers' parameters (arrays by state-dict name): a view where the parameter is fused or
    reshaped, so writing into it writes the parameter."""
    P = "model.language_model."
    top = {"token_embd.weight": P + "embed_tokens.weight", "output_norm.weight": P + "norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return params[top[name]]
    _, L, s = name.split(".", 2)
    p = f"{P}layers.{L}."
    if s.startswith("nextn."):
        return params[p + {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
                           "nextn.hnorm.weight": "hnorm.weight",
                           "nextn.shared_head_norm.weight": "shared_head.norm.weight"}[s]]
    a, inner = p + "self_attn.", cfg.kda_n_head * cfg.kda_head_dim
    if s.startswith("hc_"):
        part, kind = s[3:].split(".")[0].split("_")
        return params[f"{p}{part}_hc.{kind}"]
    if s.endswith("_conv.weight"):          # one fused depthwise conv [3I, 1, K], q then k then v
        i = "qkv".index(s[4])
        return params[a + "conv1d.weight"][i * inner:(i + 1) * inner, 0, :]
    if s in ("attn_k_b.weight", "attn_v_b.weight"):
        kv_b = params[a + "kv_b_proj.weight"].reshape(cfg.n_head, cfg.key_length + cfg.value_length, -1)
        return kv_b[:, :cfg.key_length].transpose(0, 2, 1) if s == "attn_k_b.weight" else kv_b[:, cfg.key_length:]
    if s in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):   # gate_up_proj [X, 2 Fe, E], gate first
        gu = params[p + "mlp.experts.gate_up_proj"]
        return gu[:, :cfg.n_ff_exp] if s == "ffn_gate_exps.weight" else gu[:, cfg.n_ff_exp:]
    simple = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
              "kda_q.weight": "self_attn.q_proj.weight", "kda_k.weight": "self_attn.k_proj.weight",
              "kda_v.weight": "self_attn.v_proj.weight", "kda_f_a.weight": "self_attn.forget_gate.f_a_proj.weight",
              "kda_f_b.weight": "self_attn.forget_gate.f_b_proj.weight",
              "kda_dt_bias.weight": "self_attn.forget_gate.dt_bias", "kda_a_log.weight": "self_attn.forget_gate.A_log",
              "kda_beta.weight": "self_attn.b_proj.weight", "kda_g_a.weight": "self_attn.g_a_proj.weight",
              "kda_g_b.weight": "self_attn.g_b_proj.weight", "kda_o_norm.weight": "self_attn.o_norm.weight",
              "kda_output.weight": "self_attn.o_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
              "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
              "attn_q_b.weight": "self_attn.q_b_proj.weight",
              "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
              "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
              "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
              "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
              "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
              "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
              "indexer.pool_ape.weight": "self_attn.indexer.index_kpool_compress_ape",
              "indexer.pool_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
              "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
              "exp_probs_b.bias": "mlp.gate.e_score_correction_bias", "ffn_down_exps.weight": "mlp.experts.down_proj",
              "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
              "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
              "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}
    return params[p + simple[s]]


def glm5_decision_margins(model, ids) -> tuple[float, float]:
    """The smallest gaps, over every token of ids, between the last chosen and the first refused
    candidate of transformers' Glm5Next routers (biased sigmoid scores) and indexers (pool scores,
    where there are more complete pools than it keeps): a fair oracle needs them above the
    float32 noise of both implementations."""
    import torch
    from transformers.models.glm5_next import modeling_glm5_next as glm

    gaps = {"router": [], "indexer": []}

    def gap(values: torch.Tensor, k: int) -> torch.Tensor:
        """Exact ties at zero (pools every head's ReLU scores 0, in any implementation) are decided
        by the tie rule, not by rounding: they do not count."""
        top = torch.topk(values.double(), k + 1, dim=-1).values
        g = top[..., k - 1] - top[..., k]
        return torch.where((g == 0) & (top[..., k] == 0), torch.inf, g)

    def router_hook(mod, args):
        x = args[0].reshape(-1, mod.hidden_dim).double()
        scores = torch.sigmoid(x @ mod.weight.double().T) + mod.e_score_correction_bias.double()
        gaps["router"].append(gap(scores, mod.top_k).min().item())

    real_topk = torch.Tensor.topk

    def recording_topk(self, k, *a, **kw):
        live = self > torch.finfo(self.dtype).min / 2
        rows = live.sum(-1) > k
        if rows.any():
            gaps["indexer"].append(gap(self[rows], k).min().item())
        return real_topk(self, k, *a, **kw)

    def indexer_pre(mod, args, kwargs):
        torch.Tensor.topk = recording_topk

    def indexer_post(mod, args, kwargs, out):
        torch.Tensor.topk = real_topk

    handles = []
    for m in model.modules():
        if isinstance(m, glm.Glm5NextTextTopkRouter):
            handles.append(m.register_forward_pre_hook(router_hook))
        elif isinstance(m, glm.Glm5NextTextIndexer):
            handles.append(m.register_forward_pre_hook(indexer_pre, with_kwargs=True))
            handles.append(m.register_forward_hook(indexer_post, with_kwargs=True))
    try:
        with torch.no_grad():
            model(torch.tensor(ids[None]))
    finally:
        torch.Tensor.topk = real_topk
        for h in handles:
            h.remove()
    return min(gaps["router"]), min(gaps["indexer"], default=float("inf"))


# Qwen3.8 (`Qwen4ExpForCausalLM`) made fair (../shared/reference/oracles.md): sigmoid GDN output gate,
# ple_embed_dim == hidden_size, PLE on layer 2 (1-based, a GDN layer), key and value head widths equal
# with twice the value heads, 8 layers (two QSA layers), 8 indexer heads, ratio 4
TINY_QWEN4 = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts_per_tok=2,
    num_experts=8, hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, ple_conv_kernel_size=4, ngram_size=3,
    heads_per_ngram=4, ngram_vocab_size_base=61, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
    indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=4,
    output_gate_type="sigmoid", eos_token_id=7, max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [4, 2, 2], "mrope_interleaved": True})


def tiny_qwen4exp(seed: int = 0, **overrides):
    """A random `Qwen4ExpForCausalLM`, every parameter randomised (transformers' init zeroes the
    (1 + w) gammas and the PLE conv, which would hide those paths)."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**TINY_QWEN4, **overrides})).eval()
    _randomise(model, seed + 1)
    return model


@contextlib.contextmanager
def recorded_topk_gaps():
    """Within it, the smallest gap between the k-th and (k+1)-th value of every top-k transformers
    takes: {"router": [...] (torch.topk), "indexer": [...] (Tensor.topk, QSA blocks)}, inf where no
    choice was made. A float32 engine's choices can differ only below such a gap."""
    import torch

    gaps = {"router": [float("inf")], "indexer": [float("inf")]}
    real_fn, real_method = torch.topk, torch.Tensor.topk

    def gap(values, k, dim, key):
        v = values.detach().double().movedim(dim, -1)
        if v.shape[-1] > k:
            s = v.sort(dim=-1, descending=True).values
            gaps[key].append(float((s[..., k - 1] - s[..., k]).min()))

    def fn(values, k, dim=-1, *a, **kw):
        gap(values, k, dim, "router")
        return real_fn(values, k, dim, *a, **kw)

    def method(self, k, dim=-1, *a, **kw):
        gap(self, k, dim, "indexer")
        return real_method(self, k, dim, *a, **kw)

    torch.topk, torch.Tensor.topk = fn, method
    try:
        yield gaps
    finally:
        torch.topk, torch.Tensor.topk = real_fn, real_method


def topk_margins(model, ids) -> tuple[float, float]:
    """The smallest top-k gaps (recorded_topk_gaps) of a forward over ids: (router, indexer)."""
    import torch

    with recorded_topk_gaps() as gaps, torch.no_grad():
        model(torch.tensor(ids[None]), use_cache=False)
    return min(gaps["router"]), min(gaps["indexer"])


def hf_sampling_probs(logits, p):
    """The distribution ds4's sampling parameters p (top-k, top-p, min-p at temperature 1, then the
    temperature) give logits, by transformers' warpers in float64: an implementation of the filters
    independent of ds4tvm's."""
    import torch
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    chain = []
    if p.top_k:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        chain.append(MinPLogitsWarper(p.min_p))
    chain.append(TemperatureLogitsWarper(p.temperature))
    scores = torch.tensor(logits, dtype=torch.float64)[None]
    for warper in chain:
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()
