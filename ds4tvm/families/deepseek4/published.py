"""The published DeepSeek-V4-Flash shapes (ds4-spec §1.1) and its DSpark support file's (§1.3), with
the tensor types of the published Q2 recipe ("IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8"): what
`ds4-compile --shapes-only` compiles, without weights, to check that real-size graphs build."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QT

from ...gguf.validate import TensorSpec
from .config import Config
from .random_model import default_type

_Q8_0 = ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight", "attn_output_b.weight",
         "shexp.weight", "output.weight", "main_proj.weight")


def flash_config() -> Config:
    n = 43
    return Config(
        n_layers=n, n_embd=4096, n_vocab=129280, n_head=64, head_dim=512, n_rot=64, q_lora_rank=1024,
        o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6, n_ff_exp=2048, n_expert_shared=1,
        n_hash_layers=3, sliding_window=128, idx_n_head=64, idx_head_dim=128, idx_top_k=512, hc=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, rope_base=1e4, compress_rope_base=160000.0, yarn_factor=16.0,
        yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=65536, expert_weights_scale=1.5,
        expert_weights_norm=True, rms_eps=1e-6,
        compress_ratios=(0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, n)), swiglu_clamp=(10.0,) * n)


def flash_dspark_config(target: Config):
    from ..dspark.config import Config as DSparkConfig, paired_with

    return paired_with(DSparkConfig(n_stages=3, block_size=5, markov_rank=256, noise_token_id=128799,
                                    target_layer_ids=(40, 41, 42), block=target), target)


def q2_recipe_type(spec: TensorSpec) -> QT:
    name = spec.name
    if "ffn_gate_exps" in name or "ffn_up_exps" in name:
        return QT.IQ2_XXS
    if "ffn_down_exps" in name:
        return QT.Q2_K
    if name.endswith(_Q8_0) and ".indexer." not in name:   # blk.N.indexer.attn_q_b stays F16
        return QT.Q8_0
    return default_type(spec)   # F16 (embedding, compressors, indexer, router, HC), F32 norms, I32 tid2eid
