"""DeepSeek-V4 parameters and their GGUF tensors: name, shape in ggml order, accepted types."""

from __future__ import annotations

from ...gguf.validate import DENSE, EMBED, INDEX, NORM, PLAIN, ROUTED, TensorSpec
from .config import Config


def block_specs(c: Config, prefix: str, ratio: int, hash_layer: bool,
                selection_bias_required: bool = False) -> list[TensorSpec]:
    """One V4 block (HC, attention, MoE); DSpark stages reuse it with ratio 0."""
    E, H, D, hc = c.n_embd, c.n_head, c.head_dim, c.hc
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + combine (hc*hc)
    s = lambda name, shape, types, optional=False: TensorSpec(prefix + name, tuple(shape), types, optional)  # noqa: E731
    specs = [
        s("hc_attn_fn.weight", (hc * E, mix), PLAIN),
        s("hc_attn_scale.weight", (3,), NORM),
        s("hc_attn_base.weight", (mix,), NORM),
        s("attn_norm.weight", (E,), NORM),
        s("attn_q_a.weight", (E, c.q_lora_rank), DENSE),
        s("attn_q_a_norm.weight", (c.q_lora_rank,), NORM),
        s("attn_q_b.weight", (c.q_lora_rank, H * D), DENSE),
        s("attn_kv.weight", (E, D), DENSE),
        s("attn_kv_a_norm.weight", (D,), NORM),
        s("attn_sinks.weight", (H,), NORM),
        s("attn_output_a.weight", (H // c.o_groups * D, c.o_groups * c.o_lora_rank), DENSE),
        s("attn_output_b.weight", (c.o_groups * c.o_lora_rank, E), DENSE),
    ]
    if ratio:
        lanes = 2 if ratio == 4 else 1  # ratio 4 pools overlapping windows through two lanes
        specs += [
            s("attn_compressor_ape.weight", (lanes * D, ratio), PLAIN),
            s("attn_compressor_kv.weight", (E, lanes * D), DENSE),
            s("attn_compressor_gate.weight", (E, lanes * D), DENSE),
            s("attn_compressor_norm.weight", (D,), NORM),
        ]
        if ratio == 4:
            I = c.idx_head_dim  # noqa: E741
            specs += [
                s("indexer.attn_q_b.weight", (c.q_lora_rank, c.idx_n_head * I), DENSE),
                s("indexer.proj.weight", (E, c.idx_n_head), DENSE),
                s("indexer_compressor_ape.weight", (2 * I, ratio), PLAIN),
                s("indexer_compressor_kv.weight", (E, 2 * I), DENSE),
                s("indexer_compressor_gate.weight", (E, 2 * I), DENSE),
                s("indexer_compressor_norm.weight", (I,), NORM),
            ]
    specs += [
        s("hc_ffn_fn.weight", (hc * E, mix), PLAIN),
        s("hc_ffn_scale.weight", (3,), NORM),
        s("hc_ffn_base.weight", (mix,), NORM),
        s("ffn_norm.weight", (E,), NORM),
        s("ffn_gate_inp.weight", (E, c.n_expert), PLAIN),
        s("ffn_gate_exps.weight", (E, c.n_ff_exp, c.n_expert), ROUTED),
        s("ffn_up_exps.weight", (E, c.n_ff_exp, c.n_expert), ROUTED),
        s("ffn_down_exps.weight", (c.n_ff_exp, E, c.n_expert), ROUTED),
        s("ffn_gate_shexp.weight", (E, c.n_ff_exp * c.n_expert_shared), DENSE),
        s("ffn_up_shexp.weight", (E, c.n_ff_exp * c.n_expert_shared), DENSE),
        s("ffn_down_shexp.weight", (c.n_ff_exp * c.n_expert_shared, E), DENSE),
    ]
    if hash_layer:
        specs.append(TensorSpec(prefix + "ffn_gate_tid2eid.weight", (c.n_expert_used, c.n_vocab), INDEX,
                                index_bound=c.n_expert))
    else:
        # The selection bias is optional in ds4's target validator; hash layers never have one.
        specs.append(s("exp_probs_b.bias", (c.n_expert,), NORM, optional=not selection_bias_required))
    return specs


def tensor_specs(c: Config) -> list[TensorSpec]:
    E, hc = c.n_embd, c.hc
    specs = [
        TensorSpec("token_embd.weight", (E, c.n_vocab), EMBED),
        TensorSpec("output_norm.weight", (E,), NORM),
        TensorSpec("output.weight", (E, c.n_vocab), DENSE),
        TensorSpec("output_hc_fn.weight", (hc * E, hc), PLAIN),
        TensorSpec("output_hc_base.weight", (hc,), NORM),
        TensorSpec("output_hc_scale.weight", (1,), NORM),
    ]
    for il in range(c.n_layers):
        specs += block_specs(c, f"blk.{il}.", c.ratio(il), c.is_hash_layer(il))
    return specs
