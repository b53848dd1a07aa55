"""Legacy MTP support files whose drafts are the target's own next tokens, for tests and demos.

On a target whose residual writers are scaled down (its next token is nearly a function of the
current one: random_model.RESIDUAL_WRITERS), the target's output head reads RMSNorm(h)·output_norm
with h close to the current token's embedding. This file makes the MTP block an identity on the
token row - e_proj = I, h_proj = 0, enorm = 1, its own residual writers scaled down likewise - and
gives it the target's output_norm as `norm`, so its draft after t is what the target predicts
after t: the drafter agrees with the target, as a trained one would on easy text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ...gguf import open_gguf
from ...gguf.writer import TensorOut, write_gguf
from ..deepseek4.config import Config as V4Config
from ..deepseek4.random_model import random_tensors
from .config import ARCH, Config, paired_with
from .tensors import tensor_specs


def write_agreeing_mtp(path: str | Path, target_path: str | Path, seed: int = 0,
                       residual_scale: float = 1e-4) -> Path:
    f = open_gguf(target_path)
    target = V4Config.from_gguf(f)
    norm = f.tensors["output_norm.weight"]
    E = target.n_embd
    fixed = {"mtp.0.e_proj.weight": np.eye(E, dtype=np.float32), "mtp.0.h_proj.weight": np.zeros((E, E), np.float32),
             "mtp.0.enorm.weight": np.ones(E, np.float32),
             "mtp.0.norm.weight": quants.dequantize(np.asarray(norm.data), norm.ggml_type).astype(np.float32)}
    cfg = paired_with(Config(target), target)
    tensors = []
    for t in random_tensors(tensor_specs(cfg), target, np.random.default_rng(seed), residual_scale=residual_scale):
        if t.name in fixed:
            t = TensorOut(t.name, QT.F32, fixed[t.name].shape, lambda v=fixed[t.name]: v)
        tensors.append(t)
    meta = {"general.architecture": ARCH, "general.name": "ds4tvm agreeing legacy mtp"}
    return write_gguf(path, ARCH, meta, tensors)
