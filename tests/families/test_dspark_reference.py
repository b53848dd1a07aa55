"""The DSpark drafter compiled by TVM against the PyTorch reference written from
dspark-crosscheck.md §2 (ds4tvm/training/dspark_reference.py) on a random support file: the ring
rows from a prefill longer than the window and from a direct decode step, then a proposal's block
logits, the Markov head's rows and bias, and the confidences, within 1e-4 (float32 against float64;
the weights are the same dequantized values on both sides, FP8 rounding off)."""

import numpy as np
import pytest

from conftest import run_ds4_compile

pytestmark = pytest.mark.compile
TOL = 1e-4


def _quantized(spec):
    """Q8_0 projections and experts (the tiny widths are not multiples of the K-quants' 256), the
    rest as the random writer has them."""
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.deepseek4.random_model import default_type
    from ds4tvm.gguf.validate import DENSE, ROUTED

    if spec.types in (DENSE, ROUTED) and spec.shape[0] % 32 == 0:
        return QT.Q8_0
    return default_type(spec)


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def pair(tmp_path_factory, request):
    """A random target and support file; the second with quantized support weights (the reference
    reads the same dequantized values, so the tolerance is the same: f32 arithmetic)."""
    from ds4tvm.families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
    from ds4tvm.families.dspark.random_model import write_random_dspark

    d = tmp_path_factory.mktemp("dspark-ref")
    cfg = tiny_config()
    model = write_random_deepseek4(d / "target.gguf", cfg, seed=31)
    support = write_random_dspark(d / "support.gguf", cfg, seed=32,
                                  type_of=_quantized if request.param != "f16" else default_type)
    r = run_ds4_compile(model, "--target", "llvm", "-o", d / "art", "--max-context", "512", "--max-verify", "8",
                        "--mtp", support, "--no-kv-rounding", "--quiet")
    assert r.returncode == 0, r.stderr
    return model, support, d / "art"


def test_tvm_drafter_matches_the_pytorch_reference(pair):
    import torch

    from ds4tvm.families.deepseek4.config import Config as V4Config
    from ds4tvm.families.dspark.config import Config, paired_with
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.training.dspark_reference import DSparkReference

    model, support, art = pair
    target_cfg = V4Config.from_gguf(open_gguf(model))
    cfg = paired_with(Config.from_gguf(open_gguf(support)), target_cfg)
    ref = DSparkReference(open_gguf(model), open_gguf(support), cfg)
    e = Engine(art)
    drafter = DSparkDrafter(e, theta=0.0)
    prompt = np.random.default_rng(4).integers(0, target_cfg.n_vocab, 150).tolist()   # past the 128-row ring
    step = e.prefill(prompt)
    drafter.begin(e, step, frozenset())
    ref.observe(step.outputs["captured"], 0)
    step = e.decode(int(np.argmax(step.logits)))            # a plain decode step: the direct ring path
    drafter.observe(e, step, [e.history[-1]])
    ref.observe(step.outputs["captured"], e.pos - 1, direct=True)

    anchor, P, B = e.history[-1], e.pos - 1, cfg.block_size
    got_r = e.call("dspark_block", captured=drafter.anchor_row[None], tokens=[anchor] + [cfg.noise_token_id] * (B - 1),
                   start=P)["r"]
    got = e.call("dspark_logits", r=got_r)["logits"]
    want_r = ref.block(drafter.anchor_row, anchor, P)
    want = ref.logits(want_r).numpy()
    assert np.abs(got - want).max() <= TOL * max(1.0, np.abs(want).max())
    assert np.abs(got_r - want_r.numpy()).max() <= TOL
    for prev in (anchor, 0, target_cfg.n_vocab - 1, int(np.argmax(want[0]))):
        markov = e.call("dspark_markov", prev=[prev])
        m, bias = ref.markov(prev)
        assert np.abs(markov["m"][0] - m.numpy()).max() <= TOL
        assert np.abs(markov["bias"][0] - bias.numpy()).max() <= TOL * max(1.0, bias.abs().max().item())
        for i in range(B):   # the drafter's confidence (host dot product over TVM's r and m)
            c = float(np.dot(drafter.conf, np.concatenate([got_r[i], markov["m"][0]])))
            assert abs(c - ref.confidence(torch.as_tensor(want_r[i]), m)) <= TOL * max(1.0, abs(c))
    drafts, _ = ref.propose(drafter.anchor_row, anchor, P, theta=0.0)
    tvm_drafts, _ = drafter._propose(e, anchor, B)
    assert tvm_drafts == drafts
