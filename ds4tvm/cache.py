"""Where ds4tvm keeps what it derives from model files: compiled artifacts, unpacked packages,
hash stamps, the host CPU's name, parsed hand-written kernels. DS4TVM_CACHE moves it (CI and
tests use a scratch folder)."""

from __future__ import annotations

import os
from pathlib import Path


def _base() -> Path:
    return Path(os.environ.get("DS4TVM_CACHE", Path.home() / ".cache" / "ds4tvm"))


def cache_root() -> Path:
    return _base() / "artifacts"


def kernel_cache() -> Path:
    """Hand-written kernels as parsed TIR (nn/cpu_kernels.py)."""
    return _base() / "kernels"
