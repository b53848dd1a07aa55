"""Model packages: one self-describing directory or `.tar` holding the compiled artifact for one or
more targets, the GGUF weight files (the model and any support files, one per role of the
manifest), the tokenizer and chat template data, and `package.json` with the sha256 of every file
and a content hash over itself.

    package.json
    weights/<role>/<file>.gguf
    targets/<target name>/{manifest.json, lib-<target>.so, tokenizer.json}

Loading checks every file against its hash (a file that passed once is not hashed again while its
size, mtime and inode stay the same), picks the target this machine runs, and binds the packaged
weights. A `.tar` is unpacked once into the cache, keyed by its content hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from . import __version__
from .artifact import MANIFEST, Manifest, file_sha256, read_json_object, weight_file
from .errors import Ds4Error

PACKAGE = "package.json"
FORMAT = "ds4tvm-package"
VERSION = 2   # 2: weights/<role>/, any number of weight files


def is_package(path: Path) -> bool:
    path = Path(path)
    return (path / PACKAGE).is_file() if path.is_dir() else (path.suffix == ".tar" and path.is_file())


def content_hash(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "content_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def host_machine() -> str:
    return platform.machine()


def _place(src: Path, dst: Path) -> None:
    """Weights are large: a hard link when src and dst share a file system, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _hashes(m: Manifest) -> dict[str, str]:
    return {role: w["gguf_sha256"] for role, w in m.weights.items()}


def build_package(artifacts: list[Path], out: Path, progress: bool = False) -> Path:
    """Bundles compiled artifacts (of one model, one per target) and their GGUFs into `out`: a
    directory, or a `.tar` file when out ends in .tar."""
    manifests = [Manifest.read(a) for a in artifacts]
    first = manifests[0]
    for m, a in zip(manifests, artifacts):
        if _hashes(m) != _hashes(first):
            raise Ds4Error(f"{a}: was compiled from other weights than {artifacts[0]}; a package holds one model")
    names = [m.target_name for m in manifests]
    if len(set(names)) != len(names):
        raise Ds4Error(f"--target: each target may appear once in a package, got {', '.join(names)}")
    out = Path(out)
    as_tar = out.suffix == ".tar"
    stage = out.with_name(out.name + ".staging") if as_tar else out
    if stage.exists() and any(stage.iterdir()):
        raise Ds4Error(f"{stage}: exists and is not empty; remove it or choose another --package path")
    stage.mkdir(parents=True, exist_ok=True)
    weights, known = {}, {}
    for role, ident in first.weights.items():
        weights[role] = f"weights/{role}/{Path(ident['gguf_path']).name}"
        _place(weight_file(artifacts[0], ident), stage / weights[role])
        known[weights[role]] = (ident["gguf_size"], ident["gguf_sha256"])   # GGUF hashes: from compile time
    targets = []
    for m, a in zip(manifests, artifacts):
        d = f"targets/{m.target_name}"
        (stage / d).mkdir(parents=True, exist_ok=True)
        for name in (MANIFEST, m.library, m.tokenizer):
            shutil.copyfile(Path(a) / name, stage / d / name)
        targets.append({"name": m.target_name, "dir": d, "device": m.device, "arches": m.arches,
                        "machine": host_machine() if m.device == "cpu" else None, "mcpu": m.target.get("mcpu")})
    files = {}
    for p in sorted(stage.rglob("*")):
        if p.is_file() and p.name != PACKAGE:
            rel = p.relative_to(stage).as_posix()
            size, sha = known.get(rel) or (p.stat().st_size, file_sha256(p))
            files[rel] = {"size": size, "sha256": sha}
    meta = {"format": FORMAT, "version": VERSION, "name": Path(first.model["gguf_path"]).stem, "family": first.family,
            "architecture": first.architecture, "ds4tvm_version": __version__, "tvm_version": first.tvm_version,
            "weights": weights, "targets": targets, "files": files}
    meta["content_sha256"] = content_hash(meta)
    (stage / PACKAGE).write_text(json.dumps(meta, indent=1))
    _verify(stage, meta, full=True)   # the copies are what the hashes say
    if as_tar:
        tmp = out.with_name(out.name + ".tmp")
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(stage / PACKAGE, PACKAGE)   # first, so readers find it without scanning
            for rel in files:
                tar.add(stage / rel, rel)
        tmp.replace(out)
        shutil.rmtree(stage)
    return out


def read_meta(root: Path, source: Path) -> dict:
    return check_meta(read_json_object(root / PACKAGE, PACKAGE), source)


def check_meta(meta, source: Path) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise Ds4Error(f"{source}: not a ds4tvm package ({PACKAGE} has no format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise Ds4Error(f"{source}: package version {meta.get('version')} is not {VERSION}; rebuild it with this "
                       f"ds4tvm")
    for key, kind in (("weights", dict), ("targets", list), ("files", dict), ("content_sha256", str)):
        if not isinstance(meta.get(key), kind):
            raise Ds4Error(f"{source}: {PACKAGE} field {key!r} is missing or not a {kind.__name__}")
    if not all(isinstance(t, dict) and isinstance(t.get("dir"), str) and isinstance(t.get("name"), str)
               for t in meta["targets"]) or not all(isinstance(v, str) for v in meta["weights"].values()) \
            or not all(isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                       for v in meta["files"].values()):
        raise Ds4Error(f"{source}: {PACKAGE} has a malformed target, weight or file entry")
    if content_hash(meta) != meta["content_sha256"]:
        raise Ds4Error(f"{source}: {PACKAGE} does not match its content_sha256 (modified or corrupted)")
    for rel in list(meta["weights"].values()) + [t.get("dir", "") + "/" + MANIFEST for t in meta["targets"]]:
        if rel not in meta["files"]:
            raise Ds4Error(f"{source}: {PACKAGE} refers to {rel}, which it does not list")
    return meta


def _stamp_dir() -> Path:
    from .cache import cache_root

    return cache_root().parent / "verified"


def _verify(root: Path, meta: dict, full: bool = False) -> None:
    """Every listed file exists with its size and sha256; files hashed before (same path, size,
    mtime, ctime and inode: a file rewritten in place changes its ctime, which no one can set back)
    are trusted without reading them again."""
    stamps = _stamp_dir()
    for rel, want in meta["files"].items():
        p = root / rel
        if ".." in Path(rel).parts or not p.is_file():
            raise Ds4Error(f"{root}: {rel} is missing from the package")
        st = p.stat()
        if st.st_size != want["size"]:
            raise Ds4Error(f"{root}: {rel} has {st.st_size} bytes; package.json says {want['size']}")
        key = hashlib.sha256(json.dumps([str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                                         want["sha256"]]).encode()).hexdigest()
        if not full and (stamps / key).exists():
            continue
        if file_sha256(p) != want["sha256"]:
            raise Ds4Error(f"{root}: {rel} does not match its sha256 in package.json (modified or corrupted)")
        stamps.mkdir(parents=True, exist_ok=True)
        (stamps / key).touch()


def _unpack(tar_path: Path) -> Path:
    from .cache import cache_root

    try:
        with tarfile.open(tar_path) as tar:
            f = tar.extractfile(PACKAGE)
            meta = check_meta(json.loads(f.read()) if f else None, tar_path)
            out = cache_root().parent / "packages" / meta["content_sha256"][:24]
            if (out / PACKAGE).is_file():
                return out
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            names = set(meta["files"]) | {PACKAGE}
            members = [m for m in tar.getmembers() if m.name in names]
            tar.extractall(tmp, members=members, filter="data")
    except (tarfile.TarError, KeyError, json.JSONDecodeError, OSError) as e:
        raise Ds4Error(f"{tar_path}: not a readable ds4tvm package tar ({e})") from None
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    try:
        _verify(out, meta, full=True)
    except Ds4Error:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def host_cpu() -> str:
    """LLVM's name for this CPU (what `-mcpu` a package's CPU target must have been built for).
    Only TVM's compiler library can ask LLVM; a process that loaded TVM's runtime alone asks a
    child process once and keeps the answer in the cache, keyed by what /proc/cpuinfo says."""
    import tvm

    if not tvm.base._RUNTIME_ONLY:
        from tvm.target import codegen

        return codegen.llvm_get_system_cpu()
    from .cache import cache_root

    try:   # the identifying lines only: "cpu MHz" changes from one read to the next
        cpuinfo = "\n".join(sorted({line for line in Path("/proc/cpuinfo").read_text().splitlines()
                                    if line.split(":")[0].strip() in ("vendor_id", "cpu family", "model",
                                                                      "model name", "flags")}))
    except OSError:
        cpuinfo = platform.processor()
    key = hashlib.sha256(f"{cpuinfo}{host_machine()}{tvm.__version__}".encode()).hexdigest()[:16]
    memo = cache_root().parent / "host-cpu" / key
    if memo.is_file():
        return memo.read_text().strip()
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    r = subprocess.run([sys.executable, "-c", "from tvm.target import codegen; print(codegen.llvm_get_system_cpu())"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0 or not r.stdout.strip():
        raise Ds4Error(f"could not ask LLVM for this machine's CPU name: {r.stderr.strip()[-300:]}")
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(r.stdout.strip())
    return r.stdout.strip()


def pick_target(meta: dict, source: Path) -> dict:
    """The package's target this machine runs: a GPU target for the GPU here, else the one built for
    this CPU, else generic code for this architecture."""
    from .devices import probe_device

    cpu, machine = host_cpu(), host_machine()

    def rank(t: dict) -> int:   # 0: cannot run here
        if t.get("device") == "cpu":
            if t.get("machine") != machine or t.get("mcpu") not in (None, cpu):
                return 0
            return 2 if t.get("mcpu") else 1
        found = probe_device(t.get("device", ""))
        if found is None or (t.get("device") == "cuda" and found[1] not in t.get("arches", [])):
            return 0
        return 3

    best = max(meta["targets"], key=rank, default=None)
    if best is None or rank(best) == 0:
        have = ", ".join(f"{t.get('name')} ({t.get('device')}, {t.get('machine') or ','.join(t.get('arches') or [])})"
                         for t in meta["targets"])
        raise Ds4Error(f"{source}: has no target for this machine ({machine}, CPU {cpu}, no GPU target matches); "
                       f"it holds: {have}")
    return best


def _check_listed(root: Path, meta: dict, source: Path) -> None:
    """Every file a target's artifact uses (its manifest, library and tokenizer) is listed, so hashed."""
    for t in meta["targets"]:
        d = t["dir"]
        m = Manifest.read(root / d)
        for name in (MANIFEST, m.library, m.tokenizer):
            if f"{d}/{name}" not in meta["files"]:
                raise Ds4Error(f"{source}: {PACKAGE} does not list {d}/{name}, which its target {t.get('name')} "
                               f"uses; rebuild the package")


def verify_package(path: Path, full: bool = False) -> tuple[Path, dict]:
    """The package's root and meta after checking every file against its hash (a .tar is unpacked
    into the cache once); full: hash every file again, whatever was verified before."""
    path = Path(path)
    root = _unpack(path) if path.is_file() else path
    meta = read_meta(root, path)
    _verify(root, meta, full=full)
    _check_listed(root, meta, path)
    return root, meta


def resolve_package(path: Path) -> tuple[Path, dict[str, Path]]:
    """The artifact directory of the package's target for this machine and its weight files by
    role, after checking every file against its hash."""
    root, meta = verify_package(path)
    target = pick_target(meta, path)
    return root / target["dir"], {role: root / rel for role, rel in meta["weights"].items()}
