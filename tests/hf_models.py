"""Tiny random transformers checkpoints of the real architectures, for conversion and oracle tests.

Every parameter is randomised, 1-D ones and tid2eid included: at their initial values (zeros,
ones) index-order mistakes in sinks, HC base/scale, position biases or routing bias stay hidden.
"""

from __future__ import annotations

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
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                n_tok, k = b.shape
                ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(n_tok)])
                b.copy_(ids)
    model.save_pretrained(out_dir)
    return Path(out_dir)
