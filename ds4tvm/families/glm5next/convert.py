"""`ds4 convert` for transformers' `Glm5NextForConditionalGeneration` checkpoints: the text model
to a GGUF in ds4's layout (or llama.cpp's), with the MTP layer when the checkpoint has one
(transformers itself drops layer N on load, so its own saves have none).

Checkpoints store [out, in] (ggml order reversed) under `model.language_model.` (or `model.`).
Besides renames: per-expert weights are stacked, `kv_b_proj` [H * (nope + v), kv_lora] splits into
`attn_k_b` (ggml {nope, kv_lora, H}) and `attn_v_b` ({kv_lora, v, H}), the q/k/v conv weights lose
their singleton axis, and llama.cpp's layout stores -exp(A_log) (tensors.in_layout)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ...errors import Ds4Error
from ...gguf.convert import TextCheckpoint, choose_type, read_hf_checkpoint
from ...gguf.quant import quantize
from ...gguf.safetensors_io import SafetensorsDir
from ...gguf.vocab import hf_vocab, synthetic_vocab
from ...gguf.writer import TensorOut, write_gguf
from .config import ARCH, DS4, DSA, KDA, LAYOUTS, Config, mtp_input_of
from .tensors import canonical_pairs, in_layout

_ATTN = {"linear_attention": KDA, "indexed_attention": DSA, "full_attention": DSA}
_RENAMES = {   # canonical suffix -> checkpoint suffix (after layers.N.)
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{s}_{p}.weight": f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")},
    **{f"kda_{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"},
    "kda_f_a.weight": "self_attn.f_a_proj.weight", "kda_f_b.weight": "self_attn.f_b_proj.weight",
    "kda_dt_bias.weight": "self_attn.dt_bias", "kda_a_log.weight": "self_attn.A_log",
    "kda_beta.weight": "self_attn.b_proj.weight", "kda_g_a.weight": "self_attn.g_a_proj.weight",
    "kda_g_b.weight": "self_attn.g_b_proj.weight", "kda_o_norm.weight": "self_attn.o_norm.weight",
    "kda_output.weight": "self_attn.o_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight", "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight", "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer.pool_ape.weight": "self_attn.indexer.index_kpool_compress_ape",
    "indexer.pool_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
    "nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}


def config_from_hf(hf: dict, where: str, layout: str = DS4, n_nextn: int = 0) -> Config:
    t = hf.get("text_config") or hf

    def need(key):
        if key not in t:
            raise Ds4Error(f"{where}: missing field {key}")
        return t[key]

    n = need("num_hidden_layers")
    kinds = t.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if len(kinds) != n or any(k not in _ATTN for k in kinds):
        raise Ds4Error(f"{where}: layer_types must hold {n} of {', '.join(_ATTN)}; got {kinds}")
    mlp = t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    dense = next((i for i, m in enumerate(mlp) if m != "dense"), len(mlp))
    if "dense" in mlp[dense:]:
        raise Ds4Error(f"{where}: mlp_layer_types must put every dense layer first")
    if t.get("qk_rope_head_dim", 0) or t.get("n_group", 1) > 1:
        raise Ds4Error(f"{where}: GLM-5.3 has no RoPE in MLA (qk_rope_head_dim 0) and ungrouped routing (n_group 1)")
    limit = float(t.get("swiglu_limit", 10.0))
    n_all = n + n_nextn
    return Config(
        layout=layout, n_layers=n, n_nextn=n_nextn, n_embd=need("hidden_size"), n_vocab=need("vocab_size"),
        n_ff=t.get("intermediate_size", 0), n_ff_exp=need("moe_intermediate_size"),
        n_expert=need("n_routed_experts"), n_expert_used=need("num_experts_per_tok"),
        n_expert_shared=t.get("n_shared_experts", 1), n_dense_lead=dense,
        expert_weights_scale=float(t.get("routed_scaling_factor", 1.0)),
        expert_weights_norm=bool(t.get("norm_topk_prob", True)), rms_eps=float(t.get("rms_norm_eps", 1e-5)),
        n_head=need("num_attention_heads"), key_length=need("qk_nope_head_dim"), value_length=need("v_head_dim"),
        q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"), idx_n_head=need("index_n_heads"),
        idx_head_dim=need("index_head_dim"), idx_top_k=need("index_topk"), idx_pool=t.get("index_kpool", 16),
        kda_n_head=t.get("linear_num_heads", need("num_attention_heads")), kda_head_dim=need("linear_head_dim"),
        conv_kernel=t.get("linear_conv_kernel_dim", 4), gate_lower_bound=t.get("linear_lower_bound"),
        layer_types=tuple(_ATTN[k] for k in kinds) + (DSA,) * n_nextn,
        swiglu_exp=(limit,) * n_all, swiglu_shexp=(limit,) * n_all, hc=t.get("hc_mult", 4),
        hc_sinkhorn_iters=t.get("hc_sinkhorn_iters", 20), hc_eps=float(t.get("hc_eps", 1e-6)),
        idx_select_tail=bool(t.get("index_kpool_always_select_tail", True)),
        idx_full=tuple((t.get("indexer_types") or ["full"] * n)[i] == "full" for i in range(n)),
        context_length=t.get("max_position_embeddings", 1048576))


class Checkpoint(TextCheckpoint):
    """Canonical GGUF names -> checkpoint arrays in ds4's layout (numpy order)."""

    def __init__(self, st: SafetensorsDir, cfg: Config, where: str):
        super().__init__(st, where)
        self.cfg = cfg

    def get(self, name: str) -> np.ndarray:
        r, H = self.root, self.cfg.n_head
        if name == "token_embd.weight":
            return self.raw(r + "embed_tokens.weight")
        if name == "output_norm.weight":
            return self.raw(r + "norm.weight")
        if name == "output.weight":
            return self.raw("lm_head.weight" if "lm_head.weight" in self.st else r + "embed_tokens.weight")
        _, layer, suffix = name.split(".", 2)
        p = f"{r}layers.{layer}."
        if suffix.endswith("_conv.weight"):            # [I, 1, K] -> [I, K]
            w = self.raw(p + f"self_attn.{suffix[4]}_conv1d.weight")
            return w.reshape(w.shape[0], w.shape[-1])
        if suffix == "kda_a_log.weight":
            return self.raw(p + "self_attn.A_log").reshape(-1)
        if suffix in ("attn_k_b.weight", "attn_v_b.weight"):
            c = self.cfg
            kv_b = self.raw(p + "self_attn.kv_b_proj.weight").reshape(H, c.key_length + c.value_length, c.kv_lora_rank)
            k, v = kv_b[:, :c.key_length], kv_b[:, c.key_length:]
            return np.ascontiguousarray(k.transpose(0, 2, 1) if suffix == "attn_k_b.weight" else v)
        if suffix.endswith("_exps.weight"):
            part = suffix.split("_")[1]
            return np.stack([self.raw(p + f"mlp.experts.{j}.{part}_proj.weight") for j in range(self.cfg.n_expert)])
        return self.raw(p + _RENAMES[suffix])


def convert_hf(hf_dir: Path, out: Path, dense_type: str = "f16", experts_type: str | None = None,
               progress: bool = True, layout: str = DS4) -> Path:
    hf_dir, cfg_path = Path(hf_dir), Path(hf_dir) / "config.json"
    if layout not in LAYOUTS:
        raise Ds4Error(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    hf, dense, experts = read_hf_checkpoint(hf_dir, out, dense_type, experts_type)
    st = SafetensorsDir(hf_dir)
    n = (hf.get("text_config") or hf).get("num_hidden_layers", 0)
    eh_proj = next((k for k in st.names() if k.endswith(f"layers.{n}.eh_proj.weight")), None)
    cfg = config_from_hf(hf, str(cfg_path), layout, n_nextn=int(eh_proj is not None))
    if eh_proj is not None:
        cfg = replace(cfg, mtp_input=mtp_input_of(st.shape(eh_proj)[-1], cfg.n_embd, cfg.hc))
    cfg.validate(str(cfg_path))
    ckpt = Checkpoint(st, replace(cfg, layout=DS4), str(hf_dir))
    tensors = []
    for canonical, spec, suffix in canonical_pairs(cfg):
        qtype = choose_type(spec, dense, experts)

        def produce(name=canonical.name, suffix=suffix, want=tuple(reversed(canonical.shape)), qtype=qtype):
            x = ckpt.get(name)
            if x.shape != want:
                raise Ds4Error(f"{hf_dir}: the checkpoint's tensor for {name} has shape {list(x.shape)}, "
                               f"expected {list(want)}")
            return quantize(in_layout(cfg, suffix, np.asarray(x, np.float32)), qtype)

        tensors.append(TensorOut(spec.name, qtype, tuple(reversed(spec.shape)), produce))
    meta = {"general.architecture": ARCH, "general.name": hf_dir.name, **cfg.to_metadata()}
    meta.update(hf_vocab(hf_dir, cfg.n_vocab, pre="glm4") or synthetic_vocab(cfg.n_vocab))
    return write_gguf(Path(out), ARCH, meta, tensors, progress=progress, description="converting")
