"""Where ds4tvm keeps what it derives from model files: compiled artifacts, unpacked packages,
hash stamps, the host CPU's name. DS4TVM_CACHE moves it (CI and tests use a scratch folder)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DS4TVM_CACHE", Path.home() / ".cache" / "ds4tvm")) / "artifacts"
