"""GLM-5.3 compiled by TVM for llvm against transformers' Glm5NextForConditionalGeneration.

A tiny random checkpoint (tests/hf_models.py: 6 layers KDA, KDA, DSA, KDA, KDA, DSA with the lower
bound, layer 0 dense, 8 experts top-2 with the clamp, indexer pools of 4 tokens and top_k 16, so
that past position 19 the indexer selects 4 of the complete pools plus the unfinished one; every
parameter and the router bias randomised) saved by transformers, converted by `ds4 convert` to
both GGUF layouts, compiled by `ds4-compile`, and run on 300 tokens.

The reference is transformers in float64 (its eager expert path): transformers' own float32 run
is 4.6e-4 away from it on this model, ours 1.8e-4 (logits up to 4.3), measured 2026-12-02; the
float32 path of transformers' chunked KDA reorders sums that our per-token recurrence keeps in
order, so its float32 logits are not the better oracle.
"""

import numpy as np
import pytest

from conftest import compile_here, ds4_logits, rows_through_rejections, run_ds4

pytestmark = [pytest.mark.oracle, pytest.mark.compile]
N_TOKENS = 300
TOLERANCE = 2e-4   # the bound; measured 1.75e-4 on the default case
# The same model in llama.cpp's layout (the issue's bound). It stores -exp(A_log) where ds4's stores
# A_log; the runtime derives -exp(A_log) on the host for the ds4 file (gguf.quant.HOST_DERIVED), as
# the converter does, because the kernel's exp differs from numpy's in the last bit and the
# recurrence carried that to 2.1e-5 in the logits.
LAYOUT_TOLERANCE = 1e-6


def _compiled(d, layout: str):
    """The tiny checkpoint of d / "hf" converted to `layout` and compiled: the artifact."""
    from ds4tvm.families.glm5next.convert import convert_hf

    gguf = d / f"{layout}.gguf"
    convert_hf(d / "hf", gguf, dense_type="f32", progress=False, layout=layout)
    r = run_ds4("inspect", gguf)
    assert r.returncode == 0, r.stderr
    assert f"{layout} GGUF layout" in r.stdout and "KKDKKD (K = KDA, D = DSA; 1 dense" in r.stdout
    assert "GLM-5.3-Flash (glm5next, glm5-next, target)" in r.stdout and "mtp layer     none" in r.stdout
    art = d / f"art-{layout}"
    compile_here(gguf, "--target", "llvm", "-o", art, "--max-context", "512", "--max-verify", "4", "--quiet")
    return art


# the representative case (indexer selecting, gate lower bound) runs by default, the others with -m slow
# (seed, config overrides): seeds whose router and indexer margins are >= 3e-5 (measured: 6.0e-5 and
# 1.3e-4 for seed 3; 1.9e-4 and 4.0e-5 for seed 4 without the lower bound, where seed 3's indexer
# margin is 2.6e-5)
CASES = [pytest.param((3, {}), id="topk16-lower-bound"),
         pytest.param((3, {"index_topk": 512}), id="topk512-dense", marks=pytest.mark.slow),
         pytest.param((4, {"linear_lower_bound": None}), id="topk16-softplus-decay", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    pytest.importorskip("transformers")
    import torch
    from hf_models import glm5_decision_margins, tiny_glm5_next

    d = tmp_path_factory.mktemp("glm5next")
    seed, overrides = request.param
    model = tiny_glm5_next(seed=seed, **overrides)
    model.save_pretrained(d / "hf")
    ids = np.random.default_rng(0).integers(0, 512, N_TOKENS)
    model.set_experts_implementation("eager")
    model = model.double()
    with torch.no_grad():
        ref = model(torch.tensor(ids[None])).logits[0].numpy()
    router, indexer = glm5_decision_margins(model, ids)
    print(f"decision margins: router {router:.2e}, indexer {indexer:.2e}")
    assert router >= 3e-5 and indexer >= 3e-5   # float32 noise of either side cannot flip a choice
    if overrides.get("index_topk", 16) >= N_TOKENS:
        assert indexer == float("inf")          # dense: nothing to decide
    return {"ds4": _compiled(d, "ds4"), "dir": d}, ids, ref


@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
def test_logits_match_transformers(case, mode, tmp_path):
    arts, ids, ref = case
    got = ds4_logits(arts["ds4"], ids, mode, tmp_path)
    assert got.shape == ref.shape == (N_TOKENS, 512)
    err = np.abs(got - ref).max()
    print(f"glm5next {mode}: max |delta| = {err:.3g} (logits up to {np.abs(ref).max():.2f})")
    assert err <= TOLERANCE


@pytest.mark.slow
def test_llama_cpp_layout_gives_the_same_logits(case, tmp_path):
    """Its own compile (a minute): the default run checks llama.cpp's layout by its tables
    (tests/unit/test_glm5next_tables.py) and the converter's output (test_glm5next_convert.py)."""
    arts, ids, ref = case
    ours = ds4_logits(arts["ds4"], ids, "prefill", tmp_path)
    theirs = ds4_logits(_compiled(arts["dir"], "llama.cpp"), ids, "prefill", tmp_path)
    print(f"glm5next llama.cpp layout vs ds4 layout: max |delta| = {np.abs(theirs - ours).max():.3g}")
    assert np.abs(theirs - ours).max() <= LAYOUT_TOLERANCE
    assert np.abs(theirs - ref).max() <= TOLERANCE


def test_verify_with_rejections_and_rollback(case):
    """Verify blocks whose tails are rejected (commit of a prefix, or rollback) leave the KDA
    snapshot slots, conv rings and indexer state as if only the committed tokens had been run."""
    from ds4tvm.runtime.engine import Engine

    arts, ids, ref = case
    assert np.abs(rows_through_rejections(Engine(arts["ds4"]), ids, 512) - ref).max() <= TOLERANCE
