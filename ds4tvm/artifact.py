"""Compiled artifacts: a directory with manifest.json, the compiled library per target and the
tokenizer/template data; weights stay in the GGUF, referenced by path, size and fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__
from .errors import Ds4Error

SCHEMA_VERSION = 2  # 2: params carry the file they come from (target or DSpark support)
MANIFEST = "manifest.json"
_FINGERPRINT_SPAN = 8 << 20


@dataclass(frozen=True)
class Bounds:
    """The shapes an artifact is compiled for: context length, widest verify, prefill chunk."""
    max_context: int = 4096
    max_verify: int = 16
    prefill_chunk: int = 256


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: Path) -> str:
    """A quick identity of a large file: its size with the hash of its first and last 8 MiB."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        if size > 2 * _FINGERPRINT_SPAN:
            f.seek(size - _FINGERPRINT_SPAN)
            h.update(f.read(_FINGERPRINT_SPAN))
        else:
            h.update(f.read())
    return h.hexdigest()


def file_identity(path: Path) -> dict:
    """How an artifact refers to a GGUF it was compiled from (the model, or a support file)."""
    path = Path(path).resolve()
    return {"gguf_path": str(path), "gguf_size": os.path.getsize(path), "gguf_sha256": file_sha256(path),
            "gguf_fingerprint": file_fingerprint(path)}


def same_file(path: Path, identity: dict) -> bool:
    """Whether path is the file `identity` describes (size and fingerprint; no full hash)."""
    return os.path.getsize(path) == identity["gguf_size"] and file_fingerprint(path) == identity["gguf_fingerprint"]


@dataclass
class Manifest:
    family: str
    architecture: str
    target: dict
    target_name: str
    gguf_path: str
    gguf_sha256: str
    gguf_size: int
    gguf_fingerprint: str
    bounds: dict
    kv_rounding: bool
    functions: list[str]
    params: list[list]                 # [argument, GGUF tensor, plane field or null, "target"|"draft"]
    states: list[list]                 # [name, shape]
    library: str
    tokenizer: str = "tokenizer.json"
    device: str = "cpu"                # cpu | cuda | rocm | metal
    arches: list = field(default_factory=list)   # GPU architectures the library holds code for
    schema_version: int = SCHEMA_VERSION
    tvm_version: str = ""
    ds4tvm_version: str = __version__
    extra: dict = field(default_factory=dict)

    def write(self, out_dir: Path) -> Path:
        path = Path(out_dir) / MANIFEST
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, art_dir: Path) -> "Manifest":
        path = Path(art_dir) / MANIFEST
        if not path.is_file():
            raise Ds4Error(f"{art_dir}: not a ds4tvm artifact (no {MANIFEST})")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise Ds4Error(f"{path}: unreadable manifest ({e})") from None
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise Ds4Error(f"{path}: manifest schema {raw.get('schema_version')} is not {SCHEMA_VERSION}; "
                           f"recompile with this ds4tvm")
        try:
            return cls(**raw)
        except TypeError as e:
            raise Ds4Error(f"{path}: malformed manifest ({e})") from None

    def check_runtime(self, art_dir: Path) -> None:
        import tvm

        if self.tvm_version != tvm.__version__:
            raise Ds4Error(f"{art_dir}: built with TVM {self.tvm_version}, this is TVM {tvm.__version__}; "
                           f"recompile the artifact")
        if self.ds4tvm_version != __version__:
            raise Ds4Error(f"{art_dir}: built by ds4tvm {self.ds4tvm_version}, this is {__version__}; "
                           f"recompile the artifact")

    def check_gguf(self, gguf_path: Path, art_dir: Path) -> None:
        if not same_file(gguf_path, asdict(self)):
            raise Ds4Error(f"{art_dir}: was compiled from a different GGUF than {gguf_path} "
                           f"(expected sha256 {self.gguf_sha256[:16]}..., {self.gguf_size} bytes)")
