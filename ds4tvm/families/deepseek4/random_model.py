"""Random DeepSeek-V4 GGUFs of any shape and tensor types, written without a checkpoint: the
embedded demo model, and kernel tests for formats that have no numpy quantizer (Q2_K, Q6_K,
IQ2_XXS), whose tensors are random valid blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...gguf.quant import quantize, random_blocks
from ...gguf.validate import DENSE, INDEX, NORM, TensorSpec
from ...gguf.vocab import synthetic_vocab
from ...gguf.writer import TensorOut, with_overrides, write_gguf
from .config import ARCH, Config
from .tensors import tensor_specs


def tiny_config(**overrides) -> Config:
    """A small config with every layer kind: ratios 0, 0, 4, 128, 4 and one hash layer."""
    base = dict(
        n_layers=5, n_embd=64, n_vocab=512, n_head=4, head_dim=64, n_rot=16, q_lora_rank=32,
        o_lora_rank=32, o_groups=2, n_expert=4, n_expert_used=2, n_ff_exp=32, n_expert_shared=1,
        n_hash_layers=1, sliding_window=16, idx_n_head=16, idx_head_dim=64, idx_top_k=8, hc=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, rope_base=10000.0, compress_rope_base=160000.0,
        yarn_factor=16.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=65536,
        expert_weights_scale=1.5, expert_weights_norm=True, rms_eps=1e-6,
        compress_ratios=(0, 0, 4, 128, 4), swiglu_clamp=(10.0,) * 5)
    base.update(overrides)
    n = base["n_layers"]
    if len(base["compress_ratios"]) != n:
        base["compress_ratios"] = tuple(base["compress_ratios"][i % len(base["compress_ratios"])] for i in range(n))
    if len(base["swiglu_clamp"]) != n:
        base["swiglu_clamp"] = (base["swiglu_clamp"][0],) * n
    cfg = Config(**base)
    cfg.validate()
    return cfg


def k_quant_config(**overrides) -> Config:
    """tiny_config with every projection a multiple of 256 wide, as K- and IQ-quant blocks need."""
    return tiny_config(**{**dict(n_embd=256, n_ff_exp=256, q_lora_rank=256, o_lora_rank=256, head_dim=256,
                                 n_rot=64), **overrides})


def published_recipe_type(spec: TensorSpec) -> QT:
    """Types in the shape of the published Q2 recipe, with random blocks where no quantizer exists:
    IQ2_XXS gate/up experts, Q2_K down experts, Q4_K dense projections (the "AProjQ4" builds)."""
    for part, qtype in (("ffn_gate_exps", QT.IQ2_XXS), ("ffn_up_exps", QT.IQ2_XXS), ("ffn_down_exps", QT.Q2_K)):
        if part in spec.name:
            return qtype
    if spec.types == DENSE and spec.shape[0] % 256 == 0:
        return QT.Q4_K
    return default_type(spec)


def default_type(spec: TensorSpec) -> QT:
    if spec.types == NORM:
        return QT.F32
    if spec.types == INDEX:
        return QT.I32
    return QT.F16


# Projections that write into the residual streams; scaling them down makes the next token mostly a
# function of the current one (a near-bigram model), which lets tests and the demo build drafters
# that agree with the target.
RESIDUAL_WRITERS = ("attn_output_b.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def random_tensors(specs: list[TensorSpec], cfg: Config, rng: np.random.Generator,
                   type_of: Callable[[TensorSpec], QT] = default_type,
                   residual_scale: float = 1.0, random_codes: bool = False) -> list[TensorOut]:
    """Lazily produced random tensors for a tensor table; I32 tensors are tid2eid tables.
    random_codes: every block type gets random valid blocks (no quantizer run: gigabytes in
    seconds, for speed checks that do not compare logits)."""
    tensors = []
    for spec in specs:
        qtype = type_of(spec)
        shape = tuple(reversed(spec.shape))
        sub = np.random.default_rng(rng.integers(1 << 62))

        scale = residual_scale if spec.name.endswith(RESIDUAL_WRITERS) else 1.0

        def produce(spec=spec, qtype=qtype, shape=shape, sub=sub, scale=scale):
            if qtype == QT.I32:  # tid2eid: distinct experts per token
                return np.stack([sub.permutation(cfg.n_expert)[:cfg.n_expert_used]
                                 for _ in range(shape[0])]).astype(np.int32)
            if spec.types == NORM:
                return (1.0 + 0.1 * sub.standard_normal(shape)).astype(np.float32)
            if qtype in (QT.Q2_K, QT.Q6_K, QT.IQ2_XXS) or (random_codes and qtype not in (QT.F32, QT.F16, QT.BF16)):
                return random_blocks(qtype, shape, sub, scale=scale / (32 * np.sqrt(shape[-1])))
            values = sub.standard_normal(shape).astype(np.float32) * (scale / np.sqrt(shape[-1]))
            return quantize(values, qtype)

        tensors.append(TensorOut(spec.name, qtype, shape, produce))
    return tensors


def write_random_deepseek4(path: str | Path, cfg: Config, seed: int = 0,
                           type_of: Callable[[TensorSpec], QT] = default_type,
                           progress: bool = False, metadata: dict | None = None,
                           edit_specs: Callable[[list[TensorSpec]], list[TensorSpec]] | None = None,
                           residual_scale: float = 1.0, random_codes: bool = False) -> Path:
    """Writes a GGUF with random weights of roughly unit-variance activations. `type_of` picks
    each tensor's GGML type; block types without a quantizer get random valid blocks.
    `metadata` overrides keys (None deletes one) and `edit_specs` changes the tensor list: both
    exist to build malformed files for the tests. random_codes: see random_tensors."""
    specs = tensor_specs(cfg)
    tensors = random_tensors(edit_specs(specs) if edit_specs else specs, cfg,
                             np.random.default_rng(seed), type_of, residual_scale, random_codes)
    meta = {"general.architecture": ARCH, "general.name": "ds4tvm random deepseek4"}
    meta.update(cfg.to_metadata())
    meta.update(synthetic_vocab(cfg.n_vocab))
    meta = with_overrides(meta, metadata)
    return write_gguf(path, meta.get("general.architecture", ARCH), meta, tensors, progress=progress,
                      description="writing")
