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
    """Hand-written kernels as parsed TIR (kernels/cpu.py)."""
    return _base() / "kernels"


def entries() -> list[dict]:
    """What `ds4 list` shows: each compiled artifact (first use of a GGUF) and unpacked package in
    the cache, newest first: kind, key (its folder name), what it was made from, target, bytes on
    disk, last modification time."""
    import json

    out = []
    for kind, root in (("artifact", cache_root()), ("package", _base() / "packages")):
        for d in sorted(root.glob("*")) if root.is_dir() else []:
            if not d.is_dir() or d.name.endswith(".tmp"):
                continue
            try:
                meta = json.loads((d / ("manifest.json" if kind == "artifact" else "package.json")).read_text())
            except (OSError, ValueError):
                meta = {}
            source = (meta.get("weights", {}).get("model", {}).get("gguf_path") if kind == "artifact"
                      else meta.get("name"))
            target = meta.get("target_name") if kind == "artifact" else \
                ",".join(t.get("name", "?") for t in meta.get("targets", []))
            size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
            out.append({"kind": kind, "key": d.name, "source": source, "family": meta.get("family"),
                        "target": target, "bytes": size, "modified": d.stat().st_mtime, "path": str(d)})
    return sorted(out, key=lambda e: -e["modified"])


def build_once(entry: Path, built, build, on_wait=None) -> None:
    """A cache entry made by build(folder) unless built() already holds, one process at a time (an
    flock, which the OS releases if the holder dies, on a file under the cache's locks/, so that the
    entries' folders hold entries only): two first uses of one model compile it once, the second
    waiting for the first's artifact instead of spending minutes on a copy it would throw away
    (on_wait() is called once if it waits). build writes into a folder of this process's, renamed
    to entry once complete: a reader never sees half an entry."""
    import fcntl
    import hashlib
    import shutil

    locks = _base() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(Path(entry).resolve()).encode()).hexdigest()[:24]
    with open(locks / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        if built():   # the process waited for made it
            return
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            shutil.rmtree(entry, ignore_errors=True)   # an incomplete or outdated one
            tmp.rename(entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
