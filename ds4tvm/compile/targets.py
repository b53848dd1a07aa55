"""Compile targets: `--target` values, what TVM target each is, and what each needs.

    llvm | cpu                     this machine's CPU (generic, or tuned for its micro-architecture)
    cuda:sm_90 | cuda:sm_80,sm_90  NVIDIA; one fatbin with SASS for every architecture listed
    rocm:gfx942                    AMD; one code object for the gfx named
    metal                          Apple silicon; a .tar (MSL source + arm64 host objects) to link on the Mac
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import Ds4Error

CUDA_ARCHES = {"sm_75": "Turing (T4)", "sm_80": "Ampere (A100)", "sm_86": "Ampere (RTX 30xx, A10)",
               "sm_89": "Ada (RTX 40xx, L4)", "sm_90": "Hopper (H100, H200)", "sm_100": "Blackwell (B200)",
               "sm_120": "Blackwell (RTX 50xx)", "sm_121": "Blackwell (DGX Spark GB10)"}
ROCM_ARCHES = {"gfx90a": "CDNA2 (MI200)", "gfx942": "CDNA3 (MI300)", "gfx1100": "RDNA3 (RX 7900)",
               "gfx1151": "RDNA3.5 (Strix Halo)"}

# (value, what it is for, what the build machine needs)
LISTED = [
    ("llvm", "any CPU of this machine's architecture (generic code)", "gcc"),
    ("cpu", "this machine's CPU micro-architecture (kernels shaped for its AVX-512, AVX2 or narrower vectors)", "gcc"),
    ("cuda:sm_80", "NVIDIA A100", "nvcc (CUDA 13); no GPU or driver"),
    ("cuda:sm_90", "NVIDIA H100 / H200", "nvcc (CUDA 13); no GPU or driver"),
    ("cuda:sm_121", "NVIDIA DGX Spark (GB10)", "nvcc (CUDA 13); no GPU or driver"),
    ("cuda:sm_80,sm_90", "A100 and H100/H200 from one artifact (one fatbin)", "nvcc (CUDA 13)"),
    ("rocm:gfx942", "AMD MI300", "ld.lld-<TVM's LLVM major> and ROCm device libraries "
                                 "(Debian: lld-22 rocm-device-libs)"),
    ("rocm:gfx1151", "AMD Strix Halo", "as rocm:gfx942"),
    ("metal", "Apple silicon (the .tar is linked on the Mac at first load)", "nothing extra"),
]


@dataclass(frozen=True)
class Target:
    name: str                     # canonical: file names, manifests, packages
    device: str                   # cpu | cuda | rocm | metal
    tvm: dict                     # the TVM target (JSON form)
    arches: tuple[str, ...] = field(default=())

    @property
    def threads(self) -> int:
        """The cores a CPU target's kernels are compiled for."""
        return int(self.tvm.get("num-cores", 1))

    @property
    def records_functions(self) -> bool:
        """Whether the pipeline records each exported function's kernels as one replayable graph
        (CUDA graphs: schedules/graphs.py)."""
        return self.device == "cuda"

    def blocking(self):
        """A CPU target's register blocking, by the widest float vectors its -mcpu has (kernels/cpu.py)."""
        import tvm

        from ..kernels.cpu import blocking_for

        return blocking_for(tvm.target.Target(self.tvm))

    def int8_dot(self) -> str | None:
        """The int8 dot instruction a CPU target's -mcpu has (kernels/cpu_int8.py): AVX-512 VNNI's or
        AVX2's; None where it has neither."""
        import tvm

        from ..kernels.cpu import int8_dot_for

        return int8_dot_for(tvm.target.Target(self.tvm))

    def int8_by_default(self) -> bool:
        """Whether a compile that does not say quantizes the CPU linears' inputs to int8: on every
        CPU target with an int8 dot instruction. On the trained demo pair the int8 build's
        next-token distributions stay within KL 0.0003 of the float build's (top-1 99.4%, perplexity
        65.069 against 65.073; BENCHMARKS.md), the threshold being KL under 0.01 and top-1 at least
        98%, what separates 8-bit activations (Q8_0-like rounding) from a broken kernel; decode
        reads the same weights with a fraction of the float kernels' work per byte."""
        return self.device == "cpu" and self.int8_dot() is not None

    def forms(self, int8_activations: bool = False, gpu_forms: bool | None = None):
        """Which kernels the model's blocks emit here (kernels/forms.py): a CPU target's hand-written
        linears (with int8 inputs where asked), a GPU target's GPU forms. gpu_forms=True exports a
        CPU target in the GPU forms, their loops serial (their numerics checked on the CPU)."""
        from ..kernels.forms import CpuLinears, Forms

        cpu = self.device == "cpu"
        if gpu_forms if gpu_forms is not None else not cpu:
            return Forms(gpu=True, on_gpu=not cpu)
        return Forms(cpu_linears=CpuLinears(self.threads, self.blocking(), self.int8_dot() if int8_activations else None))

    @property
    def library(self) -> str:
        # Metal host objects are Mach-O: they cannot be linked here, so the library stays a tarball.
        return f"lib-{self.name}.tar" if self.device == "metal" else f"lib-{self.name}.so"


def _valid() -> str:
    return ", ".join(v for v, _, _ in LISTED) + " (cuda:sm_XX[,sm_YY...] with " + ", ".join(CUDA_ARCHES) + \
        "; rocm:gfxNNN with " + ", ".join(ROCM_ARCHES) + ")"


OPT_LEVEL_ENV = "DS4_LLVM_OPT_LEVEL"


def llvm_json(attrs: dict | None = None) -> dict:
    """The JSON of an LLVM target (a CPU target, a GPU target's host) with attrs, at the
    optimisation level DS4_LLVM_OPT_LEVEL asks for (0-3; unset: LLVM's default, 3). That variable
    is a developer's knob: the test suite builds its tiny models at 1, which spends less time in
    LLVM and computes the same numbers (no fast-math at any level), its code running slower;
    artifacts users run keep the default."""
    value = os.environ.get(OPT_LEVEL_ENV)
    if value is not None and value.strip() not in ("0", "1", "2", "3"):
        raise Ds4Error(f"{OPT_LEVEL_ENV}={value!r}: expected an LLVM optimisation level, 0, 1, 2 or 3")
    return {"kind": "llvm", **(attrs or {}), **({"opt-level": int(value)} if value is not None else {})}


def resolve(value: str) -> Target:
    """The Target of a --target value; a malformed or unknown one is one line listing the valid ones."""
    kind, _, rest = value.partition(":")
    if value == "llvm":
        return Target("llvm", "cpu", llvm_json({"num-cores": os.cpu_count() or 1}))
    if value == "cpu":
        from tvm.target import codegen

        mcpu = codegen.llvm_get_system_cpu()
        return Target(f"llvm-{mcpu}", "cpu", llvm_json({"mcpu": mcpu, "num-cores": os.cpu_count() or 1}))
    if value == "metal":
        return Target("metal", "metal", {"kind": "metal", "max_threads_per_block": 256, "thread_warp_size": 1,
                                         "host": llvm_json({"mtriple": "arm64-apple-macos"})})
    if kind == "cuda" and rest:
        arches = tuple(rest.split(","))
        if all(a in CUDA_ARCHES for a in arches) and len(set(arches)) == len(arches):
            arches = tuple(sorted(arches, key=lambda a: int(a[3:])))
            # the code follows the lowest architecture; the fatbin holds SASS for each
            return Target("cuda-" + "+".join(arches), "cuda",
                          # 48 KB: the shared memory a block may use on every architecture without opting in
                          {"kind": "cuda", "arch": arches[0], "max_shared_memory_per_block": 49152,
                           "host": llvm_json()}, arches)
    if kind == "rocm" and rest in ROCM_ARCHES:
        return Target(f"rocm-{rest}", "rocm", {"kind": "rocm", "mcpu": rest, "host": llvm_json()}, (rest,))
    raise Ds4Error(f"--target {value!r} is not a target; expected one of: {_valid()}")


def detect(value: str, kfd_nodes=None) -> str:
    """`auto`, or a bare `cuda` / `rocm`: the target of the device this machine has (auto: a CUDA
    GPU's architecture, else a ROCm GPU's (its gfx name from the kernel driver, devices.rocm_arches),
    else this CPU); any other value as given."""
    if value not in ("auto", "cuda", "rocm"):
        return value
    from ..devices import KFD_NODES, probe_device, rocm_arches

    found = probe_device("cuda") if value in ("auto", "cuda") else None
    if found is not None and found[1] in CUDA_ARCHES:
        return f"cuda:{found[1]}"
    if found is not None:
        raise Ds4Error(f"--target {value}: this GPU is {found[1]}, which ds4tvm does not compile for; expected one "
                       f"of {', '.join(CUDA_ARCHES)}")
    gfx = rocm_arches(kfd_nodes or KFD_NODES) if value in ("auto", "rocm") else []
    if gfx and gfx[0] in ROCM_ARCHES:
        return f"rocm:{gfx[0]}"
    if gfx:
        raise Ds4Error(f"--target {value}: this GPU is {gfx[0]}, which ds4tvm does not compile for; expected one "
                       f"of {', '.join(ROCM_ARCHES)}")
    if value == "auto":
        return "cpu"
    what = "this machine has no ROCm GPU" if value == "rocm" else "this machine has no CUDA device"
    raise Ds4Error(f"--target {value}: {what}; name the target: {_valid()}")


def listing() -> str:
    width = max(len(v) for v, _, _ in LISTED)
    lines = [f"{v:<{width}}  {what}; needs {needs}" for v, what, needs in LISTED]
    lines.append(f"{'':<{width}}  also cuda:" + "|".join(CUDA_ARCHES) + ", rocm:" + "|".join(ROCM_ARCHES))
    return "\n".join(lines)
