"""What every family's `ds4 convert` shares (the converters live in their families): the
--type names, the checkpoint directory's checks, the text model's tensors of a transformers
checkpoint, and the GGML type each tensor gets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import Ds4Error
from .validate import EMBED, NORM, PLAIN, ROUTED

TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
EXPERT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "mxfp4": QT.MXFP4}

class TextCheckpoint:
    """A transformers checkpoint's text model: `root`, the prefix of its decoder's tensors
    (`model.language_model.` in multimodal checkpoints, else `model.`), and raw(key), one tensor,
    a one-line error naming it when absent. The families' converters build on it."""

    def __init__(self, st, where: str):
        self.st, self.where = st, where
        self.root = next((r for r in ("model.language_model.", "model.") if f"{r}embed_tokens.weight" in st), None)
        if self.root is None:
            raise Ds4Error(f"{where}: no model.embed_tokens.weight (nor model.language_model.embed_tokens.weight)")

    def raw(self, key: str) -> np.ndarray:
        if key not in self.st:
            raise Ds4Error(f"{self.where}: checkpoint has no tensor {key}")
        return self.st.get(key)


def choose_type(spec, dense: QT, experts: QT) -> QT:
    if spec.types == NORM:
        return QT.F32
    if spec.types == frozenset({QT.I32}):
        return QT.I32
    want = experts if spec.types == ROUTED else dense
    if spec.types in (PLAIN, EMBED) and want not in spec.types:
        want = QT.F16  # HC functions, the router and ape stay in a plain float format
    if want in (QT.Q8_0, QT.MXFP4) and spec.shape[0] % 32:
        want = QT.F16  # block formats need rows that are a multiple of 32
    return want


def read_hf_checkpoint(hf_dir: Path, out: Path, dense_type: str, experts_type: str | None) -> tuple[dict, QT, QT]:
    """What every `ds4 convert` checks first: the checkpoint directory, its config.json (returned
    as a dict), the --type / --experts-type names (returned as GGML types) and the output path."""
    if not hf_dir.is_dir():
        raise Ds4Error(f"{hf_dir}: not a directory (expected a transformers checkpoint directory)")
    if dense_type not in TYPES:
        raise Ds4Error(f"--type {dense_type!r}: expected one of {', '.join(TYPES)}")
    experts_type = experts_type or dense_type
    if experts_type not in EXPERT_TYPES:
        raise Ds4Error(f"--experts-type {experts_type!r}: expected one of {', '.join(EXPERT_TYPES)}")
    if Path(out).is_dir():
        raise Ds4Error(f"{out}: is a directory, expected an output file path")
    cfg_path = hf_dir / "config.json"
    try:
        hf = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Ds4Error(f"{cfg_path}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise Ds4Error(f"{cfg_path}: not readable JSON ({e})") from None
    return hf, TYPES[dense_type], EXPERT_TYPES[experts_type]
