"""`-m MODEL`: a package (package.py) or an artifact directory is loaded as is; a GGUF is compiled
for the host on first use and cached under ~/.cache/ds4tvm/artifacts, keyed by the GGUF's
fingerprint, the target, the bounds and the versions."""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

from .. import __version__
from ..artifact import MANIFEST, MODEL, file_fingerprint, file_sha256
from ..cache import build_once, cache_root
from ..errors import Ds4Error


def tvm_version() -> str:
    """The installed TVM's version, without importing TVM."""
    return importlib.metadata.version("apache-tvm")


def runtime_only_tvm() -> None:
    """Running compiled code needs TVM's runtime library (3 MB) and not its compiler (250 MB, about
    100 MB of it resident once imported). Takes effect only if TVM is not imported yet, and then
    for the whole process, so only callers that will not compile (the CLI, after deciding) ask."""
    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
        without_torch()


def without_torch() -> None:
    """tvm_ffi imports PyTorch whenever it is installed (for its tensor exchange, which ds4 does not
    use): 200 MB resident and 2-3 s of every process's start (of 5 s for `import tvm` on a 2-core
    Zen 3). Marking it absent makes that import fail fast; for processes that never use PyTorch
    (the CLI's), before TVM is first imported, and never where it is imported already."""
    sys.modules.setdefault("torch", None)


def open_engine(model: str | Path, target: str = "cpu", bounds=None, kv_rounding: bool = True,
                progress: bool = True, support: str | Path | None = None, lean: bool = False,
                heads: str | Path | None = None):
    """An Engine for an artifact directory, a package, or a GGUF (compiled on first use, cached).
    support: the support GGUF (--mtp FILE) to compile with, or to check an artifact against;
    heads: likewise, ONNX draft heads (--draft-onnx FILE).
    lean: when nothing needs compiling, load TVM's runtime alone (the CLI's choice; see
    runtime_only_tvm)."""
    engine = _open_engine(model, target, bounds, kv_rounding, progress, support, lean, heads)
    # Everything loaded so far lives as long as the process: out of the collector's sight, so that its
    # full collections (every few hundred decode steps) stop walking it (perf: gc_collect_main took 7%
    # of the main thread's samples in decode; 80k objects with the lean runtime, 275k with PyTorch).
    gc.collect()
    gc.freeze()
    return engine


def _open_engine(model, target, bounds, kv_rounding, progress, support, lean, heads):
    from ..artifact import Bounds
    from ..families import family_named
    from ..package import is_package, resolve_package
    from .engine import Engine

    path = Path(model)
    if is_package(path):
        if support is not None:
            raise Ds4Error(f"{path}: a package brings its own support file; drop --mtp {support}")
        if heads is not None:
            raise Ds4Error(f"{path}: a package brings its own draft heads; use a bare --draft-onnx")
        if lean:
            runtime_only_tvm()
        return Engine(*resolve_package(path))
    if path.is_dir():  # an artifact's bounds and drafter were fixed when it was compiled
        if lean:
            runtime_only_tvm()
        engine = Engine(path)
        family_named(engine.manifest.family).check_support_file(support)
        compiled = engine.manifest.weights.get("support", {}).get("gguf_path")
        if support is not None and (compiled is None or Path(compiled).resolve() != Path(support).resolve()):
            raise Ds4Error(f"{path}: the artifact was not compiled with the support file {support}")
        compiled = engine.drafters.get("onnx", {}).get("source_sha256")
        if heads is not None and compiled != file_sha256(Path(heads)):
            raise Ds4Error(f"{path}: the artifact was not compiled with the draft heads {heads}")
        return engine
    if not path.exists():
        raise Ds4Error(f"{path}: no such file or artifact directory")
    bounds = bounds or Bounds()
    if support is not None and not Path(support).is_file():
        raise Ds4Error(f"{support}: no such support file")
    if heads is not None and not Path(heads).is_file():
        raise Ds4Error(f"{heads}: no such ONNX file")
    key = json.dumps([file_fingerprint(path), os.path.getsize(path), target, bounds.max_context, bounds.max_verify,
                      bounds.prefill_chunk, bounds.max_batch, kv_rounding, tvm_version(), __version__, "int8 activations by default",
                      file_fingerprint(Path(support)) if support else None,
                      file_sha256(Path(heads)) if heads else None])
    out = cache_root() / hashlib.sha256(key.encode()).hexdigest()[:24]
    if not (out / MANIFEST).is_file():
        from ..compile.driver import CompileRequest

        def waiting():
            if progress:
                print(f"ds4: another process is compiling {path.name} for {target}: waiting for its artifact",
                      file=sys.stderr)

        req = CompileRequest(target, bounds, kv_rounding=kv_rounding, progress=progress, support=support,
                             draft_onnx=heads)
        build_once(out, (out / MANIFEST).is_file, lambda tmp: _compile(path, tmp, req, out.parent), waiting)
    elif lean:
        runtime_only_tvm()
    return Engine(out, weights={MODEL: path, **({"support": support} if support else {})})


def _compile(path: Path, into: Path, req, cache: Path) -> None:
    from ..compile.driver import compile_gguf

    t0 = time.perf_counter()
    compile_gguf(path, into, req)
    if req.progress:   # after: a file refused before compiling gets its one error line alone
        print(f"ds4: first use of {path.name}: compiled it for {req.target} in {time.perf_counter() - t0:.0f} s "
              f"(cached in {cache})", file=sys.stderr)


def verify_model(path: Path, progress: bool = True) -> list[str]:
    """`ds4 verify`: every file of an artifact or a package hashed in full against what its manifest
    (and package.json) say, and the weight files checked as the engine checks them before its first
    call. Returns what was checked, one line each; the first difference is a Ds4Error."""
    from ..artifact import Manifest
    from ..families import check_weight_files
    from ..gguf import open_gguf
    from ..package import is_package, verify_package

    path = Path(path)
    if is_package(path):
        root, meta = verify_package(path, full=True)
        lines = [f"{rel}: sha256 matches package.json" for rel in meta["files"]]
        arts = [(root / t["dir"], {role: root / rel for role, rel in meta["weights"].items()}) for t in meta["targets"]]
    else:
        lines, arts = [], [(path, None)]
    for art, weights in arts:
        m = Manifest.read(art)
        paths = m.weight_paths(art, weights)
        if weights is None:   # an artifact alone (a package's every file was hashed above)
            m.check_files(art)
            lines += [f"{art / name}: sha256 matches the manifest" for name in (m.library, m.tokenizer)]
            for role, p in paths.items():
                _full_hash(p, m.weights[role]["gguf_sha256"], progress)
                lines.append(f"{p}: sha256 matches the manifest ({role})")
        check_weight_files({role: open_gguf(p) for role, p in paths.items()}, m.n_vocab)
        lines.append(f"{art}: weights pass the engine's checks (keys, shapes, index tensors, vocabulary)")
    return lines


def _full_hash(path: Path, want: str, progress: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(f"hashing {path.name}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task("hash", total=path.stat().st_size)
        got = file_sha256(path, lambda n: bar.advance(task, n))
    if got != want:
        raise Ds4Error(f"{path}: does not match the sha256 the artifact was compiled from (changed or damaged)")
