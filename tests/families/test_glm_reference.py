"""The numpy references of GLM-5.3's attention layers (ds4tvm/training/glm_reference.py, written
from the spec) against transformers on a tiny random GLM-5.3: KDA against Glm5NextTextLinearAttention
(its chunked path), with and without the decay's lower bound, and the reference's own state (a
sequence split into prefill and one-row steps gives the rows of one pass; the state after row j is
that of the first j + 1 rows alone, what a verify followed by commit(j + 1) must leave); DSA against
Glm5NextTextAttention and its indexer, with the selection active and dense; the MoE (which the MTP
layer's reference uses) against Glm5NextTextMoE. The references read the files with gguf-py."""

import numpy as np
import pytest

from hf_models import tiny_glm5_next

pytestmark = pytest.mark.oracle


def _converted(model, d):
    """The GGUF of a transformers model (converted in ds4's layout), its config and a layer's tensors,
    read with gguf-py."""
    from ds4tvm.families.glm5next.convert import convert_hf
    from ds4tvm.training.glm_reference import read_config, read_tensors

    model.save_pretrained(d / "hf")
    path = convert_hf(d / "hf", d / "m.gguf", dense_type="f32", progress=False)

    def layer(i: int) -> dict:
        prefix = f"blk.{i}."
        return {name[len(prefix):]: v for name, v in read_tensors(path, lambda n: n.startswith(prefix)).items()}

    return read_config(path), layer


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_reference_matches_transformers(tmp_path, lower_bound):
    import torch

    from ds4tvm.training.glm_reference import kda_layer

    model = tiny_glm5_next(seed=5, linear_lower_bound=lower_bound)
    cfg, layer = _converted(model, tmp_path)
    assert cfg.gate_lower_bound == lower_bound and cfg.layer_types[0] == 0   # KDA
    x = torch.randn(1, 40, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.model.language_model.layers[0].self_attn(x)[0].numpy()
    w = layer(0)
    got, _ = kda_layer(w, cfg, x[0].numpy())
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))

    first, state = kda_layer(w, cfg, x[0, :25].numpy())
    rows = [first]
    for t in range(25, 40):
        row, state = kda_layer(w, cfg, x[0, t:t + 1].numpy(), state)
        rows.append(row)
    np.testing.assert_allclose(np.concatenate(rows), got, rtol=0, atol=1e-12)
    states = []
    kda_layer(w, cfg, x[0, :8].numpy(), states=states)
    for j in (0, 3, 7):
        _, alone = kda_layer(w, cfg, x[0, :j + 1].numpy())
        # float64 products over 8 rows or j + 1 rows round alike to ~1e-16
        np.testing.assert_allclose(states[j].S, alone.S, rtol=0, atol=1e-12)
        np.testing.assert_allclose(states[j].conv, alone.conv, rtol=0, atol=1e-12)


@pytest.mark.parametrize("top_k", [16, 512])
def test_dsa_reference_matches_transformers(tmp_path, top_k):
    """MLA without RoPE and the pooled indexer: with top_k 16 (4 pools of 4) the selection is
    active from row 19 on, with 512 every complete pool is kept (dense). The selected positions
    equal transformers' indexer's, row by row."""
    import torch

    from ds4tvm.training.glm_reference import dsa_layer

    model = tiny_glm5_next(seed=6, index_topk=top_k)
    cfg, layer = _converted(model, tmp_path)
    assert cfg.layer_types[2] == 1 and cfg.idx_top_k == top_k   # DSA
    T = 40
    x = torch.randn(1, T, cfg.n_embd, generator=torch.Generator().manual_seed(2))
    attn = model.model.language_model.layers[2].self_attn
    mask = torch.ones(1, T, dtype=torch.bool)
    with torch.no_grad():
        want = attn(x, attention_mask=mask)[0][0].numpy()
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        chosen = attn.indexer(hidden_states=x, q_resid=q_resid, attention_mask=mask, past_key_values=None)[0].numpy()
    got, selection = dsa_layer(layer(2), cfg, x[0].numpy())
    for t in range(T):
        assert sorted(selection[t].tolist()) == sorted(i for i in chosen[t].tolist() if i >= 0), t
    sparse = [t for t in range(T) if len(selection[t]) < t + 1]
    assert (sparse[0] == 19) if top_k == 16 else not sparse
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_moe_reference_matches_transformers(tmp_path):
    """The sigmoid-router MoE with its shared expert and clamped SwiGLU, float64 on both sides but
    transformers' router, which computes its scores in float32 (Glm5NextTextTopkRouter): measured
    2.5e-7, the float32 rounding of the routing weights times expert outputs of ~2; a different
    choice of expert would differ by ~1."""
    import torch

    from ds4tvm.training.glm_reference import moe_ffn

    model = tiny_glm5_next(seed=7)
    cfg, layer = _converted(model, tmp_path)
    il = cfg.n_dense_lead
    assert cfg.is_moe(il) and cfg.swiglu_exp[il] > 0
    model.set_experts_implementation("eager")
    mlp = model.model.language_model.layers[il].mlp.double()
    x = torch.randn(1, 40, cfg.n_embd, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        want = mlp(x)[0].numpy()
    got = moe_ffn(layer(il), cfg, il, x[0].numpy())
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
