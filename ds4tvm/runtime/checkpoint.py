"""Sequence checkpoints on disk (Engine.save_state / load_state) and the store the server keeps
them in.

A file is MAGIC, the header's length (8 bytes, little-endian), a JSON header and the state rows:
the header names the format, the ds4tvm version, the artifact (sha256 of its manifest), a tag (the
drafter whose states were fed), the committed length and tokens, each tensor's name, dtype and
shape, and the sha256 of everything after it. Anything that does not match (another artifact or
version, a truncated or damaged file) is a CheckpointError, raised before a state tensor is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import Ds4Error
from .engine import Checkpoint

MAGIC = b"DS4STATE"
FORMAT = 1
SUFFIX = ".ds4state"
_HEAD = len(MAGIC) + 8
_MAX_HEADER = 64 << 20


class CheckpointError(Ds4Error):
    pass


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def write(path, cp: Checkpoint, engine, tag: str = "") -> Path:
    """Writes cp (a snapshot of one of engine's sequences) atomically: a reader never sees half a file."""
    path = Path(path)
    header = {"format": FORMAT, "ds4tvm": __version__, "artifact": engine.identity, "tag": tag, "pos": cp.pos,
              "history": [int(t) for t in cp.history], "fed": sorted(cp.fed), "sha256": _digest(cp.arrays),
              "meta": cp.meta,
              "states": [{"name": s.name, "dtype": s.dtype, "shape": list(a.shape)}
                         for s, a in zip(engine.state_specs, cp.arrays)]}
    raw = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(raw)) + raw)
            for a in cp.arrays:
                f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_header(path) -> dict:
    """The header of a checkpoint file, checked for its form only."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
            if len(head) < _HEAD or head[:len(MAGIC)] != MAGIC:
                raise CheckpointError(f"{path}: not a ds4tvm checkpoint")
            (n,) = struct.unpack("<Q", head[len(MAGIC):])
            raw = f.read(n) if n <= _MAX_HEADER else b""
        header = json.loads(raw)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: damaged checkpoint (its header is not JSON)") from None
    keys = {"format", "ds4tvm", "artifact", "tag", "pos", "history", "sha256", "states"}
    if not isinstance(header, dict) or not keys <= header.keys():
        raise CheckpointError(f"{path}: damaged checkpoint (its header lacks {sorted(keys - set(header or {}))})")
    if header["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {header['format']} is not {FORMAT}")
    header["offset"] = _HEAD + n
    return header


def check_header(path, header: dict, engine, tag: str) -> None:
    """That the checkpoint was made for this artifact, by this ds4tvm, with this tag."""
    if header["ds4tvm"] != __version__:
        raise CheckpointError(f"{path}: written by ds4tvm {header['ds4tvm']}, this is {__version__}")
    if header["artifact"] != engine.identity:
        raise CheckpointError(f"{path}: a checkpoint of another artifact")
    if header["tag"] != tag:
        raise CheckpointError(f"{path}: made with {header['tag'] or 'no drafter'}, this run uses {tag or 'none'}")


def read(path, engine, tag: str = "") -> Checkpoint:
    path = Path(path)
    header = read_header(path)
    check_header(path, header, engine, tag)
    specs = engine.state_specs
    states, pos, history = header["states"], header["pos"], header["history"]
    if (len(states) != len(specs) or not isinstance(pos, int) or not isinstance(history, list)
            or len(history) != pos or not 0 <= pos <= engine.max_context
            or not all(isinstance(t, int) and 0 <= t < engine.n_vocab for t in history)):
        raise CheckpointError(f"{path}: damaged checkpoint (its positions or states do not fit the artifact)")
    arrays, offset = [], header["offset"]
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for s, d in zip(specs, states):
                shape = tuple(d.get("shape", ()))
                if d.get("name") != s.name or d.get("dtype") != s.dtype or shape != (s.rows_for(pos), *s.shape[1:]):
                    raise CheckpointError(f"{path}: its state {d.get('name')!r} is not the artifact's {s.name} "
                                          f"{s.dtype}{[s.rows_for(pos), *s.shape[1:]]}")
                n = int(np.prod(shape)) * np.dtype(s.dtype).itemsize
                raw = f.read(n)
                if len(raw) != n:
                    raise CheckpointError(f"{path}: truncated checkpoint (state {s.name} is cut short)")
                arrays.append(np.frombuffer(raw, s.dtype).reshape(shape))
            if f.read(1):
                raise CheckpointError(f"{path}: damaged checkpoint (bytes after the last state)")
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror or e})") from None
    if _digest(arrays) != header["sha256"]:
        raise CheckpointError(f"{path}: damaged checkpoint (checksum mismatch)")
    meta, fed = header.get("meta"), header.get("fed")
    if not isinstance(fed, list) or not set(fed) <= {s.group for s in specs}:
        raise CheckpointError(f"{path}: damaged checkpoint (its state groups are not the artifact's)")
    return Checkpoint(pos, [int(t) for t in history], arrays, set(fed), meta if isinstance(meta, dict) else {})


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
             "gib": 1 << 30, "tib": 1 << 40, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        value = float(num)
    except ValueError:
        value = -1
    unit = t[len(num):].strip()
    if unit not in units or value < 0:
        raise Ds4Error(f"--kv-cache-size {text!r}: expected a size such as 4GiB, 512MiB or 1000000")
    return int(value * units[unit])


def warn(message: str) -> None:
    print(f"ds4: warning: {message}", file=sys.stderr, flush=True)


class CheckpointStore:
    """Checkpoints of one engine's sequences by their tokens, least recently used evicted past
    `size` bytes: in memory, or (with `directory`) as files there, which a restarted process finds.
    A file that cannot be used is reported with one warning, removed, and never loaded."""

    def __init__(self, engine, tag: str = "", size: int = 4 << 30, directory=None):
        self.engine, self.tag, self.size = engine, tag, size
        self.dir = Path(directory) if directory is not None else None
        self.entries: OrderedDict[str, tuple[list[int], object]] = OrderedDict()  # key -> (tokens, Checkpoint | Path)
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._index()

    def _key(self, tokens) -> str:
        h = hashlib.sha256(f"{self.engine.identity}:{self.tag}:".encode())
        h.update(np.asarray(tokens, np.int64).tobytes())
        return h.hexdigest()[:40]

    def _prefix(self) -> str:
        return f"{self.engine.identity[:16]}-{self.tag or 'target'}-"

    def _index(self) -> None:
        """The files of this artifact, oldest use first (their modification time is their last use)."""
        mine = sorted(self.dir.glob(self._prefix() + "*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in mine:
            try:
                header = read_header(path)
                check_header(path, header, self.engine, self.tag)
            except CheckpointError as e:
                warn(f"{e}; ignored and removed")
                path.unlink(missing_ok=True)
                continue
            self.entries[path.stem[len(self._prefix()):]] = ([int(t) for t in header["history"]], path)

    def best(self, prompt, limit: int) -> tuple[list[int], object] | None:
        """The checkpoint with the most tokens that are a prefix of prompt, at most limit of them."""
        found = None
        for key, (tokens, where) in self.entries.items():
            n = len(tokens)
            if n <= limit and (found is None or n > len(found[1][0])) and list(prompt[:n]) == tokens:
                found = (key, (tokens, where))
        if found is None:
            return None
        self.entries.move_to_end(found[0])
        return found[1]

    def load(self, where) -> Checkpoint | None:
        """The checkpoint an entry names; None (with one warning, the file removed) if it is unusable."""
        if isinstance(where, Checkpoint):
            return where
        try:
            cp = read(where, self.engine, self.tag)
            os.utime(where)
            return cp
        except CheckpointError as e:
            warn(f"{e}; ignored and recomputed")
            self._drop(where)
            return None

    def add(self, cp: Checkpoint) -> None:
        if cp.nbytes > self.size or cp.pos == 0:
            return
        key = self._key(cp.history)
        if self.dir is None:
            self.entries[key] = (list(cp.history), cp)
        else:
            path = self.dir / f"{self._prefix()}{key}{SUFFIX}"
            try:
                write(path, cp, self.engine, self.tag)
            except OSError as e:
                warn(f"{path}: cannot write the checkpoint ({e.strerror or e})")
                return
            self.entries[key] = (list(cp.history), path)
        self.entries.move_to_end(key)
        self._evict()

    def _drop(self, where) -> None:
        for key, (_, w) in list(self.entries.items()):
            if w is where or w == where:
                del self.entries[key]
        if isinstance(where, Path):
            where.unlink(missing_ok=True)

    def _evict(self) -> None:
        """Least recently used first, until what is held (for a directory: every checkpoint file in it,
        of any artifact) fits the size."""
        while True:
            if self.dir is None:
                held = [(cp.nbytes, key) for key, (_, cp) in self.entries.items()]
                if sum(n for n, _ in held) <= self.size:
                    return
                del self.entries[held[0][1]]
                continue
            files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
            if sum(p.stat().st_size for p in files) <= self.size or not files:
                return
            self._drop(files[0])
