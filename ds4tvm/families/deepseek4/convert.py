"""`ds4 convert` for DeepSeek-V4: transformers `DeepseekV4ForCausalLM` checkpoint -> GGUF in the
DS4 engine layout.

Checkpoints (DeepSeek's release, and transformers' `save_pretrained`, which writes the same
names) store every weight as [out, in] (ggml order reversed) with interleaved partial RoPE and the
original channel orders, so conversion is a rename plus a type choice; routed experts stored one
by one are stacked, and tid2eid is narrowed to int32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...errors import Ds4Error
from ...gguf.convert import choose_type, read_hf_checkpoint
from ...gguf.quant import quantize
from ...gguf.safetensors_io import SafetensorsDir
from ...gguf.vocab import hf_vocab, synthetic_vocab
from ...gguf.writer import TensorOut, write_gguf
from .config import Config
from .tensors import tensor_specs

_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def config_from_hf(hf: dict, where: str) -> Config:
    def need(key):
        if key not in hf:
            raise Ds4Error(f"{where}: missing field {key}")
        return hf[key]

    if hf.get("model_type") != "deepseek_v4":
        raise Ds4Error(f"{where}: model_type is {hf.get('model_type')!r}, expected 'deepseek_v4' "
                       f"(DeepseekV4ForCausalLM)")
    if hf.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise Ds4Error(f"{where}: scoring_func {hf['scoring_func']!r} is not supported (sqrtsoftplus)")
    n = need("num_hidden_layers")
    rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
             **(hf.get("compress_rates") or {})}
    layer_types = need("layer_types")
    if len(layer_types) != n:
        raise Ds4Error(f"{where}: layer_types has {len(layer_types)} entries for {n} layers")
    ratios = [0 if t == "sliding_attention" else rates.get(t, -1) for t in layer_types]
    if any(r not in (0, 4, 128) for r in ratios):
        raise Ds4Error(f"{where}: layer_types gives compress ratios {ratios}; expected 0, 4 or 128")
    mlp_types = hf.get("mlp_layer_types") or ["moe"] * n
    n_hash = next((i for i, t in enumerate(mlp_types) if t != "hash_moe"), len(mlp_types))
    if any(t == "hash_moe" for t in mlp_types[n_hash:]):
        raise Ds4Error(f"{where}: mlp_layer_types must put every hash_moe layer first")
    head_dim = need("head_dim")
    rp = hf.get("rope_parameters") or {}
    main = rp.get("main", {})
    comp = rp.get("compress", rp)
    yarn = comp.get("rope_type") == "yarn"
    # transformers only forces attention_factor 1.0 on a flat rope config; a nested one without it
    # gets YaRN's 1+0.1·ln(factor) magnitude, which DeepSeek-V4 cancels.
    if yarn and comp.get("attention_factor", None if "compress" in rp else 1.0) != 1.0:
        raise Ds4Error(f"{where}: rope_parameters.compress.attention_factor must be 1.0 for "
                       f"DeepSeek-V4 (YaRN magnitude cancelled), got {comp.get('attention_factor')}")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise Ds4Error(f"{where}: {key} is {hf[key]!r}; DeepSeek-V4 has {want!r}")
    factor = float(comp.get("factor", 1.0)) if yarn else 1.0
    return Config(
        n_layers=n, n_embd=need("hidden_size"), n_vocab=need("vocab_size"),
        n_head=need("num_attention_heads"), head_dim=head_dim,
        n_rot=int(head_dim * float(hf.get("partial_rotary_factor") or 64 / 512)),
        q_lora_rank=need("q_lora_rank"), o_lora_rank=need("o_lora_rank"), o_groups=need("o_groups"),
        n_expert=need("n_routed_experts"), n_expert_used=need("num_experts_per_tok"),
        n_ff_exp=need("moe_intermediate_size"), n_expert_shared=hf.get("n_shared_experts", 1),
        n_hash_layers=n_hash, sliding_window=need("sliding_window"),
        idx_n_head=need("index_n_heads"), idx_head_dim=need("index_head_dim"), idx_top_k=need("index_topk"),
        hc=hf.get("hc_mult", 4), hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20), hc_eps=hf.get("hc_eps", 1e-6),
        rope_base=float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
        compress_rope_base=float(comp.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
        yarn_factor=factor, yarn_beta_fast=float(comp.get("beta_fast", 32.0)),
        yarn_beta_slow=float(comp.get("beta_slow", 1.0)),
        yarn_orig_ctx=int(comp.get("original_max_position_embeddings", hf.get("max_position_embeddings", 65536))),
        expert_weights_scale=float(hf.get("routed_scaling_factor", 1.5)),
        expert_weights_norm=bool(hf.get("norm_topk_prob", True)), rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        compress_ratios=tuple(ratios), swiglu_clamp=(float(hf.get("swiglu_limit", 10.0)),) * n,
        context_length=int(hf.get("max_position_embeddings", 1048576)))


# GGUF tensor -> checkpoint tensor, in the original DeepSeek naming that checkpoints (and
# transformers' save_pretrained) use on disk; names are matched without a leading "model.".
_TOP = {"token_embd.weight": "embed.weight", "output.weight": "head.weight",
        "output_norm.weight": "norm.weight", "output_hc_fn.weight": "hc_head_fn",
        "output_hc_base.weight": "hc_head_base", "output_hc_scale.weight": "hc_head_scale"}
_BLOCK = {
    "hc_attn_fn.weight": "hc_attn_fn", "hc_attn_base.weight": "hc_attn_base",
    "hc_attn_scale.weight": "hc_attn_scale", "hc_ffn_fn.weight": "hc_ffn_fn",
    "hc_ffn_base.weight": "hc_ffn_base", "hc_ffn_scale.weight": "hc_ffn_scale",
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q_a.weight": "attn.wq_a.weight", "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight", "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.norm.weight", "attn_sinks.weight": "attn.attn_sink",
    "attn_output_a.weight": "attn.wo_a.weight", "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape", "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight", "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight", "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight", "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
}
# transformers' spelling of the top-level names (its save keeps them under "model.")
_ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_EXPERT_W = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}


class Checkpoint:
    """Tensors of a DeepSeek-V4 checkpoint directory, by GGUF name."""

    def __init__(self, st: SafetensorsDir, n_expert: int, tie_embeddings: bool = False):
        self.st, self.n_expert = st, n_expert
        self.names = {}
        for n in st.names():
            short = n[len("model."):] if n.startswith("model.") else n
            short = _ALIASES.get(short, short)
            if short.endswith(".attn.kv_norm.weight"):  # DeepSeek's release; transformers saves attn.norm
                short = short[: -len("kv_norm.weight")] + "norm.weight"
            self.names[short] = n
        if tie_embeddings and "head.weight" not in self.names and "embed.weight" in self.names:
            self.names["head.weight"] = self.names["embed.weight"]

    def _src(self, gguf_name: str) -> str | list[str] | None:
        if gguf_name in _TOP:
            return _TOP[gguf_name]
        _, il, rest = gguf_name.split(".", 2)
        if rest in _EXPERT_W:
            return [f"layers.{il}.ffn.experts.{e}.{_EXPERT_W[rest]}.weight" for e in range(self.n_expert)]
        return f"layers.{il}.{_BLOCK[rest]}"

    def has(self, gguf_name: str) -> bool:
        src = self._src(gguf_name)
        return all(s in self.names for s in (src if isinstance(src, list) else [src]))

    def describe(self, gguf_name: str) -> str:
        src = self._src(gguf_name)
        return src[0].replace(".0.", ".*.", 1) if isinstance(src, list) else src

    def shape(self, gguf_name: str) -> tuple[int, ...]:
        src = self._src(gguf_name)
        if isinstance(src, list):
            return (len(src), *self.st.shape(self.names[src[0]]))
        return self.st.shape(self.names[src])

    def get(self, gguf_name: str) -> np.ndarray:
        src = self._src(gguf_name)
        if isinstance(src, list):  # experts are stored one by one: stack to [n_expert, out, in]
            return np.stack([self.st.get(self.names[s]) for s in src])
        return self.st.get(self.names[src])



def convert_hf(hf_dir: Path, out: Path, dense_type: str = "f16", experts_type: str | None = None,
               progress: bool = True) -> Path:
    hf_dir = Path(hf_dir)
    hf, dense, experts = read_hf_checkpoint(hf_dir, out, dense_type, experts_type)
    cfg = config_from_hf(hf, str(hf_dir / "config.json"))
    cfg.validate()
    ckpt = Checkpoint(SafetensorsDir(hf_dir), cfg.n_expert, bool(hf.get("tie_word_embeddings")))

    tensors = []
    for spec in tensor_specs(cfg):
        if not ckpt.has(spec.name):
            if spec.optional:
                continue
            raise Ds4Error(f"{hf_dir}: checkpoint has no tensor {ckpt.describe(spec.name)} "
                           f"(needed for {spec.name})")
        numpy_shape = tuple(reversed(spec.shape))
        if ckpt.shape(spec.name) != numpy_shape:
            raise Ds4Error(f"{hf_dir}: tensor {ckpt.describe(spec.name)} has shape "
                           f"{list(ckpt.shape(spec.name))}, expected {list(numpy_shape)} for {spec.name}")
        qtype = choose_type(spec, dense, experts)

        def produce(name=spec.name, qtype=qtype):
            x = ckpt.get(name)
            if qtype == QT.I32:
                if x.min() < 0 or x.max() >= cfg.n_expert:
                    raise Ds4Error(f"{ckpt.describe(name)}: expert ids must lie in 0..{cfg.n_expert - 1}")
                return np.ascontiguousarray(x, dtype=np.int32)
            return quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)

        tensors.append(TensorOut(spec.name, qtype, numpy_shape, produce))

    meta = {"general.architecture": "deepseek4", "general.name": hf_dir.name}
    meta.update(cfg.to_metadata())
    vocab = hf_vocab(hf_dir, cfg.n_vocab, pre="deepseek-v3") or synthetic_vocab(cfg.n_vocab)
    meta.update(vocab)
    return write_gguf(Path(out), "deepseek4", meta, tensors, progress=progress, description="converting")
