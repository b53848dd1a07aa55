"""Random DSpark support files paired with a (random) DeepSeek-V4 target, for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...gguf.writer import write_gguf
from ..deepseek4.config import Config as V4Config
from ..deepseek4.random_model import default_type, random_tensors
from .config import ARCH, Config
from .tensors import tensor_specs


def write_random_dspark(path: str | Path, target: V4Config, seed: int = 0, n_stages: int = 3,
                        block_size: int = 5, markov_rank: int = 32,
                        target_layer_ids: tuple[int, ...] | None = None, type_of=default_type) -> Path:
    layers = target_layer_ids or tuple(range(target.n_layers - 3, target.n_layers))
    cfg = Config(n_stages=n_stages, block_size=block_size, markov_rank=markov_rank,
                 noise_token_id=target.n_vocab - 1, target_layer_ids=layers, block=target)
    tensors = random_tensors(tensor_specs(cfg), target, np.random.default_rng(seed), type_of=type_of)
    return write_gguf(path, ARCH, support_metadata(cfg, "ds4tvm random dspark"), tensors)


def support_metadata(cfg: Config, name: str) -> dict:
    """The keys of a support file for cfg (the block's shapes come from its tensors)."""
    return {"general.architecture": ARCH, "general.name": name,
            "deepseek4.dspark.block_size": cfg.block_size, "deepseek4.dspark.markov_rank": cfg.markov_rank,
            "deepseek4.dspark.noise_token_id": cfg.noise_token_id,
            "deepseek4.dspark.target_layer_ids": list(cfg.target_layer_ids),
            "deepseek4.dspark.stage_count": cfg.n_stages,
            **({} if cfg.confidence_threshold is None else
               {"deepseek4.dspark.confidence_threshold": float(cfg.confidence_threshold)})}
