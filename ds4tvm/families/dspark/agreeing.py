"""Support files whose proposals are known in advance, for tests and the demo.

Random drafter weights give near-zero acceptance. These files keep random stage weights but make
the Markov head decide: entry k of the table (prev -> next) gets dimension k, w1[prev] = alpha *
e_k + e_rank-1 and w2[next, k] = 1, so argmax(l_i + w2 . w1[prev]) = next whatever the stages
produce, and the confidence head reads the constant dimension, so sigma(c_i) ~ 1. With `next`
taken from the target's own greedy continuation the drafter agrees; changing one entry makes it
disagree there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...gguf.writer import TensorOut, write_gguf
from ..deepseek4.config import Config as V4Config
from ..deepseek4.random_model import random_tensors
from .config import ARCH, Config
from .tensors import tensor_specs

ALPHA = 1000.0
CONFIDENCE_LOGIT = 12.0


def write_markov_dspark(path: str | Path, target: V4Config, successor, seed: int = 0,
                        n_stages: int = 3, block_size: int = 5, target_layer_ids: tuple[int, ...] | None = None) -> Path:
    """successor: the token to propose after each token (an array over the vocabulary), or after
    the tokens a dict names (the rank is then their count: a 32k vocabulary's full table would be
    two 4 GB matrices); after other tokens the random stages decide."""
    V, E = target.n_vocab, target.n_embd
    pairs = list(successor.items()) if isinstance(successor, dict) else list(enumerate(np.asarray(successor)))
    rank = (len(pairs) // 32 + 1) * 32  # one dimension per table entry plus a constant one, rounded up to 32
    layers = target_layer_ids or tuple(range(max(0, target.n_layers - 3), target.n_layers))
    cfg = Config(n_stages=n_stages, block_size=block_size, markov_rank=rank, noise_token_id=V - 1,
                 target_layer_ids=layers, block=target)
    last = f"mtp.{n_stages - 1}."
    prev, nxt = (np.array([int(x) for x in col], np.int64) for col in zip(*pairs))
    w1 = np.zeros((V, rank), np.float32)
    w1[prev, np.arange(len(pairs))] = ALPHA
    w1[:, rank - 1] = 1.0
    w2 = np.zeros((V, rank), np.float32)
    w2[nxt % V, np.arange(len(pairs))] = 1.0
    conf = np.zeros((1, E + rank), np.float32)
    conf[0, E + rank - 1] = CONFIDENCE_LOGIT
    fixed = {last + "markov_head.markov_w1.weight": w1, last + "markov_head.markov_w2.weight": w2,
             last + "confidence_head.proj.weight": conf}
    tensors = []
    for t in random_tensors(tensor_specs(cfg), target, np.random.default_rng(seed)):
        if t.name in fixed:
            value = fixed[t.name]
            t = TensorOut(t.name, QT.F32, value.shape, lambda v=value: v)
        tensors.append(t)
    meta = {"general.architecture": ARCH, "general.name": "ds4tvm markov-driven dspark",
            "deepseek4.dspark.block_size": block_size, "deepseek4.dspark.markov_rank": rank,
            "deepseek4.dspark.noise_token_id": cfg.noise_token_id,
            "deepseek4.dspark.target_layer_ids": list(layers), "deepseek4.dspark.stage_count": n_stages}
    return write_gguf(path, ARCH, meta, tensors)
