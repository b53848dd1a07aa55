"""Random legacy MTP support files paired with a (random) DeepSeek-V4 target, for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...gguf.writer import write_gguf
from ..deepseek4.config import Config as V4Config
from ..deepseek4.random_model import random_tensors
from .config import ARCH, Config, paired_with
from .tensors import tensor_specs


def write_random_mtp(path: str | Path, target: V4Config, seed: int = 0) -> Path:
    cfg = paired_with(Config(target), target)
    meta = {"general.architecture": ARCH, "general.name": "ds4tvm random legacy mtp"}
    return write_gguf(path, ARCH, meta, random_tensors(tensor_specs(cfg), target, np.random.default_rng(seed)))
