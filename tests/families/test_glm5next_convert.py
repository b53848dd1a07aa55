"""`convert_hf` for GLM-5.3 against transformers' own in-memory parameters (its module names and
fused forms, not the on-disk names the converter reads): a tiny random
Glm5NextForConditionalGeneration saved by transformers, plus the release's MTP layer (which
transformers does not build), converted to both layouts in F32."""

import numpy as np
import pytest

from hf_models import tiny_glm5_next

pytestmark = pytest.mark.oracle


def _expected(params: dict, name: str, cfg) -> np.ndarray:
    """What the GGUF tensor `name` (ds4's canonical name) must hold, in numpy order, from
    transformers' parameters."""
    P = "model.language_model."
    top = {"token_embd.weight": P + "embed_tokens.weight", "output_norm.weight": P + "norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return params[top[name]]
    _, L, s = name.split(".", 2)
    p = f"{P}layers.{L}."
    if s.startswith("nextn."):
        return params[p + {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
                           "nextn.hnorm.weight": "hnorm.weight",
                           "nextn.shared_head_norm.weight": "shared_head.norm.weight"}[s]]
    a, inner = p + "self_attn.", cfg.kda_n_head * cfg.kda_head_dim
    if s.startswith("hc_"):
        part, kind = s[3:].split(".")[0].split("_")
        return params[f"{p}{part}_hc.{kind}"]
    if s.endswith("_conv.weight"):          # one fused depthwise conv [3I, 1, K], q then k then v
        i = "qkv".index(s[4])
        return params[a + "conv1d.weight"][i * inner:(i + 1) * inner, 0, :]
    if s in ("attn_k_b.weight", "attn_v_b.weight"):
        kv_b = params[a + "kv_b_proj.weight"].reshape(cfg.n_head, cfg.key_length + cfg.value_length, -1)
        return kv_b[:, :cfg.key_length].transpose(0, 2, 1) if s == "attn_k_b.weight" else kv_b[:, cfg.key_length:]
    if s in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):   # gate_up_proj [X, 2 Fe, E], gate first
        gu = params[p + "mlp.experts.gate_up_proj"]
        return gu[:, :cfg.n_ff_exp] if s == "ffn_gate_exps.weight" else gu[:, cfg.n_ff_exp:]
    simple = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
              "kda_q.weight": "self_attn.q_proj.weight", "kda_k.weight": "self_attn.k_proj.weight",
              "kda_v.weight": "self_attn.v_proj.weight", "kda_f_a.weight": "self_attn.forget_gate.f_a_proj.weight",
              "kda_f_b.weight": "self_attn.forget_gate.f_b_proj.weight",
              "kda_dt_bias.weight": "self_attn.forget_gate.dt_bias", "kda_a_log.weight": "self_attn.forget_gate.A_log",
              "kda_beta.weight": "self_attn.b_proj.weight", "kda_g_a.weight": "self_attn.g_a_proj.weight",
              "kda_g_b.weight": "self_attn.g_b_proj.weight", "kda_o_norm.weight": "self_attn.o_norm.weight",
              "kda_output.weight": "self_attn.o_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
              "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
              "attn_q_b.weight": "self_attn.q_b_proj.weight",
              "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
              "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
              "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
              "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
              "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
              "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
              "indexer.pool_ape.weight": "self_attn.indexer.index_kpool_compress_ape",
              "indexer.pool_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
              "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
              "exp_probs_b.bias": "mlp.gate.e_score_correction_bias", "ffn_down_exps.weight": "mlp.experts.down_proj",
              "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
              "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
              "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}
    return params[p + simple[s]]


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
            want = _expected(params, spec.name, canonical)
            got = np.asarray(f.tensors[file_name(cfg, spec.name)].data)
            if layout == LLAMA and spec.name.endswith("kda_a_log.weight"):
                want = -np.exp(want)   # llama.cpp stores the decay's -exp(A_log)
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-6, atol=0, err_msg=spec.name)
