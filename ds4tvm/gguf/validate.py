"""Tensor tables and their validation: each family lists the tensors it reads (GGUF name, shape
in ggml order, accepted GGML types) and checks a file against the list in both directions."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from gguf import GGML_QUANT_SIZES
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


def _trim(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def same_layout(stored, expected) -> str | None:
    """How a stored ggml shape holds the expected one with the same elements in the same order, or
    None. ggml pads every shape to four axes with 1s, so trailing size-1 axes mean nothing; a flat
    vector may be stored grouped ([n_embd, n_hc] for [n_hc*n_embd]). Element count alone is never
    enough: a transposed matrix has the same count and a different order."""
    stored, expected = tuple(stored), tuple(expected)
    if stored == expected:
        return ""
    if _trim(stored) == _trim(expected):
        return "trailing size-1 axes"
    flat = _trim(stored)
    if len(_trim(expected)) == 1 and len(flat) == 2 and flat[0] * flat[1] == expected[0]:
        return "a vector stored as a matrix of its rows"
    return None


def _as_shape(t, shape: tuple[int, ...]):
    """t seen with the expected ggml shape (a view of the same bytes: same_layout said so)."""
    if t.data.dtype == np.uint8 and t.ggml_type != QT.I8:
        block, size = GGML_QUANT_SIZES[t.ggml_type]
        data = t.data.reshape(*reversed(shape[1:]), shape[0] // block * size)
    else:
        data = t.data.reshape(tuple(reversed(shape)))
    return replace(t, shape=tuple(shape), data=data)


def check_tensor(f: GGUFFile, spec: TensorSpec) -> str | None:
    """Checks one tensor against its spec; a tensor stored in another valid layout is made to look
    like the expected one (f.tensors is updated) and the layout is returned, for `ds4 inspect`."""
    t = f.tensors.get(spec.name)
    if t is None:
        if spec.optional:
            return None
        raise Ds4Error(f"{f.name}: missing tensor {spec.name} (expected {_types(spec.types)} "
                       f"{list(spec.shape)})")
    layout = same_layout(t.shape, spec.shape)
    if layout is None:
        raise Ds4Error(f"{f.name}: tensor {spec.name} has shape {list(t.shape)}, expected "
                       f"{list(spec.shape)} (ggml order)")
    if t.ggml_type not in spec.types:
        raise Ds4Error(f"{f.name}: tensor {spec.name} has unsupported type {t.type_name}, expected "
                       f"one of {_types(spec.types)}")
    if layout:
        if spec.shape[0] % GGML_QUANT_SIZES[t.ggml_type][0]:
            raise Ds4Error(f"{f.name}: tensor {spec.name} has shape {list(t.shape)}: as {list(spec.shape)} its "
                           f"rows are not whole {t.type_name} blocks")
        f.tensors[spec.name] = t = _as_shape(t, spec.shape)
    if spec.index_bound is not None and t.data.size:
        lo, hi = int(t.data.min()), int(t.data.max())
        if lo < 0 or hi >= spec.index_bound:
            # kernels index weights with these values: one out of range would read past a tensor
            raise Ds4Error(f"{f.name}: tensor {spec.name} holds {lo if lo < 0 else hi}, expected values in "
                           f"0..{spec.index_bound - 1}")
    return layout or None


def check_tensors(f: GGUFFile, specs: list[TensorSpec]) -> list[str]:
    """Checks every spec against the file; returns the names of tensors the family does not use.
    Tensors held in another valid layout are noted in f.layout_notes."""
    for spec in specs:
        stored = f.tensors[spec.name].shape if spec.name in f.tensors else None
        layout = check_tensor(f, spec)
        if layout:
            f.layout_notes[spec.name] = f"stored as {list(stored)} for {list(spec.shape)} ({layout})"
    known = {s.name for s in specs}
    return sorted(n for n in f.tensors if n not in known)


_DIM, _HEADS, _HEAD_DIM = (0, 1 << 17), (0, 1 << 12), (0, 1 << 14)
_EPS, _SCALE = (1e-30, 1.0), (0.0, 1e6)
# Ranges of the config fields every family reads from metadata, by field name (a family checks the
# fields it has): far above any published model, far below what would compile rings of gigabytes,
# loop 10^8 times, or put a NaN into every norm. Positivity and the relations between fields are
# each family's own checks.
RANGES = {
    "n_layers": (1, 1024), "n_nextn": (0, 8), "n_hash_layers": (0, 1024), "n_dense_lead": (0, 1024),
    "n_embd": _DIM, "n_ff": _DIM, "n_ff_exp": _DIM, "n_ff_shexp": _DIM, "q_lora_rank": _DIM,
    "kv_lora_rank": _DIM, "o_lora_rank": _DIM, "hc_rank": _DIM, "ple_width": _DIM,
    "n_head": _HEADS, "n_head_kv": _HEADS, "idx_n_head": _HEADS, "kda_n_head": _HEADS, "gdn_k_heads": _HEADS,
    "gdn_v_heads": _HEADS, "o_groups": _HEADS, "heads_per_ngram": (1, 64), "ngram": (2, 8),
    "head_dim": _HEAD_DIM, "key_length": _HEAD_DIM, "value_length": _HEAD_DIM, "idx_head_dim": _HEAD_DIM,
    "kda_head_dim": _HEAD_DIM, "gdn_head_dim": _HEAD_DIM, "n_rot": _HEAD_DIM,
    "n_vocab": (1, 1 << 24), "n_expert": (0, 1 << 14), "n_expert_used": (0, 256), "n_expert_shared": (0, 256),
    "sliding_window": (1, 1 << 30), "idx_top_k": (0, 1 << 24), "idx_pool": (0, 1 << 16),
    "hc": (1, 64), "hc_sinkhorn_iters": (1, 1000), "conv_kernel": (1, 64), "ple_conv_kernel": (1, 64),
    "context_length": (1, 1 << 30), "yarn_orig_ctx": (0, 1 << 30),
    "rms_eps": _EPS, "hc_eps": _EPS, "idx_norm_eps": _EPS, "rope_base": (1e-6, 1e15),
    "compress_rope_base": (1e-6, 1e15), "yarn_factor": (1e-6, 1e6), "yarn_beta_fast": _SCALE,
    "yarn_beta_slow": _SCALE, "expert_weights_scale": _SCALE, "swiglu_clamp": _SCALE, "swiglu_exp": _SCALE,
    "swiglu_shexp": _SCALE, "gate_lower_bound": (-1e6, 1e6),
}


def check_ranges(cfg, key_of, where: str) -> None:
    """Every field of cfg that RANGES names (each value of a per-layer tuple) within its range; NaN
    and infinities are outside every range. key_of(field): its metadata key, for the message."""
    for field, (lo, hi) in RANGES.items():
        value = getattr(cfg, field, None)
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and not lo <= v <= hi:
                raise Ds4Error(f"{where}metadata key {key_of(field)} is {v}; expected a value in {lo}..{hi}")
