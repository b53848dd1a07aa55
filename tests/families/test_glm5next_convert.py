"""`convert_hf` for GLM-5.3 against transformers' own in-memory parameters (its module names and
fused forms, not the on-disk names the converter reads): a tiny random
Glm5NextForConditionalGeneration saved by transformers, plus the release's MTP layer (which
transformers does not build), converted to both layouts in F32."""

import numpy as np
import pytest

from hf_models import glm5_parameter, tiny_glm5_next

pytestmark = pytest.mark.oracle


def _add_mtp_layer(hf_dir, params: dict, n: int, seed: int = 9) -> None:
    """The release's layer n (the nextn block), which transformers drops on load: a DSA + MoE
    block (last trunk layer's tensors, perturbed) and eh_proj / enorm / hnorm / shared_head.norm,
    written as another safetensors file in the on-disk (per-expert) form."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    src, dst = f"model.language_model.layers.{n - 1}.", f"model.language_model.layers.{n}."
    extra = {}
    for name, value in params.items():
        if name.startswith(src) and "_hc." not in name:
            extra[dst + name[len(src):]] = (value + 0.01 * rng.standard_normal(value.shape)).astype(np.float32)
    gu = extra.pop(dst + "mlp.experts.gate_up_proj")
    down = extra.pop(dst + "mlp.experts.down_proj")
    half = gu.shape[1] // 2
    for j in range(gu.shape[0]):
        extra[dst + f"mlp.experts.{j}.gate_proj.weight"] = gu[j, :half]
        extra[dst + f"mlp.experts.{j}.up_proj.weight"] = gu[j, half:]
        extra[dst + f"mlp.experts.{j}.down_proj.weight"] = down[j]
    E = gu.shape[2]
    extra[dst + "eh_proj.weight"] = (rng.standard_normal((E, 2 * E)) / np.sqrt(2 * E)).astype(np.float32)
    for norm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        extra[dst + norm] = (1 + 0.1 * rng.standard_normal(E)).astype(np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in extra.items()}, str(hf_dir / "mtp.safetensors"))
    params.update(extra)
    params[dst + "mlp.experts.gate_up_proj"], params[dst + "mlp.experts.down_proj"] = gu, down


def test_convert_matches_transformers_parameters_in_both_layouts(tmp_path):
    from dataclasses import replace

    from ds4tvm.families.glm5next.config import DS4, LLAMA, Config
    from ds4tvm.families.glm5next.convert import convert_hf
    from ds4tvm.families.glm5next.tensors import file_name, tensor_specs
    from ds4tvm.gguf import open_gguf
    from ds4tvm.gguf.validate import check_tensors

    model = tiny_glm5_next(seed=3)
    model.save_pretrained(tmp_path / "hf")
    params = {n: t.detach().float().numpy() for n, t in model.state_dict().items()}
    text = model.config.text_config
    _add_mtp_layer(tmp_path / "hf", params, text.num_hidden_layers)
    for layout in (DS4, LLAMA):
        f = open_gguf(convert_hf(tmp_path / "hf", tmp_path / f"{layout}.gguf", dense_type="f32", progress=False,
                                 layout=layout))
        cfg = Config.from_gguf(f)
        assert check_tensors(f, tensor_specs(cfg)) == []
        assert (cfg.layout, cfg.n_layers, cfg.n_nextn, cfg.n_dense_lead, cfg.idx_pool) == (layout, 6, 1, 1, 4)
        assert cfg.layer_types == (0, 0, 1, 0, 0, 1, 1) and cfg.swiglu_exp == (1.5,) * 7
        assert "blk.6.nextn.eh_proj.weight" in f.tensors and "blk.6.hc_attn_fn.weight" not in f.tensors
        assert (cfg.kda_head_dim, cfg.gate_lower_bound, cfg.expert_weights_scale) == (16, -5.0, 2.5)
        assert (cfg.n_head, cfg.key_length, cfg.value_length, cfg.kv_lora_rank) == (
            text.num_attention_heads, text.qk_nope_head_dim, text.v_head_dim, text.kv_lora_rank)
        canonical = replace(cfg, layout=DS4)
        for spec in tensor_specs(canonical):
            want = glm5_parameter(params, spec.name, canonical)
            got = np.asarray(f.tensors[file_name(cfg, spec.name)].data)
            if layout == LLAMA and spec.name.endswith("kda_a_log.weight"):
                want = -np.exp(want)   # llama.cpp stores the decay's -exp(A_log)
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-6, atol=0, err_msg=spec.name)
