"""DSpark support file (`deepseek4-dspark`): drafter keys (ds4-spec §1.3) and block shapes.

The support file's metadata holds only the drafter's own keys; the V4 block dimensions are read
from its tensors here and checked against the target model when the two are paired.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import Ds4Error
from ...gguf.reader import GGUFFile
from ..deepseek4.config import Config as V4Config
from ..deepseek4.support import block_shapes, paired_block, tensor_shape

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
    # the θ its trainer calibrated (ds4tvm's own key; ds4 has none): --dspark-confidence's default
    confidence_threshold: float | None = None

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
        theta = _dspark_key(f, "confidence_threshold", "float", default=None)
        theta = None if theta is None else round(theta, 6)   # stored as float32
        if theta is not None and not 0 <= theta <= 1:
            raise Ds4Error(f"{f.name}: DSpark confidence_threshold {theta} is outside [0, 1]")
        block = _block_shapes(f, stages)
        if not 0 <= noise < block.n_vocab:
            raise Ds4Error(f"{f.name}: DSpark noise_token_id {noise} is outside the vocabulary of {block.n_vocab}")
        return cls(stages, block_size, rank, noise, layers, block, theta)


def _block_shapes(f: GGUFFile, stages: int) -> V4Config:
    last = f"mtp.{stages - 1}."
    hc, = tensor_shape(f, last + "hc_head_base.weight", 1)
    _, vocab = tensor_shape(f, last + "markov_head.markov_w1.weight", 2)
    return block_shapes(f, stages, hc, vocab)


def paired_with(cfg: Config, target: V4Config) -> Config:
    """The drafter config with the block hyper-parameters of its target, after checking that the
    support file matches the model (width, vocabulary, heads, layer ids in range)."""
    problems = []
    if cfg.target_layer_ids[-1] >= target.n_layers:
        problems.append(f"target_layer_ids {list(cfg.target_layer_ids)} not all < {target.n_layers}")
    block = paired_block(cfg.block, target, ("n_embd", "n_vocab", "n_head", "head_dim", "q_lora_rank", "hc"), problems)
    return replace(cfg, block=block)
