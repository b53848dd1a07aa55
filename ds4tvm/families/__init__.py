"""Model families, keyed by `general.architecture`.

A family is data plus a module: a `Config` read from GGUF metadata, a tensor table (GGUF name,
ggml shape, accepted types), and later the model graph. Nothing outside `families/` switches on a
family name; new families register here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import Ds4Error
from ..gguf.reader import GGUFFile
from ..gguf.validate import TensorSpec, check_tensors


@dataclass(frozen=True)
class Family:
    name: str                                       # package name under ds4tvm/families
    architecture: str                               # general.architecture
    role: str                                       # "target" or "draft"
    config_from_gguf: Callable[[GGUFFile], Any]     # -> Config with n_layers, n_embd, n_vocab
    tensor_specs: Callable[[Any], list[TensorSpec]]


def _registry() -> dict[str, Family]:
    from . import deepseek4, dspark

    return {f.architecture: f for f in (deepseek4.FAMILY, dspark.FAMILY)}


REGISTRY: dict[str, Family] = _registry()


def family_for(f: GGUFFile) -> Family:
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


def load_model(f: GGUFFile) -> LoadedModel:
    fam = family_for(f)
    cfg = fam.config_from_gguf(f)
    unused = check_tensors(f, fam.tensor_specs(cfg))
    return LoadedModel(f, fam, cfg, unused)
