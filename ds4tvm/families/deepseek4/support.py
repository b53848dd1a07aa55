"""What DeepSeek-V4's support files (DSpark, legacy MTP) share: V4 blocks under `mtp.N.` whose
hyper-parameters are read from the tensors (the files carry few keys), and their pairing with the
target, which supplies the rest and must agree on the shared shapes."""

from __future__ import annotations

from dataclasses import replace

from ...errors import Ds4Error
from ...gguf.reader import GGUFFile
from .config import Config as V4Config


def tensor_shape(f: GGUFFile, name: str, ndim: int) -> tuple[int, ...]:
    t = f.tensor(name)
    if len(t.shape) != ndim:
        raise Ds4Error(f"{f.name}: tensor {name} has {len(t.shape)} dimensions, expected {ndim}")
    return t.shape


def block_shapes(f: GGUFFile, n_blocks: int, hc: int, vocab: int) -> V4Config:
    """The V4 config of the blocks mtp.0.. as far as the tensors of mtp.0. say (the rest are
    placeholders until paired_block gives the target's values)."""
    E, = tensor_shape(f, "mtp.0.attn_norm.weight", 1)
    _, q_lora = tensor_shape(f, "mtp.0.attn_q_a.weight", 2)
    _, D = tensor_shape(f, "mtp.0.attn_kv.weight", 2)
    H, = tensor_shape(f, "mtp.0.attn_sinks.weight", 1)
    group_in, group_out = tensor_shape(f, "mtp.0.attn_output_a.weight", 2)
    if D <= 0 or group_in % D or H % max(1, group_in // D):
        raise Ds4Error(f"{f.name}: tensor mtp.0.attn_output_a.weight shape [{group_in}, {group_out}] "
                       f"does not group {H} heads of {D}")
    o_groups = H // (group_in // D)
    _, n_expert = tensor_shape(f, "mtp.0.ffn_gate_inp.weight", 2)
    _, n_ff, _ = tensor_shape(f, "mtp.0.ffn_gate_exps.weight", 3)
    _, n_ff_sh = tensor_shape(f, "mtp.0.ffn_gate_shexp.weight", 2)
    n_rot = 64 if D >= 64 else D  # drafter RoPE covers the same tail as the target's
    return V4Config(
        n_layers=n_blocks, n_embd=E, n_vocab=vocab, n_head=H, head_dim=D, n_rot=n_rot,
        q_lora_rank=q_lora, o_lora_rank=group_out // o_groups, o_groups=o_groups,
        n_expert=n_expert, n_expert_used=min(6, n_expert), n_ff_exp=n_ff,
        n_expert_shared=max(1, n_ff_sh // max(1, n_ff)), n_hash_layers=0, sliding_window=128,
        idx_n_head=0, idx_head_dim=0, idx_top_k=0, hc=hc, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rope_base=10000.0, compress_rope_base=10000.0, yarn_factor=1.0, yarn_beta_fast=32.0,
        yarn_beta_slow=1.0, yarn_orig_ctx=0, expert_weights_scale=1.5, expert_weights_norm=True,
        rms_eps=1e-6, compress_ratios=(0,) * n_blocks, swiglu_clamp=(10.0,) * n_blocks)


def paired_block(b: V4Config, target: V4Config, fields: tuple[str, ...], problems: list[str]) -> V4Config:
    """The blocks' config with the target's hyper-parameters, after comparing `fields`; mismatches
    are added to problems (the caller raises once with all of them)."""
    for name in fields:
        if getattr(b, name) != getattr(target, name):
            problems.append(f"{name} {getattr(b, name)} vs {getattr(target, name)}")
    if problems:
        raise Ds4Error("support file does not match this model: " + "; ".join(problems))
    return replace(target, n_layers=b.n_layers, n_hash_layers=0, o_groups=b.o_groups,
                   o_lora_rank=b.o_lora_rank, n_expert=b.n_expert, n_ff_exp=b.n_ff_exp,
                   n_expert_shared=b.n_expert_shared, compress_ratios=(0,) * b.n_layers,
                   swiglu_clamp=target.swiglu_clamp[:1] * b.n_layers)
