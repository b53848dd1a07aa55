"""`ds4 convert` on a tiny random DeepseekV4ForCausalLM: the GGUF holds exactly transformers'
weights under the DS4 names, and `ds4 inspect` reports the model."""

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from conftest import run_ds4
from hf_models import hf_tensor
from ds4tvm.gguf import open_gguf

@pytest.fixture(scope="module")
def hf_state(tiny_hf_dir):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(tiny_hf_dir)
    return model.config, {k: v.detach().float() if v.is_floating_point() else v for k, v in
                          {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()}


def test_convert_f32_holds_transformers_weights(tiny_hf_dir, hf_state, tmp_path):
    cfg, state = hf_state
    out = tmp_path / "tiny-f32.gguf"
    r = run_ds4("convert", tiny_hf_dir, out, "--type", "f32", "--quiet")
    assert r.returncode == 0, r.stderr
    f = open_gguf(out)
    assert f.architecture == "deepseek4"
    assert f.get("deepseek4.attention.compress_ratios", "ints") == [0, 0, 4, 128, 4]
    assert f.get("deepseek4.hash_layer_count", "int") == 1
    assert f.get("deepseek4.rope.scaling.factor", "float") == 16.0
    for name, t in f.tensors.items():
        want = hf_tensor(state, name, cfg.moe_intermediate_size)
        got = np.asarray(t.data)
        assert got.shape == want.shape, name
        if t.ggml_type == QT.I32:
            assert np.array_equal(got, want.astype(np.int32)), name
        else:
            assert t.ggml_type == QT.F32 and np.array_equal(got, want), name
    used = {k for k in state if not k.endswith("inv_freq")}
    assert len(f.tensors) == len(used) + cfg.num_hidden_layers  # gate_up splits into two tensors


def test_convert_quantized_types(tiny_hf_dir, hf_state, tmp_path):
    cfg, state = hf_state
    out = tmp_path / "tiny-q8.gguf"
    r = run_ds4("convert", tiny_hf_dir, out, "--type", "q8_0", "--experts-type", "mxfp4", "--quiet")
    assert r.returncode == 0, r.stderr
    f = open_gguf(out)
    t = f.tensor("blk.2.attn_q_b.weight")
    assert t.ggml_type == QT.Q8_0
    want = hf_tensor(state, t.name, cfg.moe_intermediate_size)
    assert np.array_equal(quants.dequantize(np.asarray(t.data), QT.Q8_0),
                          quants.dequantize(quants.quantize(want, QT.Q8_0), QT.Q8_0))
    assert f.tensor("blk.3.ffn_up_exps.weight").ggml_type == QT.MXFP4
    assert f.tensor("blk.3.hc_attn_fn.weight").ggml_type == QT.F16  # HC functions stay plain floats
    assert f.tensor("blk.3.attn_norm.weight").ggml_type == QT.F32


def test_inspect_converted_model(tiny_hf_dir, tmp_path):
    out = tmp_path / "tiny.gguf"
    assert run_ds4("convert", tiny_hf_dir, out, "--quiet").returncode == 0
    r = run_ds4("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert set(info) == {"architecture", "family", "title", "role", "n_layers", "n_embd", "n_vocab", "context_length",
                         "experts", "n_tensors", "n_params", "bits_per_weight", "chat_template", "file_bytes",
                         "quant_types", "unused_tensors", "details"}
    assert info["title"] == "DeepSeek-V4-Flash" and info["chat_template"] is not None
    assert info["details"] == {}   # deepseek4 says nothing beyond its size
    # 6 top-level tensors; per layer 24 block tensors (tid2eid in the hash layer, the selection
    # bias elsewhere), 4 compressor tensors in the 3 compressed layers, 6 indexer tensors in the 2
    # ratio-4 layers.
    expected_tensors = 6 + 5 * 24 + 3 * 4 + 2 * 6
    assert info["family"] == "deepseek4" and info["role"] == "target"
    assert info["n_layers"] == 5 and info["n_embd"] == 64 and info["n_vocab"] == 512
    assert info["n_tensors"] == expected_tensors
    assert info["unused_tensors"] == [] and info["quant_types"]["I32"] == 1
    text = run_ds4("inspect", out)
    assert text.returncode == 0 and "deepseek4" in text.stdout


def test_convert_errors(tmp_path, tiny_hf_dir):
    r = run_ds4("convert", tmp_path / "none", tmp_path / "x.gguf")
    assert r.returncode == 2 and "not a directory" in r.stderr
    r = run_ds4("convert", tiny_hf_dir, tmp_path / "x.gguf", "--type", "q4_k")
    assert r.returncode == 2 and "--type" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    r = run_ds4("convert", bad, tmp_path / "x.gguf")
    assert r.returncode == 2 and "model_type" in r.stderr
