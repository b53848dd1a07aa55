"""Compile targets by name."""

from __future__ import annotations

import os

from ..errors import Ds4Error

TARGETS = {
    "llvm": "generic x86-64/aarch64 CPU code for this machine's architecture",
    "cpu": "llvm tuned for this machine's CPU (mcpu detected, e.g. AVX-512 where present)",
}


def resolve(name: str) -> tuple[str, dict]:
    """(canonical name, TVM target JSON) for a --target value."""
    from tvm.target import codegen

    if name == "llvm":
        return "llvm", {"kind": "llvm", "num-cores": os.cpu_count() or 1}
    if name == "cpu":
        return f"llvm-{codegen.llvm_get_system_cpu()}", {
            "kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": os.cpu_count() or 1}
    raise Ds4Error(f"--target {name!r} is not supported; expected one of: {', '.join(TARGETS)}")
