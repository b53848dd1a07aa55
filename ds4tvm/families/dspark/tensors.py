"""DSpark support-file tensors: stages of V4 blocks (no compressors), projections and heads."""

from __future__ import annotations

from ...gguf.validate import DENSE, NORM, PLAIN, TensorSpec
from ..deepseek4.tensors import block_specs
from .config import Config


def tensor_specs(c: Config) -> list[TensorSpec]:
    b = c.block
    E, hc = b.n_embd, b.hc
    specs: list[TensorSpec] = []
    for s in range(c.n_stages):
        specs += block_specs(b, f"mtp.{s}.", ratio=0, hash_layer=False, selection_bias_required=True)
    last = f"mtp.{c.n_stages - 1}."
    specs += [
        TensorSpec("mtp.0.main_proj.weight", (len(c.target_layer_ids) * E, E), DENSE),
        TensorSpec("mtp.0.main_norm.weight", (E,), NORM),
        TensorSpec(last + "norm.weight", (E,), NORM),
        TensorSpec(last + "hc_head_base.weight", (hc,), NORM),
        TensorSpec(last + "hc_head_fn.weight", (hc * E, hc), PLAIN),
        TensorSpec(last + "hc_head_scale.weight", (1,), NORM),
        TensorSpec(last + "markov_head.markov_w1.weight", (c.markov_rank, b.n_vocab), DENSE),
        TensorSpec(last + "markov_head.markov_w2.weight", (c.markov_rank, b.n_vocab), DENSE),
        TensorSpec(last + "confidence_head.proj.weight", (E + c.markov_rank, 1), DENSE),
    ]
    return specs
