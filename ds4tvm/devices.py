"""Which device this machine offers for an artifact's code: probed through TVM's runtime, which
may be TVM's runtime library alone (runtime/loader.runtime_only_tvm)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import Ds4Error

if TYPE_CHECKING:
    from .artifact import Manifest


def _runtime_sidecars(kind: str) -> None:
    """With TVM's runtime alone (loader.runtime_only_tvm), TVM registers neither the built-ins of
    its extra library (sort, top-k, used by the sampling kernels) nor a GPU's device API: load the
    libraries that hold them, as a full import of TVM does."""
    import tvm
    from tvm_ffi.libinfo import load_lib_ctypes

    if not tvm.base._RUNTIME_ONLY:
        return
    lib_dir = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    for name in ("tvm_runtime_extra", f"tvm_runtime_{kind}"):
        if name not in tvm.base._LOADED_LIBS and (lib_dir / f"lib{name}.so").is_file():
            try:
                tvm.base._LOADED_LIBS[name] = load_lib_ctypes("tvm", name, "RTLD_LOCAL", extra_lib_paths=[lib_dir])
            except OSError:   # no driver here (libcuda.so.1 missing): the device probe then finds none
                pass


def probe_device(kind: str):
    """(TVM device, its architecture or None) for cpu | cuda | rocm | metal; None when absent."""
    import tvm

    _runtime_sidecars(kind)

    if kind == "cpu":
        return tvm.cpu(), None
    open_device = {"cuda": tvm.cuda, "rocm": tvm.rocm, "metal": tvm.metal}.get(kind)
    dev = open_device(0) if open_device is not None else None
    if dev is None or not dev.exist:
        return None
    if kind == "cuda":
        return dev, "sm_" + dev.compute_version.replace(".", "")
    return dev, None


KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


def rocm_arches(nodes: Path = KFD_NODES) -> list[str]:
    """The gfx names of this machine's ROCm GPUs, from the kernel driver's topology (TVM's runtime
    does not report them): each GPU node's `gfx_target_version` is major * 10000 + minor * 100 +
    stepping, written gfx{major}{minor:x}{stepping:x} (90402: gfx942, 90010: gfx90a)."""
    found = []
    for props in sorted(nodes.glob("*/properties")):
        try:
            fields = dict(line.split(None, 1) for line in props.read_text().splitlines() if " " in line)
            v = int(fields.get("gfx_target_version", "0"))
        except (OSError, ValueError):
            continue
        if v:
            found.append(f"gfx{v // 10000}{v // 100 % 100:x}{v % 100:x}")
    return found


def device_for(m: Manifest, art_dir: Path):
    """The device an artifact's code runs on here, or one line saying why it cannot run here."""
    found = probe_device(m.device)
    if found is None:
        raise Ds4Error(f"{art_dir}: holds {m.target_name} code for a {m.device} GPU; this machine has none "
                       f"(compile the GGUF for it: ds4-compile --target cpu)")
    dev, arch = found
    if m.device == "cuda" and arch not in m.arches:
        raise Ds4Error(f"{art_dir}: holds code for {', '.join(m.arches)}; this GPU is {arch} "
                       f"(ds4-compile --target cuda:{arch})")
    return dev
