"""Model families, keyed by `general.architecture`: the contract between a family and the
family-blind pipeline.

A family is data plus a module. Its `Family` entry says how to read a config from GGUF metadata,
which tensors it expects (one or more name tables), how to build its TVM module with the state and
function specs the runtime drives it by, which weights come from which file, the bounds it allows
and prefers, the drafters it offers and the flags that enable them, its tool-call syntax and its
converter. `compile/`, `runtime/` (outside `runtime/drafters/`), `server/`, `schedules/`,
`artifact.py` and `package.py` use these entries and name no family; a new family adds a package
here and one line in `_registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..artifact import MODEL
from ..errors import Ds4Error
from ..gguf.reader import GGUFFile
from ..gguf.validate import check_tensors
from .contract import Build, BuildRequest, DraftSpec, Family, load_attr, module_build, nextn_speculation

__all__ = ["Build", "BuildRequest", "DraftSpec", "Family", "load_attr", "module_build", "nextn_speculation"]


def _registry() -> dict[str, Family]:
    from . import deepseek4, deepseek4_mtp, dspark, glm5next, qwen4exp

    return {f.architecture: f for f in (deepseek4.FAMILY, dspark.FAMILY, deepseek4_mtp.FAMILY, glm5next.FAMILY,
                                        qwen4exp.FAMILY)}


REGISTRY: dict[str, Family] = _registry()


def family_named(name: str) -> Family:
    for fam in REGISTRY.values():
        if fam.name == name:
            return fam
    raise Ds4Error(f"family '{name}' is not part of this ds4tvm; expected one of "
                   f"{', '.join(sorted(f.name for f in REGISTRY.values()))}")


def family_for(f: GGUFFile) -> Family:
    for fam in REGISTRY.values():
        if fam.claims is not None and fam.claims(f):
            return fam
    fam = REGISTRY.get(f.architecture)
    if fam is None:
        raise Ds4Error(f"{f.name}: architecture '{f.architecture}' is not supported; expected one of "
                       f"{', '.join(sorted(REGISTRY))}")
    return fam


@dataclass
class LoadedModel:
    """A validated GGUF: its family, config and the tensors the family does not read."""

    gguf: GGUFFile
    family: Family
    config: Any
    unused_tensors: list[str]


def tensor_types(f: GGUFFile) -> dict:
    from gguf import GGMLQuantizationType as QT

    return {name: QT(t.ggml_type) for name, t in f.tensors.items()}


def load_model(f: GGUFFile) -> LoadedModel:
    fam = family_for(f)
    cfg = fam.config_from_gguf(f)
    unused = check_tensors(f, fam.tensor_specs(cfg))
    return LoadedModel(f, fam, cfg, unused)


def check_weight_files(files: dict[str, GGUFFile], n_vocab: int) -> None:
    """What the engine checks of its weight files before the first call, as the compiler did: the
    keys, every tensor's shape and type, every index tensor within its range (read in full: they are
    small), and the model's vocabulary against the manifest's. A file changed past its fingerprint,
    or an edited manifest, then cannot put an out-of-range index into a kernel."""
    for role, f in files.items():
        try:
            family_for(f)
        except Ds4Error:
            if role == MODEL:
                raise
            continue   # a file the compiler wrote into the artifact (ONNX heads' weights: no index tensors)
        m = load_model(f)
        if role == MODEL and m.config.n_vocab != n_vocab:
            raise Ds4Error(f"{f.name}: has a vocabulary of {m.config.n_vocab} tokens, the artifact's manifest "
                           f"says {n_vocab}")
