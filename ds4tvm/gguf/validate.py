"""Tensor tables and their validation: each family lists the tensors it reads (GGUF name, shape
in ggml order, accepted GGML types) and checks a file against the list in both directions."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

from ..errors import Ds4Error
from .reader import GGUFFile

# Type classes, after the reference engine's validator (ds4-spec §1.1, §1.3). BF16 is accepted
# wherever F16 is: upstream's refusal of BF16 dense tensors silently disabled DSpark (#468).
NORM = frozenset({QT.F32})
PLAIN = frozenset({QT.F32, QT.F16, QT.BF16})
DENSE = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q6_K})
EMBED = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0})
ROUTED = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.Q6_K, QT.IQ2_XXS,
                    QT.MXFP4})
INDEX = frozenset({QT.I32})


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # GGUF tensor name
    shape: tuple[int, ...]    # ggml order: shape[0] is the input (row) length
    types: frozenset          # accepted GGMLQuantizationType values
    optional: bool = False
    index_bound: int | None = None   # INDEX tensors: every value must lie in [0, index_bound)


def _types(types) -> str:
    return "/".join(sorted(t.name for t in types))


def check_tensor(f: GGUFFile, spec: TensorSpec) -> None:
    t = f.tensors.get(spec.name)
    if t is None:
        if spec.optional:
            return
        raise Ds4Error(f"{f.name}: missing tensor {spec.name} (expected {_types(spec.types)} "
                       f"{list(spec.shape)})")
    if t.shape != tuple(spec.shape):
        raise Ds4Error(f"{f.name}: tensor {spec.name} has shape {list(t.shape)}, expected "
                       f"{list(spec.shape)} (ggml order)")
    if t.ggml_type not in spec.types:
        raise Ds4Error(f"{f.name}: tensor {spec.name} has unsupported type {t.type_name}, expected "
                       f"one of {_types(spec.types)}")
    if spec.index_bound is not None and t.data.size:
        lo, hi = int(t.data.min()), int(t.data.max())
        if lo < 0 or hi >= spec.index_bound:
            # kernels index weights with these values: one out of range would read past a tensor
            raise Ds4Error(f"{f.name}: tensor {spec.name} holds {lo if lo < 0 else hi}, expected values in "
                           f"0..{spec.index_bound - 1}")


def check_tensors(f: GGUFFile, specs: list[TensorSpec]) -> list[str]:
    """Checks every spec against the file; returns the names of tensors the family does not use."""
    for spec in specs:
        check_tensor(f, spec)
    known = {s.name for s in specs}
    return sorted(n for n in f.tensors if n not in known)
