"""DSpark support file (`deepseek4-dspark`): drafter keys (ds4-spec §1.3) and block shapes.

The support file's metadata holds only the drafter's own keys; the V4 block dimensions are read
from its tensors here and checked against the target model when the two are paired.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import Ds4Error
from ...gguf.reader import GGUFFile
from ..deepseek4.config import Config as V4Config

ARCH = "deepseek4-dspark"
MAX_BLOCK_SIZE = 16
MAX_STAGES = 8


def _dspark_key(f: GGUFFile, name: str, kind: str, default=..., extra_aliases: tuple[str, ...] = ()):
    # ds4 accepts deepseek4.dspark.X, deepseek4.dspark_X and dspark.X for every key.
    names = []
    for n in (name, *extra_aliases):
        names += [f"deepseek4.dspark.{n}", f"deepseek4.dspark_{n}", f"dspark.{n}"]
    if default is ...:
        return f.get(names[0], kind, aliases=names[1:])
    return f.get(names[0], kind, default=default, aliases=names[1:])


@dataclass(frozen=True)
class Config:
    n_stages: int
    block_size: int
    markov_rank: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    block: V4Config           # shapes of each stage's V4 block (from the tensors)

    @property
    def n_layers(self) -> int:
        return self.n_stages

    @property
    def n_embd(self) -> int:
        return self.block.n_embd

    @property
    def n_vocab(self) -> int:
        return self.block.n_vocab

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        stages = _dspark_key(f, "stage_count", "int", extra_aliases=("n_layers", "layer_count"))
        block_size = _dspark_key(f, "block_size", "int")
        rank = _dspark_key(f, "markov_rank", "int")
        noise = _dspark_key(f, "noise_token_id", "int")
        layers = tuple(_dspark_key(f, "target_layer_ids", "ints", extra_aliases=("target_layers",)))
        if not 1 <= stages <= MAX_STAGES:
            raise Ds4Error(f"{f.name}: DSpark stage count {stages} is outside 1..{MAX_STAGES}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise Ds4Error(f"{f.name}: DSpark block_size {block_size} is outside 1..{MAX_BLOCK_SIZE}")
        if not layers or any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0:
            raise Ds4Error(f"{f.name}: DSpark target_layer_ids {list(layers)} must be non-empty, "
                           f"non-negative and strictly increasing")
        block = _block_shapes(f, stages)
        if not 0 <= noise < block.n_vocab:
            raise Ds4Error(f"{f.name}: DSpark noise_token_id {noise} is outside the vocabulary of {block.n_vocab}")
        return cls(stages, block_size, rank, noise, layers, block)


def _shape(f: GGUFFile, name: str, ndim: int) -> tuple[int, ...]:
    t = f.tensor(name)
    if len(t.shape) != ndim:
        raise Ds4Error(f"{f.name}: tensor {name} has {len(t.shape)} dimensions, expected {ndim}")
    return t.shape


def _block_shapes(f: GGUFFile, stages: int) -> V4Config:
    last = f"mtp.{stages - 1}."
    E, = _shape(f, "mtp.0.attn_norm.weight", 1)
    _, q_lora = _shape(f, "mtp.0.attn_q_a.weight", 2)
    _, D = _shape(f, "mtp.0.attn_kv.weight", 2)
    H, = _shape(f, "mtp.0.attn_sinks.weight", 1)
    group_in, group_out = _shape(f, "mtp.0.attn_output_a.weight", 2)
    if D <= 0 or group_in % D or H % max(1, group_in // D):
        raise Ds4Error(f"{f.name}: tensor mtp.0.attn_output_a.weight shape [{group_in}, {group_out}] "
                       f"does not group {H} heads of {D}")
    o_groups = H // (group_in // D)
    _, n_expert = _shape(f, "mtp.0.ffn_gate_inp.weight", 2)
    _, n_ff, _ = _shape(f, "mtp.0.ffn_gate_exps.weight", 3)
    _, n_ff_sh = _shape(f, "mtp.0.ffn_gate_shexp.weight", 2)
    hc, = _shape(f, last + "hc_head_base.weight", 1)
    rank, vocab = _shape(f, last + "markov_head.markov_w1.weight", 2)
    n_rot = 64 if D >= 64 else D  # drafter RoPE covers the same tail as the target's
    # Fields with no tensor to read them from are placeholders until paired with the target.
    return V4Config(
        n_layers=stages, n_embd=E, n_vocab=vocab, n_head=H, head_dim=D, n_rot=n_rot,
        q_lora_rank=q_lora, o_lora_rank=group_out // o_groups, o_groups=o_groups,
        n_expert=n_expert, n_expert_used=min(6, n_expert), n_ff_exp=n_ff,
        n_expert_shared=max(1, n_ff_sh // max(1, n_ff)), n_hash_layers=0, sliding_window=128,
        idx_n_head=0, idx_head_dim=0, idx_top_k=0, hc=hc, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rope_base=10000.0, compress_rope_base=10000.0, yarn_factor=1.0, yarn_beta_fast=32.0,
        yarn_beta_slow=1.0, yarn_orig_ctx=0, expert_weights_scale=1.5, expert_weights_norm=True,
        rms_eps=1e-6, compress_ratios=(0,) * stages, swiglu_clamp=(10.0,) * stages)


def paired_with(cfg: Config, target: V4Config) -> Config:
    """The drafter config with the block hyper-parameters of its target, after checking that the
    support file matches the model (width, vocabulary, heads, layer ids in range)."""
    b = cfg.block
    problems = []
    for field in ("n_embd", "n_vocab", "n_head", "head_dim", "q_lora_rank", "hc"):
        if getattr(b, field) != getattr(target, field):
            problems.append(f"{field} {getattr(b, field)} vs {getattr(target, field)}")
    if cfg.target_layer_ids[-1] >= target.n_layers:
        problems.append(f"target_layer_ids {list(cfg.target_layer_ids)} not all < {target.n_layers}")
    if problems:
        raise Ds4Error("support file does not match this model: " + "; ".join(problems))
    block = replace(target, n_layers=cfg.n_stages, n_hash_layers=0, o_groups=b.o_groups,
                    o_lora_rank=b.o_lora_rank, n_expert=b.n_expert, n_ff_exp=b.n_ff_exp,
                    n_expert_shared=b.n_expert_shared, compress_ratios=(0,) * cfg.n_stages,
                    swiglu_clamp=target.swiglu_clamp[:1] * cfg.n_stages)
    return replace(cfg, block=block)
