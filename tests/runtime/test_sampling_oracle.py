"""The sampling filters against an independent implementation: transformers' TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper and TemperatureLogitsWarper, chained in ds4's order (top-k,
top-p, min-p at temperature 1, then the temperature), in float64, on random logits with ties and
-inf. The distributions must agree to 1e-12 (float64 rounding of two softmaxes), except that where a
tie straddles the top-p boundary the two may keep different members of the tie: then the kept
values (as multisets) and the sorted distributions agree."""

import numpy as np
import pytest

from hf_models import hf_sampling_probs as _hf

from ds4tvm.runtime.sampler import SamplingParams, filtered_probs

pytestmark = pytest.mark.oracle

PARAMS = [SamplingParams(1.0, top_k=5, min_p=0.0), SamplingParams(1.0, top_p=0.9, min_p=0.0),
          SamplingParams(1.0, min_p=0.1), SamplingParams(0.7, top_k=40, top_p=0.95, min_p=0.05),
          SamplingParams(1.3, top_k=3, top_p=0.5, min_p=0.2), SamplingParams(0.5, top_p=0.3, min_p=0.0),
          SamplingParams(2.0, top_k=1), SamplingParams(1.0, top_k=0, top_p=1.0, min_p=0.0)]


def _logits(rng, n: int) -> np.ndarray:
    """Random logits, some rounded to a coarse grid (ties), some -inf."""
    x = rng.standard_normal(n) * rng.choice([0.5, 2.0, 6.0])
    if rng.random() < 0.5:
        x = np.round(x * 2) / 2
    x[rng.random(n) < 0.1] = -np.inf
    x[int(rng.integers(n))] = abs(x[np.isfinite(x)]).max() + 1   # at least one finite logit
    return x


def _top_p_boundary_tie(logits: np.ndarray, p: SamplingParams) -> bool:
    """Whether a tie straddles the top-p cut, where either member may be kept."""
    if p.top_p >= 1.0:
        return False
    x = logits.copy()
    if p.top_k and p.top_k < x.size:
        x[x < np.sort(x)[-p.top_k]] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cut = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
    return cut < len(order) and probs[order[cut - 1]] == probs[order[cut]]


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_filters_equal_transformers_warpers(p):
    rng = np.random.default_rng(int(p.temperature * 100 + p.top_k * 7 + p.top_p * 1000 + p.min_p * 10000))
    ties = 0
    for _ in range(300):
        logits = _logits(rng, int(rng.choice([7, 32, 200])))
        ours, theirs = filtered_probs(logits, p), _hf(logits, p)
        if _top_p_boundary_tie(logits, p) and not np.allclose(ours, theirs, rtol=0, atol=1e-12):
            ties += 1
            np.testing.assert_allclose(np.sort(ours), np.sort(theirs), rtol=0, atol=1e-12)
            np.testing.assert_array_equal(np.sort(logits[ours > 0]), np.sort(logits[theirs > 0]))
            continue
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    assert ties < 150, ties   # most cases are compared token for token


def test_a_filter_off_by_one_token_would_be_caught():
    """The comparison sees one token more or less: top-k keeping k + 1 differs from the warper."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(50)
    p = SamplingParams(1.0, top_k=5, min_p=0.0)
    wider = filtered_probs(logits, SamplingParams(1.0, top_k=6, min_p=0.0))
    assert not np.allclose(wider, _hf(logits, p), rtol=0, atol=1e-12)
    np.testing.assert_allclose(filtered_probs(logits, p), _hf(logits, p), rtol=0, atol=1e-12)
