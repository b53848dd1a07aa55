"""Qwen3.8 Flash Next tensors (ds4-spec §1.5; llama.cpp's `qwen4exp` loader uses the same names):
names, shapes in ggml order and accepted types. Norm gammas are stored folded ((1 + w) of
transformers' zero-centred ones), `ssm_a` is -exp(A_log), and the GDN value heads are in tiled order
(value head j reads key head j % key_heads), as llama.cpp's converter writes them."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QT

from ...gguf.validate import DENSE, EMBED, NORM, PLAIN, ROUTED, TensorSpec
from .config import Config
from .ple import TABLE

# the n-gram table: BF16 in the newest files, older ones quantized
TABLE_TYPES = EMBED | frozenset({QT.Q4_0, QT.Q4_1})


def _hc(c: Config, part: str) -> list[tuple]:
    W = c.hc * c.n_embd
    out = [(f"{part}_norm.weight", (W,), NORM), (f"{part}_down.weight", (W, c.hc_rank), PLAIN),
           (f"{part}_up.weight", (c.hc_rank, W), PLAIN)]
    return out + ([(f"{part}_inject.weight", (W, c.hc), PLAIN)] if part != "output_hc" else [])


def _gdn(c: Config) -> list[tuple]:
    E, D, Hk, Hv = c.n_embd, c.gdn_head_dim, c.gdn_k_heads, c.gdn_v_heads
    conv = (2 * Hk + Hv) * D
    return [("attn_qkv.weight", (E, conv), DENSE), ("attn_gate.weight", (E, Hv * D), DENSE),
            ("ssm_conv1d.weight", (c.conv_kernel, conv), NORM), ("ssm_dt.bias", (Hv,), NORM),
            ("ssm_a", (Hv,), NORM), ("ssm_beta.weight", (E, Hv), DENSE), ("ssm_alpha.weight", (E, Hv), DENSE),
            ("ssm_norm.weight", (D,), NORM), ("ssm_out.weight", (Hv * D, E), DENSE)]


def _attention(c: Config) -> list[tuple]:
    E, D, H, Hkv, IH, ID = c.n_embd, c.head_dim, c.n_head, c.n_head_kv, c.idx_n_head, c.idx_head_dim
    return [("attn_q.weight", (E, 2 * H * D), DENSE), ("attn_k.weight", (E, Hkv * D), DENSE),
            ("attn_v.weight", (E, Hkv * D), DENSE), ("attn_output.weight", (H * D, E), DENSE),
            ("attn_q_norm.weight", (D,), NORM), ("attn_k_norm.weight", (D,), NORM),
            ("indexer.q_proj.weight", (E, IH * ID), DENSE), ("indexer.k_proj.weight", (E, ID), DENSE),
            ("indexer.q_norm.weight", (ID,), NORM), ("indexer.k_norm.weight", (ID,), NORM)]


def _ple(c: Config) -> list[tuple]:
    E, W = c.n_embd, c.hc * c.n_embd
    return [("ple_key.weight", (E, W), DENSE), ("ple_value.weight", (E, E), DENSE),
            ("ple_norm_key.weight", (W,), NORM), ("ple_norm_query.weight", (W,), NORM),
            ("ple_norm_conv.weight", (W,), NORM), ("ple_conv1d.weight", (c.ple_conv_kernel, W), NORM)]


def _moe(c: Config) -> list[tuple]:
    E, X, F, S = c.n_embd, c.n_expert, c.n_ff_exp, c.n_ff_shexp
    return [("ffn_gate_inp.weight", (E, X), PLAIN), ("ffn_gate_exps.weight", (E, F, X), ROUTED),
            ("ffn_up_exps.weight", (E, F, X), ROUTED), ("ffn_down_exps.weight", (F, E, X), ROUTED),
            ("ffn_gate_inp_shexp.weight", (E,), PLAIN), ("ffn_gate_shexp.weight", (E, S), DENSE),
            ("ffn_up_shexp.weight", (E, S), DENSE), ("ffn_down_shexp.weight", (S, E), DENSE)]


def layer_specs(c: Config, layer: int) -> list[tuple]:
    """(suffix, shape, types) of one trunk layer."""
    out = _hc(c, "hc_attn") + _hc(c, "hc_ffn")
    out += _gdn(c) if c.is_gdn(layer) else _attention(c)
    if layer in c.ple_layers:
        out += _ple(c)
    return out + _moe(c)


def nextn_specs(c: Config) -> list[tuple]:
    """(suffix, shape, types) of the MTP layer's own tensors, beside its attention + MoE block:
    eh_proj over [enorm(embedding); hnorm(stream)], and its HC head mixer."""
    E, W = c.n_embd, c.hc * c.n_embd
    return [("nextn.eh_proj.weight", (2 * E, E), DENSE), ("nextn.enorm.weight", (E,), NORM),
            ("nextn.hnorm.weight", (W,), NORM), ("nextn.hc_head_norm.weight", (W,), NORM),
            ("nextn.hc_head_down.weight", (W, c.hc_rank), PLAIN), ("nextn.hc_head_up.weight", (c.hc_rank, W), PLAIN)]


def tensor_specs(c: Config) -> list[TensorSpec]:
    """Every tensor the target and its MTP layer (`blk.{n_layers}`, when nextn_predict_layers is 1)
    read, and the n-gram table (its rows: the file's count, checked against the head ranges by
    Config; read lazily, never bound)."""
    specs = [TensorSpec("token_embd.weight", (c.n_embd, c.n_vocab), EMBED),
             TensorSpec("output.weight", (c.n_embd, c.n_vocab), DENSE)]
    specs += [TensorSpec(name, shape, types) for name, shape, types in _hc(c, "output_hc")]
    if c.ple_layers:
        specs.append(TensorSpec(TABLE, (c.ple_width, c.ple_table_rows or c.ple_rows), TABLE_TYPES))
    for layer in range(c.n_layers):
        specs += [TensorSpec(f"blk.{layer}.{s}", tuple(shape), types) for s, shape, types in layer_specs(c, layer)]
    if c.n_nextn:
        specs += [TensorSpec(f"blk.{c.n_layers}.{s}", tuple(shape), types)
                  for s, shape, types in layer_specs(c, c.n_layers) + nextn_specs(c)]
    return specs
