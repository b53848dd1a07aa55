"""Sequence checkpoints: `Checkpoint` (Engine.snapshot makes one, Engine.restore takes it back), on
disk (`save_state` / `load_state`), and the store the server keeps them in. This module imports
nothing of the engine (the engine imports it).

A file is MAGIC, the header's length (8 bytes, little-endian), a JSON header, the state rows and
the sha256 of everything before it (32 bytes): the header names the format, the ds4tvm version, the
artifact (sha256 of its manifest), a tag (the drafter whose states were fed), the committed length
and tokens, the writer's meta, and each tensor's name, dtype and shape. The hash covers the header
too, so a changed token in the committed history is as damaged as a changed state row. Anything
that does not match (another artifact or version, a truncated, damaged or malformed file) is a
CheckpointError, raised before a state tensor is touched; files are created readable by their owner
only (they hold the conversation).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import Ds4Error


@dataclass
class Checkpoint:
    """A copy of a sequence at its committed length: per state tensor, the rows it needs
    (StateSpec.rows_for), in the manifest's order."""
    pos: int
    history: list
    arrays: list
    fed: set = field(default_factory=set)
    meta: dict = field(default_factory=dict)   # what its writer wants back (`ds4 run --session`: the conversation)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) + 8 * len(self.history)


MAGIC = b"DS4STATE"
FORMAT = 2   # 2: the sha256 trailer covers the whole file (1: the state rows only)
SUFFIX = ".ds4state"
_HEAD = len(MAGIC) + 8
_DIGEST = 32
_MAX_HEADER = 64 << 20
_STALE_TMP_SECONDS = 3600   # a half-written file older than this is a killed writer's


class CheckpointError(Ds4Error):
    pass


def _rows(a) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def write(path, cp: Checkpoint, engine, tag: str = "") -> Path:
    """Writes cp (a snapshot of one of engine's sequences) atomically: a reader never sees half a
    file. The file is created 0600."""
    path = Path(path)
    header = {"format": FORMAT, "ds4tvm": __version__, "artifact": engine.identity, "tag": tag, "pos": cp.pos,
              "history": [int(t) for t in cp.history], "fed": sorted(cp.fed), "meta": cp.meta,
              "states": [{"name": s.name, "dtype": s.dtype, "shape": list(a.shape)}
                         for s, a in zip(engine.state_specs, cp.arrays)]}
    raw = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            for part in (MAGIC + struct.pack("<Q", len(raw)) + raw, *map(_rows, cp.arrays)):
                h.update(part)
                f.write(part)
            f.write(h.digest())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_form(path: Path, header) -> None:
    """Every field the readers index with has the type they expect."""
    def bad(what: str):
        raise CheckpointError(f"{path}: damaged checkpoint (its header's {what})")

    if not isinstance(header, dict):
        bad("JSON is not an object")
    keys = {"format", "ds4tvm", "artifact", "tag", "pos", "history", "fed", "meta", "states"}
    if not keys <= header.keys():
        bad(f"fields lack {sorted(keys - header.keys())}")
    if header["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {str(header['format'])[:20]} is not {FORMAT}")
    for key in ("ds4tvm", "artifact", "tag"):
        if not isinstance(header[key], str):
            bad(f"{key} is not a string")
    if not _is_int(header["pos"]) or not isinstance(header["history"], list) \
            or not all(_is_int(t) for t in header["history"]):
        bad("pos or history is not integers")
    if not isinstance(header["fed"], list) or not all(isinstance(g, str) for g in header["fed"]):
        bad("fed is not a list of names")
    if not isinstance(header["meta"], dict):
        bad("meta is not an object")
    states = header["states"]
    if not isinstance(states, list) or not all(
            isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("dtype"), str)
            and isinstance(d.get("shape"), list) and all(_is_int(n) and n >= 0 for n in d["shape"]) for d in states):
        bad("states are not a list of {name, dtype, shape}")


def read_header(path) -> dict:
    """The header of a checkpoint file, checked for its form (not yet against its hash: `read`)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
            if len(head) < _HEAD or head[:len(MAGIC)] != MAGIC:
                raise CheckpointError(f"{path}: not a ds4tvm checkpoint")
            (n,) = struct.unpack("<Q", head[len(MAGIC):])
            raw = f.read(n) if n <= _MAX_HEADER else b""
        if len(raw) != n:
            raise CheckpointError(f"{path}: truncated checkpoint (its header is cut short)")
        header = json.loads(raw)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror or e})") from None
    except (ValueError, RecursionError):   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path}: damaged checkpoint (its header is not JSON)") from None
    _check_form(path, header)
    header["offset"] = _HEAD + n
    return header


def check_header(path, header: dict, engine, tag: str) -> None:
    """That the checkpoint was made for this artifact, by this ds4tvm, with this tag, and that its
    positions, tokens and states fit the artifact."""
    if header["ds4tvm"] != __version__:
        raise CheckpointError(f"{path}: written by ds4tvm {header['ds4tvm'][:20]}, this is {__version__}")
    if header["artifact"] != engine.identity:
        raise CheckpointError(f"{path}: a checkpoint of another artifact")
    if header["tag"] != tag:
        raise CheckpointError(f"{path}: made with {header['tag'][:40] or 'no drafter'}, this run uses {tag or 'none'}")
    _check_fit(path, header, engine)


def _check_fit(path: Path, header: dict, engine) -> None:
    """The positions, tokens, groups and state shapes are ones the artifact's can hold."""
    specs, states, pos, history = engine.state_specs, header["states"], header["pos"], header["history"]
    if (len(states) != len(specs) or len(history) != pos or not 0 <= pos <= engine.max_context
            or not all(0 <= t < engine.n_vocab for t in history)):
        raise CheckpointError(f"{path}: damaged checkpoint (its positions or states do not fit the artifact)")
    if not set(header["fed"]) <= {s.group for s in specs}:
        raise CheckpointError(f"{path}: damaged checkpoint (its state groups are not the artifact's)")
    for s, d in zip(specs, states):
        if d["name"] != s.name or d["dtype"] != s.dtype or d["shape"] != [s.rows_for(pos), *s.shape[1:]]:
            raise CheckpointError(f"{path}: its state {d['name'][:40]!r} is not the artifact's {s.name} "
                                  f"{s.dtype}{[s.rows_for(pos), *s.shape[1:]]}")


def read(path, engine, tag: str = "") -> Checkpoint:
    """The checkpoint in path, every byte of it checked against its sha256 trailer."""
    path = Path(path)
    header = read_header(path)
    check_header(path, header, engine, tag)
    arrays, h = [], hashlib.sha256()
    try:
        with open(path, "rb") as f:
            h.update(f.read(header["offset"]))
            for s, d in zip(engine.state_specs, header["states"]):
                n = int(np.prod(d["shape"])) * np.dtype(s.dtype).itemsize
                raw = f.read(n)
                if len(raw) != n:
                    raise CheckpointError(f"{path}: truncated checkpoint (state {s.name} is cut short)")
                h.update(raw)
                arrays.append(np.frombuffer(raw, s.dtype).reshape(d["shape"]))
            trailer = f.read(_DIGEST + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({e.strerror or e})") from None
    if len(trailer) != _DIGEST:
        what = "bytes after its checksum" if trailer[_DIGEST:] else "its checksum is cut short"
        raise CheckpointError(f"{path}: damaged checkpoint ({what})")
    if trailer != h.digest():
        raise CheckpointError(f"{path}: damaged checkpoint (checksum mismatch)")
    return Checkpoint(header["pos"], list(header["history"]), arrays, set(header["fed"]), header["meta"])


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


def _remove(path: Path) -> None:
    """Removes a file where the directory allows it (a read-only store keeps what it holds)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True
    return True


def _stale_tmp(path: Path, now: float) -> bool:
    """A half-written checkpoint (`.NAME.PID.THREAD.tmp`) whose writer is gone or long stalled."""
    parts = path.name.split(".")
    try:
        pid, age = int(parts[-3]), now - path.stat().st_mtime
    except (ValueError, IndexError, OSError):
        return False
    return pid != os.getpid() and (not _pid_alive(pid) or age > _STALE_TMP_SECONDS)


def _files(directory: Path, pattern: str) -> list[tuple[Path, int, float]]:
    """(path, size, mtime) of the files matching pattern, oldest first; ones removed meanwhile skipped."""
    out = []
    for p in directory.glob(pattern):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((p, st.st_size, st.st_mtime))
    return sorted(out, key=lambda x: x[2])


class CheckpointStore:
    """Checkpoints of one engine's sequences by their tokens, least recently used evicted past
    `size` bytes: in memory, or (with `directory`) as files there, which a restarted process finds.
    A file that cannot be used is reported with one warning, removed (where the directory is
    writable), and never loaded; a read-only or full directory is used as far as it can be, and the
    half-written files of killed writers are removed. Its methods may be called from several
    threads (the server's workers)."""

    def __init__(self, engine, tag: str = "", size: int = 4 << 30, directory=None):
        self.engine, self.tag, self.size = engine, tag, size
        self._lock = threading.RLock()
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
        self._sweep()
        for path, _, _ in _files(self.dir, self._prefix() + "*" + SUFFIX):
            try:
                header = read_header(path)
                check_header(path, header, self.engine, self.tag)
            except CheckpointError as e:
                warn(f"{e}; ignored and removed")
                _remove(path)
                continue
            self.entries[path.stem[len(self._prefix()):]] = ([int(t) for t in header["history"]], path)

    def best(self, prompt, limit: int) -> tuple[list[int], object] | None:
        """The checkpoint with the most tokens that are a prefix of prompt, at most limit of them."""
        with self._lock:
            return self._best(prompt, limit)

    def _best(self, prompt, limit: int) -> tuple[list[int], object] | None:
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
        with self._lock:
            return self._load_file(where)

    def _load_file(self, where: Path) -> Checkpoint | None:
        try:
            cp = read(where, self.engine, self.tag)
        except CheckpointError as e:
            warn(f"{e}; ignored and recomputed")
            self._drop(where)
            return None
        try:
            os.utime(where)   # its last use, for eviction
        except OSError:
            pass   # a read-only store: the order of this run's entries still holds
        return cp

    def add(self, cp: Checkpoint) -> None:
        if cp.nbytes > self.size or cp.pos == 0:
            return
        with self._lock:
            self._add(cp)

    def _add(self, cp: Checkpoint) -> None:
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
            _remove(where)

    def _sweep(self) -> None:
        now = time.time()
        for path, _, _ in _files(self.dir, ".*.tmp"):
            if _stale_tmp(path, now):
                _remove(path)

    def _evict(self) -> None:
        """Least recently used first, until what is held (for a directory: every checkpoint file in it,
        of any artifact) fits the size."""
        if self.dir is not None:
            self._sweep()
        while True:
            if self.dir is None:
                held = [(cp.nbytes, key) for key, (_, cp) in self.entries.items()]
                if sum(n for n, _ in held) <= self.size:
                    return
                del self.entries[held[0][1]]
                continue
            files = _files(self.dir, "*" + SUFFIX)
            held = sum(size for _, size, _ in files + _files(self.dir, ".*.tmp"))
            if held <= self.size or not files:
                return
            self._drop(files[0][0])
            if files[0][0].exists():
                return   # a read-only directory: nothing can be evicted


def save_state(engine, path, tag: str = "", meta: dict | None = None) -> Path:
    """Writes the engine's attached sequence to path; tag: what else it needs to be resumed as it
    was (the drafter whose states it fed); meta: JSON that load_state returns."""
    cp = engine.snapshot()
    cp.meta = meta or {}
    return write(path, cp, engine, tag)


def load_state(engine, path, tag: str = "") -> dict:
    """Restores a sequence save_state wrote for this artifact (and tag) and returns its meta;
    anything else is a CheckpointError, with the attached sequence untouched."""
    cp = read(path, engine, tag)
    engine.restore(cp)
    return cp.meta
