"""GLM-5.3-Flash tensors (ds4-spec §1.4): one table of canonical names (ds4's), shapes in ggml order
and accepted types, and the names llama.cpp's `glm5-next` layout gives the same tensors.

Two llama.cpp tensors hold other values than ds4's: `ssm_a` is -exp(A_log) where ds4 stores
`kda_a_log` itself, and its conv weights carry two singleton axes ({K, 1, I, 1} for ds4's {K, I})."""

from __future__ import annotations

import numpy as np

from ...gguf.validate import DENSE, EMBED, NORM, PLAIN, ROUTED, TensorSpec
from .config import DS4, LLAMA, Config

# canonical suffix (after blk.L.) -> llama.cpp's
LLAMA_NAMES = {
    "kda_q.weight": "attn_q.weight",
    "kda_k.weight": "attn_k.weight",
    "kda_v.weight": "attn_v.weight",
    "kda_q_conv.weight": "ssm_conv1d_q.weight",
    "kda_k_conv.weight": "ssm_conv1d_k.weight",
    "kda_v_conv.weight": "ssm_conv1d_v.weight",
    "kda_f_a.weight": "ssm_f_a.weight",
    "kda_f_b.weight": "ssm_f_b.weight",
    "kda_dt_bias.weight": "ssm_dt.bias",
    "kda_a_log.weight": "ssm_a",
    "kda_beta.weight": "ssm_beta.weight",
    "kda_g_a.weight": "ssm_g_a.weight",
    "kda_g_b.weight": "ssm_g_b.weight",
    "kda_o_norm.weight": "ssm_norm.weight",
    "kda_output.weight": "attn_output.weight",
    "indexer.pool_ape.weight": "indexer_compressor_ape.weight",
    "indexer.pool_gate.weight": "indexer_compressor_gate.weight",
}
A_LOG, CONVS = "kda_a_log.weight", ("kda_q_conv.weight", "kda_k_conv.weight", "kda_v_conv.weight")


def suffix_of(name: str) -> str:
    """`blk.3.kda_q.weight` -> `kda_q.weight`; top-level names stay as they are."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def canonical_pairs(cfg: Config):
    """(canonical spec, spec in cfg's layout, suffix) of every tensor: both layouts list the same
    tensors in the same order."""
    from dataclasses import replace

    for canonical, spec in zip(tensor_specs(replace(cfg, layout=DS4)), tensor_specs(cfg)):
        yield canonical, spec, suffix_of(canonical.name)


def file_name(cfg: Config, canonical: str) -> str:
    """The name a tensor has in a file of cfg's layout."""
    if cfg.layout != LLAMA or not canonical.startswith("blk."):
        return canonical
    _, layer, suffix = canonical.split(".", 2)
    return f"blk.{layer}.{LLAMA_NAMES.get(suffix, suffix)}"


def in_layout(cfg: Config, suffix: str, values: np.ndarray) -> np.ndarray:
    """Canonical values as cfg's layout stores them."""
    if cfg.layout != LLAMA:
        return values
    if suffix == A_LOG:
        return -np.exp(values)
    if suffix in CONVS:   # [I, K] -> [1, I, 1, K]
        return values.reshape(1, values.shape[0], 1, values.shape[1])
    return values


def _kda(c: Config) -> list[tuple]:
    E, H, D, K = c.n_embd, c.kda_n_head, c.kda_head_dim, c.conv_kernel
    inner = H * D
    conv = (K, 1, inner, 1) if c.layout == LLAMA else (K, inner)
    return [*((f"kda_{x}.weight", (E, inner), DENSE) for x in "qkv"),
            *((name, conv, NORM) for name in CONVS),
            ("kda_f_a.weight", (E, D), DENSE), ("kda_f_b.weight", (D, inner), DENSE),
            ("kda_dt_bias.weight", (inner,), NORM), (A_LOG, (H,), NORM), ("kda_beta.weight", (E, H), DENSE),
            ("kda_g_a.weight", (E, D), DENSE), ("kda_g_b.weight", (D, inner), DENSE),
            ("kda_o_norm.weight", (D,), NORM), ("kda_output.weight", (inner, E), DENSE)]


def _dsa(c: Config, indexer: bool) -> list[tuple]:
    E, H, Rq, Rkv = c.n_embd, c.n_head, c.q_lora_rank, c.kv_lora_rank
    out = [("attn_q_a.weight", (E, Rq), DENSE), ("attn_q_a_norm.weight", (Rq,), NORM),
           ("attn_q_b.weight", (Rq, H * c.key_length), DENSE), ("attn_kv_a_mqa.weight", (E, Rkv), DENSE),
           ("attn_kv_a_norm.weight", (Rkv,), NORM), ("attn_k_b.weight", (c.key_length, Rkv, H), DENSE),
           ("attn_v_b.weight", (Rkv, c.value_length, H), DENSE), ("attn_output.weight", (H * c.value_length, E), DENSE)]
    if indexer:
        IH, ID = c.idx_n_head, c.idx_head_dim
        out += [("indexer.attn_q_b.weight", (Rq, IH * ID), DENSE), ("indexer.attn_k.weight", (E, ID), DENSE),
                ("indexer.k_norm.weight", (ID,), NORM), ("indexer.k_norm.bias", (ID,), NORM),
                ("indexer.proj.weight", (E, IH), DENSE), ("indexer.pool_ape.weight", (ID, c.idx_pool), PLAIN),
                ("indexer.pool_gate.weight", (E, ID), DENSE)]
    return out


def _ffn(c: Config, layer: int) -> list[tuple]:
    E = c.n_embd
    if not c.is_moe(layer):
        return [("ffn_gate.weight", (E, c.n_ff), DENSE), ("ffn_up.weight", (E, c.n_ff), DENSE),
                ("ffn_down.weight", (c.n_ff, E), DENSE)]
    X, Fe, S = c.n_expert, c.n_ff_exp, c.n_ff_exp * c.n_expert_shared
    return [("ffn_gate_inp.weight", (E, X), PLAIN), ("exp_probs_b.bias", (X,), NORM),
            ("ffn_gate_exps.weight", (E, Fe, X), ROUTED), ("ffn_up_exps.weight", (E, Fe, X), ROUTED),
            ("ffn_down_exps.weight", (Fe, E, X), ROUTED), ("ffn_gate_shexp.weight", (E, S), DENSE),
            ("ffn_up_shexp.weight", (E, S), DENSE), ("ffn_down_shexp.weight", (S, E), DENSE)]


def _hc(c: Config) -> list[tuple]:
    mix = (2 + c.hc) * c.hc   # pre + post + combine
    return [(f"hc_{s}_{part}.weight", shape, types) for s in ("attn", "ffn")
            for part, shape, types in (("fn", (c.hc * c.n_embd, mix), PLAIN), ("scale", (3,), NORM),
                                       ("base", (mix,), NORM))]


def _nextn(c: Config) -> list[tuple]:
    E, H = c.n_embd, c.mtp_input_width
    return [("nextn.eh_proj.weight", (E + H, E), DENSE), ("nextn.enorm.weight", (E,), NORM),
            ("nextn.hnorm.weight", (H,), NORM), ("nextn.shared_head_norm.weight", (E,), NORM, c.layout == LLAMA)]


def layer_specs(c: Config, layer: int) -> list[tuple]:
    """(suffix, shape, types[, optional]) of one layer in canonical names."""
    out = [("attn_norm.weight", (c.n_embd,), NORM), ("ffn_norm.weight", (c.n_embd,), NORM)]
    if layer < c.n_layers:
        out += _hc(c)
    out += _dsa(c, c.has_indexer(layer)) if c.is_dsa(layer) else _kda(c)
    out += _ffn(c, layer)
    if layer >= c.n_layers:
        out += _nextn(c)
    return out


def tensor_specs(c: Config) -> list[TensorSpec]:
    """Every tensor of a file of c's layout, under the name it has there."""
    specs = [TensorSpec("token_embd.weight", (c.n_embd, c.n_vocab), EMBED),
             TensorSpec("output_norm.weight", (c.n_embd,), NORM),
             TensorSpec("output.weight", (c.n_embd, c.n_vocab), DENSE)]
    for layer in range(c.n_all):
        for suffix, shape, types, *optional in layer_specs(c, layer):
            specs.append(TensorSpec(file_name(c, f"blk.{layer}.{suffix}"), tuple(shape), types,
                                    bool(optional and optional[0])))
    return specs
