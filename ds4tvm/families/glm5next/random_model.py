"""Random GLM-5.3 GGUFs of any shape, in either layout: the same seed gives the same model, whose
tensors llama.cpp's layout stores under its own names and, for A_log and the conv weights, in its
own form (tensors.py). Every parameter is random, the 1-D ones included."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...gguf.quant import quantize, random_blocks
from ...gguf.validate import NORM, TensorSpec
from ...gguf.vocab import synthetic_vocab
from ...gguf.writer import TensorOut, with_overrides, write_gguf
from .config import ARCH, DS4, DSA, KDA, Config
from .tensors import A_LOG, CONVS, canonical_pairs, in_layout


def tiny_config(layout: str = DS4, **overrides) -> Config:
    """6 trunk layers (KDA, KDA, DSA, KDA, KDA, DSA) and one MTP layer, width 64, layer 0 dense."""
    n = overrides.pop("n_layers", 6)
    types = overrides.pop("layer_types", tuple(DSA if i % 3 == 2 else KDA for i in range(n)) + (DSA,))
    cfg = Config(layout=layout, n_layers=n, n_nextn=1, n_embd=64, n_vocab=512, n_ff=96, n_ff_exp=32, n_expert=8,
                 n_expert_used=2, n_expert_shared=1, n_dense_lead=1, expert_weights_scale=2.5,
                 expert_weights_norm=True, rms_eps=1e-5, n_head=4, key_length=32, value_length=32, q_lora_rank=48,
                 kv_lora_rank=64, idx_n_head=4, idx_head_dim=32, idx_top_k=16, idx_pool=4, kda_n_head=4,
                 kda_head_dim=16, conv_kernel=4, gate_lower_bound=-5.0, layer_types=types,
                 swiglu_exp=(1.5,) * len(types), swiglu_shexp=(1.5,) * len(types), hc=4, hc_sinkhorn_iters=20,
                 hc_eps=1e-6, idx_full=(True,) * n, context_length=4096)
    return replace(cfg, **overrides)


NO_QUANTIZER = (QT.Q2_K, QT.Q6_K, QT.IQ2_XXS)   # gguf-py has no numpy quantizer for them


def _values(suffix: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Canonical values (numpy order) of roughly unit-variance activations."""
    if suffix == A_LOG:
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    if suffix in CONVS:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if suffix.endswith(("dt_bias.weight", ".bias")):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    if suffix.startswith("hc_") and not suffix.endswith("fn.weight"):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    if suffix.endswith(("norm.weight",)) or suffix == "output_norm.weight":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def default_type(spec: TensorSpec) -> QT:
    return QT.F32 if spec.types == NORM else QT.F16


def write_random_glm5next(path: str | Path, cfg: Config, seed: int = 0,
                          type_of: Callable[[TensorSpec], QT] = default_type, metadata: dict | None = None,
                          edit_specs: Callable[[list[TensorOut]], list[TensorOut]] | None = None,
                          random_codes: bool = False) -> Path:
    """The random model of `seed` in cfg's layout. `metadata` overrides keys (None deletes one) and
    `edit_specs` edits the tensor list: both build malformed files for the tests. random_codes:
    every block type gets random valid blocks (no quantizer run: gigabytes in seconds, for speed
    checks that compare no logits)."""
    rng = np.random.default_rng(seed)
    tensors = []
    for canonical, spec, suffix in canonical_pairs(cfg):   # values come from the canonical name
        sub = np.random.default_rng(rng.integers(1 << 62))   # one stream per tensor, whatever the layout
        qtype = QT.F32 if suffix in (A_LOG, *CONVS) else type_of(spec)

        def produce(suffix=suffix, shape=tuple(reversed(canonical.shape)), sub=sub, qtype=qtype):
            if qtype in NO_QUANTIZER or (random_codes and qtype not in (QT.F32, QT.F16, QT.BF16)):   # valid blocks, same spread
                return random_blocks(qtype, shape, sub, scale=1.0 / (32 * np.sqrt(shape[-1])))
            return quantize(in_layout(cfg, suffix, _values(suffix, shape, sub)), qtype)

        tensors.append(TensorOut(spec.name, qtype, tuple(reversed(spec.shape)), produce))
    if edit_specs is not None:
        tensors = edit_specs(tensors)
    meta = {"general.architecture": ARCH, "general.name": f"ds4tvm random glm5-next ({cfg.layout} layout)"}
    meta.update(cfg.to_metadata())
    meta.update(synthetic_vocab(cfg.n_vocab))
    meta = with_overrides(meta, metadata)
    return write_gguf(path, ARCH, meta, tensors, description="writing")
