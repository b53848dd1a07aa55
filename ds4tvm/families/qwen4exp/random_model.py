"""Random Qwen3.8 GGUFs of any shape: every parameter random (the 1-D ones included), the PLE hash
constants those of transformers' derivation for the config (primes past a base, splitmix64
multipliers), the n-gram table padded past the head ranges."""

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
from .config import ARCH, Config
from .tensors import tensor_specs

NO_QUANTIZER = (QT.Q2_K, QT.Q6_K, QT.IQ2_XXS)   # gguf-py has no numpy quantizer for them
_GAMMA, _M1, _M2, _MASK = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, (1 << 64) - 1


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK
    v = ((v ^ (v >> 30)) * _M1) & _MASK
    v = ((v ^ (v >> 27)) * _M2) & _MASK
    return v ^ (v >> 31)


def hash_constants(n_vocab: int, ngram: int, heads: int, base: int, seed: int = 1234) -> dict:
    """Multipliers, head offsets and vocabulary sizes (distinct primes from `base` on) as
    transformers derives them for the first PLE layer."""
    half = max(1, ((1 << 63) - 1) // max(n_vocab, 1) // 2)
    mult = tuple(2 * (_splitmix64((seed + _GAMMA * (i + 1)) & _MASK) % half) + 1 for i in range(ngram))
    sizes, p = [], base - 1
    while len(sizes) < heads:
        p += 1
        if p > 1 and all(p % d for d in range(2, int(p ** 0.5) + 1)):
            sizes.append(p)
    offsets = tuple(int(x) for x in np.cumsum([0] + sizes[:-1]))
    return dict(multipliers=mult, head_offsets=offsets, head_vocab_sizes=tuple(sizes))


def tiny_config(**overrides) -> Config:
    """8 trunk layers (GGGA GGGA), width 64, PLE on layer 1 (8 heads of 8), QSA budget 32; with
    n_nextn=1 the MTP layer after them."""
    n, nextn = overrides.pop("n_layers", 8), overrides.pop("n_nextn", 0)
    cfg = Config(n_layers=n, n_nextn=nextn, n_embd=64, n_vocab=512, rms_eps=1e-6, n_head=4, n_head_kv=2, head_dim=32,
                 n_rot=16, rope_base=10000.0, rope_sections=(4, 2, 2, 0), n_expert=8, n_expert_used=2, n_ff_exp=32,
                 n_ff_shexp=32, conv_kernel=4, gdn_head_dim=16, gdn_k_heads=2, gdn_v_heads=4,
                 layer_ratios=tuple(4 if (i + 1) % 4 == 0 or i >= n else 0 for i in range(n + nextn)),
                 hc=4, hc_rank=16, idx_n_head=8, idx_head_dim=32, idx_top_k=32, ple_layers=(1,), ngram=3,
                 heads_per_ngram=4, ple_conv_kernel=4, eos=7, ple_width=8, **hash_constants(512, 3, 8, 61))
    cfg = replace(cfg, **overrides)
    return replace(cfg, ple_table_rows=cfg.ple_table_rows or -(-cfg.ple_rows // 8) * 8)


def _values(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
    if name.endswith(("norm.weight",)):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def default_type(spec: TensorSpec) -> QT:
    return QT.F32 if spec.types == NORM else QT.F16


def write_random_qwen4exp(path: str | Path, cfg: Config, seed: int = 0,
                          type_of: Callable[[TensorSpec], QT] = default_type, metadata: dict | None = None,
                          edit_specs: Callable[[list[TensorOut]], list[TensorOut]] | None = None,
                          random_codes: bool = False) -> Path:
    """The random model of `seed`. `metadata` overrides keys (None deletes one) and `edit_specs`
    edits the tensor list: both build malformed files for the tests. random_codes: every block
    type gets random valid blocks (no quantizer run: gigabytes in seconds, for speed checks that
    compare no logits)."""
    rng = np.random.default_rng(seed)
    tensors = []
    for spec in tensor_specs(cfg):
        sub = np.random.default_rng(rng.integers(1 << 62))
        qtype = type_of(spec)

        def produce(name=spec.name, shape=tuple(reversed(spec.shape)), sub=sub, qtype=qtype):
            if qtype in NO_QUANTIZER or (random_codes and qtype not in (QT.F32, QT.F16, QT.BF16)):
                return random_blocks(qtype, shape, sub, scale=1.0 / (32 * np.sqrt(shape[-1])))
            return quantize(_values(name, shape, sub), qtype)

        tensors.append(TensorOut(spec.name, qtype, tuple(reversed(spec.shape)), produce))
    if edit_specs is not None:
        tensors = edit_specs(tensors)
    meta = {"general.architecture": ARCH, "general.name": "ds4tvm random qwen4exp", **cfg.to_metadata()}
    meta.update(synthetic_vocab(cfg.n_vocab))
    return write_gguf(path, ARCH, with_overrides(meta, metadata), tensors, description="writing")
