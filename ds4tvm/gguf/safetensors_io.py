"""Read-only safetensors access through mmap (no torch needed; bf16 is widened on request)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import Ds4Error

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


class SafetensorsDir:
    """All tensors of the *.safetensors files in a directory, by name."""

    def __init__(self, directory: Path):
        self.index: dict[str, tuple[Path, dict, int]] = {}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise Ds4Error(f"{directory}: no *.safetensors files")
        for path in files:
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
            except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise Ds4Error(f"{path}: not a readable safetensors file ({e})") from None
            for name, info in header.items():
                if name != "__metadata__":
                    self.index[name] = (path, info, 8 + n)
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> list[str]:
        return list(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (floating types) or its integer type; a view where possible."""
        if name not in self.index:
            raise Ds4Error(f"checkpoint has no tensor {name}")
        path, info, base = self.index[name]
        dtype = info["dtype"]
        if dtype not in _DTYPES:
            raise Ds4Error(f"{path}: tensor {name} has dtype {dtype}; dequantize the checkpoint to "
                           f"F32/F16/BF16 first")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[path][base + begin:base + end].view(_DTYPES[dtype]).reshape(info["shape"])
        if dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if dtype in ("F16", "F64"):
            return raw.astype(np.float32)
        return raw
