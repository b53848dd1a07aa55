"""Token sampling with ds4's knobs. Greedy at temperature 0 (ties to the lower id); otherwise
top-k, top-p and min-p filter the distribution at temperature 1, as llama.cpp's chain does, then
the temperature shapes what is left and a token is drawn."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import Ds4Error


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0: off
    min_p: float = 0.05

    def check(self) -> "SamplingParams":
        if not self.temperature >= 0:
            raise Ds4Error(f"--temp {self.temperature}: expected a value >= 0")
        if not 0 < self.top_p <= 1:
            raise Ds4Error(f"--top-p {self.top_p}: expected a value in (0, 1]")
        if self.top_k < 0:
            raise Ds4Error(f"--top-k {self.top_k}: expected a value >= 0")
        if not 0 <= self.min_p <= 1:
            raise Ds4Error(f"--min-p {self.min_p}: expected a value in [0, 1]")
        return self


def argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # numpy returns the first (lowest) index among ties


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy step samples from (also the target law of exact
    speculative acceptance)."""
    x = logits.astype(np.float64)
    keep = np.ones(x.shape, bool)
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        keep &= x >= kth
    probs = np.exp(x - x[keep].max()) * keep
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        cut = int(np.searchsorted(cum, p.top_p)) + 1  # smallest prefix with mass >= top_p
        mask = np.zeros_like(keep)
        mask[order[:cut]] = True
        keep &= mask
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs[keep].max()
    y = np.where(keep, x / max(p.temperature, 1e-6), -np.inf)
    out = np.exp(y - y.max())
    return out / out.sum()


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    if p.temperature == 0:
        return argmax(logits)
    probs = filtered_probs(logits, p)
    return int(rng.choice(probs.size, p=probs))
