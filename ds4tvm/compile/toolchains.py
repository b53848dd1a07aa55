"""What a GPU target needs on the build machine, found (never at hard-coded paths) and set up.

CUDA: TVM compiles device code ahead of time only when its CUDA runtime library loads, and that
library needs `libcuda.so.1` (the driver) and `libcudart.so.13`. A build machine has no driver, so
a stub exporting the driver symbols TVM's runtime imports is built with gcc into the cache and
preloaded (RTLD_GLOBAL, before TVM is imported); the stub is never shipped. nvcc then writes one
fatbin holding SASS for every architecture of the target.

ROCm: TVM links the AMD code object with `ld.lld-<its LLVM major>` and the ROCm device library
bitcode (ocml, ockl), found under $ROCM_PATH, /opt/rocm or the Debian multiarch directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from ..errors import Ds4Error

# The driver symbols libtvm_runtime_cuda.so imports (`nm -D --undefined-only`); each returns
# CUDA_ERROR_NO_DEVICE (100).
_DRIVER_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString",
                   "cuLaunchKernelEx", "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload",
                   "cuTensorMapEncodeTiled")


def find_nvcc() -> Path:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file():
            return Path(candidate) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    if found is None:
        raise Ds4Error("cuda targets need nvcc (CUDA 13) on PATH or in $CUDA_HOME/bin")
    return Path(found)


def _cuda_root(nvcc: Path) -> Path:
    """The toolkit directory (nvcc may be a wrapper script: ask nvcc itself)."""
    try:
        out = subprocess.run([str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:
                return Path(line.split("TOP=", 1)[1].strip()).resolve()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return nvcc.resolve().parent.parent


def _find_cudart(root: Path) -> Path:
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        p = root / sub / "libcudart.so.13"
        if p.exists():
            return p
    raise Ds4Error(f"cuda targets need libcudart.so.13 from CUDA 13; not found under {root}")


def _driver_stub(cache: Path) -> Path:
    stub = cache / "libcuda.so.1"
    if stub.exists():
        return stub
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / "stub.c"
    src.write_text("".join(f"int {s}(void) {{ return 100; }}\n" for s in _DRIVER_SYMBOLS))
    tmp = cache / f"libcuda.so.1.{os.getpid()}"
    r = subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Ds4Error(f"building the CUDA driver stub with gcc failed: {r.stderr.strip()[:200]}")
    tmp.replace(stub)
    return stub


def prepare_cuda() -> None:
    """Makes TVM's CUDA runtime loadable on a machine without a GPU. Must run before `import tvm`:
    TVM loads its CUDA runtime at import, or never."""
    if "tvm" in sys.modules:
        import tvm

        if not tvm.runtime.enabled("cuda"):
            raise Ds4Error("cuda targets: TVM was imported before the CUDA toolchain was set up; compile in a "
                           "fresh process (ds4-compile does)")
        return
    nvcc = find_nvcc()
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)   # a real driver: nothing to stub
    except OSError:
        from ..cache import cache_root

        ctypes.CDLL(str(_find_cudart(_cuda_root(nvcc))), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(_driver_stub(cache_root().parent / "cuda-stub")), mode=ctypes.RTLD_GLOBAL)
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    os.environ["PATH"] = f"{nvcc.parent}{os.pathsep}{os.environ.get('PATH', '')}"


@contextlib.contextmanager
def cuda_fatbin(arches: tuple[str, ...]):
    """While compiling: nvcc writes one fatbin with SASS for each architecture."""
    import tvm_ffi
    from tvm.support import nvcc

    flags = [f for a in arches for f in ("-gencode", f"arch=compute_{a[3:]},code=sm_{a[3:]}")]

    def compile_all(code):
        return nvcc.compile_cuda(code, target_format="fatbin", arch=flags, compiler="nvcc")

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_all, override=True)
    try:
        yield
    finally:
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", nvcc.tvm_callback_cuda_compile, override=True)


def prepare_rocm() -> None:
    from tvm.target import codegen

    lld = f"ld.lld-{codegen.llvm_version_major()}"
    if shutil.which(lld) is None:
        raise Ds4Error(f"rocm targets need {lld} (TVM's LLVM links the code object; Debian: apt-get install "
                       f"lld-{codegen.llvm_version_major()})")
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm", f"/usr/lib/{multiarch}"):
        if root and (Path(root) / "amdgcn" / "bitcode" / "ocml.bc").is_file():
            os.environ["ROCM_PATH"] = root   # TVM looks for amdgcn/bitcode under it
            return
    raise Ds4Error("rocm targets need the ROCm device libraries (amdgcn/bitcode/ocml.bc under $ROCM_PATH, "
                   "/opt/rocm or /usr/lib/<multiarch>; Debian: apt-get install rocm-device-libs)")


def prepare(device: str) -> None:
    """What compiling for `device` needs, set up (for CUDA: before TVM is imported)."""
    if device == "cuda":
        prepare_cuda()
    elif device == "rocm":
        prepare_rocm()
