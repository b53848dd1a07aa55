"""Qwen3.8's config and tensor table: a random model reads back to its config with every tensor
used; malformed files (missing PLE keys, short head arrays, a table smaller than the head ranges,
wrong shapes or types) are one-line errors naming the key or tensor, exit 2 at the CLI."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from conftest import run_ds4
from ds4tvm.errors import Ds4Error
from ds4tvm.families.qwen4exp.config import Config
from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp
from ds4tvm.families.qwen4exp.tensors import tensor_specs
from ds4tvm.gguf import open_gguf
from ds4tvm.gguf.quant import quantize
from ds4tvm.gguf.validate import check_tensors
from ds4tvm.gguf.writer import TensorOut

pytestmark = pytest.mark.unit
P = "qwen4exp."


def _load(path):
    f = open_gguf(path)
    cfg = Config.from_gguf(f)
    return cfg, check_tensors(f, tensor_specs(cfg))


def test_random_model_reads_back(tmp_path):
    cfg = tiny_config()
    got, unused = _load(write_random_qwen4exp(tmp_path / "m.gguf", cfg, seed=1))
    assert got == cfg and unused == []
    assert got.multipliers[0] > 2 ** 40 and got.ple_table_rows == 624 >= got.ple_rows == 620


KEY_CASES = [
    ({P + "ple.eos_token_id": None}, "missing required metadata key qwen4exp.ple.eos_token_id"),
    ({P + "ple.layer_multipliers": None}, "qwen4exp.ple.layer_multipliers"),
    ({P + "ple.head_offsets": [0, 61, 128]}, "metadata key qwen4exp.ple.head_offsets has 3 entries; expected 8"),
    ({P + "ple.head_vocab_sizes": [61, 67, 71, 73, 79, 83, 89, 400]},
     "ple.head_offsets + head_vocab_sizes address 923 table rows, but tensor per_layer_token_embd.weight has 624"),
    ({P + "ple.layers": [3]}, "metadata key qwen4exp.ple.layers is [3]; expected one trunk GDN layer"),
    ({P + "embedding_length_per_layer_input": 4}, "metadata key qwen4exp.embedding_length_per_layer_input is 4"),
    ({P + "attention.compress_ratios": [0, 0, 0, 4]}, "qwen4exp.attention.compress_ratios has 4 entries for 8 layers"),
    ({P + "ssm.inner_size": 48}, "metadata key qwen4exp.ssm.inner_size is 48; expected time_step_rank x state_size = 64"),
    ({P + "ssm.output_gate_type": "tanh"}, "qwen4exp.ssm.output_gate_type is 'tanh'; expected one of sigmoid, silu"),
    ({P + "attention.indexer.top_k": 30}, "qwen4exp.attention.indexer.top_k 30 is not a multiple of layer 3's ratio 4"),
]


@pytest.mark.parametrize("meta,message", KEY_CASES)
def test_malformed_keys(tmp_path, meta, message):
    path = write_random_qwen4exp(tmp_path / "bad.gguf", tiny_config(), metadata=meta)
    with pytest.raises(Ds4Error) as e:
        _load(path)
    assert message in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def _drop(name):
    return lambda tensors: [t for t in tensors if t.name != name]


def _rows(name, rows):
    def edit(tensors):
        return [TensorOut(t.name, t.qtype, (rows, t.shape[1]), lambda: np.zeros((rows, 8), np.float16))
                if t.name == name else t for t in tensors]
    return edit


def _retype(name, qtype):
    def edit(tensors):
        return [TensorOut(t.name, qtype, t.shape, lambda t=t: quantize(np.zeros(t.shape), qtype)) if t.name == name
                else t for t in tensors]
    return edit


TENSOR_CASES = [
    (_drop("per_layer_token_embd.weight"), "missing tensor per_layer_token_embd.weight"),
    (_rows("per_layer_token_embd.weight", 600), "tensor per_layer_token_embd.weight has 600"),
    (_drop("blk.1.ple_conv1d.weight"), "missing tensor blk.1.ple_conv1d.weight"),
    (_drop("blk.3.indexer.k_proj.weight"), "missing tensor blk.3.indexer.k_proj.weight"),
    (_drop("output_hc_up.weight"), "missing tensor output_hc_up.weight"),
    (_retype("blk.0.ssm_a", QT.F16), "tensor blk.0.ssm_a has unsupported type F16"),
]


@pytest.mark.parametrize("edit,message", TENSOR_CASES)
def test_malformed_tensors(tmp_path, edit, message):
    path = write_random_qwen4exp(tmp_path / "bad.gguf", tiny_config(), edit_specs=edit)
    with pytest.raises(Ds4Error) as e:
        _load(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_wrong_shape_is_exit_2_with_one_line(tmp_path):
    def wider(tensors):
        return [TensorOut(t.name, t.qtype, (t.shape[0] + 1, t.shape[1]), lambda t=t: np.zeros(
            (t.shape[0] + 1, t.shape[1]), np.float16)) if t.name == "blk.0.attn_qkv.weight" else t for t in tensors]

    path = write_random_qwen4exp(tmp_path / "bad.gguf", tiny_config(), edit_specs=wider)
    r = run_ds4("inspect", path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor blk.0.attn_qkv.weight has shape [64, 129], expected [64, 128]" in lines[0]


def test_mtp_model_reads_back_with_every_tensor_used(tmp_path):
    cfg = tiny_config(n_nextn=1)
    got, unused = _load(write_random_qwen4exp(tmp_path / "m.gguf", cfg, seed=1))
    assert got == cfg and got.n_layers == 8 and got.n_all == 9 and unused == []


MTP_CASES = [
    (dict(edit_specs=_drop("blk.8.nextn.eh_proj.weight")), "missing tensor blk.8.nextn.eh_proj.weight"),
    (dict(edit_specs=_drop("blk.8.ffn_down_exps.weight")), "missing tensor blk.8.ffn_down_exps.weight"),
    (dict(metadata={P + "attention.compress_ratios": [0, 0, 0, 4, 0, 0, 0, 4, 0]}),
     "compress_ratios marks the MTP layer as GDN"),
    (dict(metadata={P + "nextn_predict_layers": 2}), "qwen4exp.nextn_predict_layers is 2; expected 0 or 1"),
]


@pytest.mark.parametrize("edit,message", MTP_CASES)
def test_malformed_mtp_layer(tmp_path, edit, message):
    path = write_random_qwen4exp(tmp_path / "bad.gguf", tiny_config(n_nextn=1), **edit)
    r = run_ds4("inspect", path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr
