"""Legacy MTP support-file tensors (ds4-spec §1.2)."""

from __future__ import annotations

from ...gguf.validate import DENSE, NORM, PLAIN, TensorSpec
from ..deepseek4.tensors import block_specs
from .config import Config


def tensor_specs(c: Config) -> list[TensorSpec]:
    b = c.block
    E, hc = b.n_embd, b.hc
    return block_specs(b, "mtp.0.", ratio=0, hash_layer=False, selection_bias_required=True) + [
        TensorSpec("mtp.0.e_proj.weight", (E, E), DENSE),
        TensorSpec("mtp.0.h_proj.weight", (E, E), DENSE),
        TensorSpec("mtp.0.enorm.weight", (E,), NORM),
        TensorSpec("mtp.0.hnorm.weight", (E,), NORM),
        TensorSpec("mtp.0.norm.weight", (E,), NORM),
        TensorSpec("mtp.0.hc_head_base.weight", (hc,), NORM),
        TensorSpec("mtp.0.hc_head_fn.weight", (hc * E, hc), PLAIN),
        TensorSpec("mtp.0.hc_head_scale.weight", (1,), NORM),
    ]
