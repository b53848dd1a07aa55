"""GLM-5.3's config and tensor table in both GGUF layouts (ds4's and llama.cpp's): the same random
model written in each reads back to the same config and the same tensor values under the other
names (A_log as -exp(A_log) and the conv weights with singleton axes in llama.cpp's); the table at
the published shapes; malformed files are one-line errors naming the key or tensor."""

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4tvm.errors import Ds4Error
from ds4tvm.families.glm5next.config import DS4, KDA, LLAMA, Config
from ds4tvm.families.glm5next.published import published_config
from ds4tvm.families.glm5next.random_model import tiny_config, write_random_glm5next
from ds4tvm.families.glm5next.tensors import file_name, tensor_specs
from ds4tvm.gguf import open_gguf
from ds4tvm.gguf.validate import check_tensors

pytestmark = pytest.mark.unit


def _load(path):
    f = open_gguf(path)
    cfg = Config.from_gguf(f)
    return f, cfg, check_tensors(f, tensor_specs(cfg))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_both_layouts_hold_the_same_model(tmp_path, lower_bound):
    files = {}
    for layout in (DS4, LLAMA):
        cfg = tiny_config(layout, gate_lower_bound=lower_bound)
        f, got, unused = _load(write_random_glm5next(tmp_path / f"{layout}.gguf", cfg, seed=7))
        assert got == cfg and unused == []
        files[layout] = f, got
    (a, ca), (b, cb) = files[DS4], files[LLAMA]
    assert replace(ca, layout=LLAMA) == cb
    assert "glm5-next.layer_types" in a._reader.fields and "glm5-next.attention.head_count_kv" in b._reader.fields
    transformed = 0
    for spec in tensor_specs(ca):
        name = file_name(cb, spec.name)
        x, y = np.asarray(a.tensors[spec.name].data), np.asarray(b.tensors[name].data)
        if spec.name.endswith("kda_a_log.weight"):
            assert name.endswith(".ssm_a")
            np.testing.assert_allclose(y, -np.exp(x), rtol=1e-7)
            transformed += 1
            continue
        assert x.tobytes() == y.tobytes(), (spec.name, name)
        if spec.name.endswith("_conv.weight"):
            assert a.tensors[spec.name].shape == (4, 64) and b.tensors[name].shape == (4, 1, 64, 1)
    assert transformed == sum(t == KDA for t in ca.layer_types)


def test_published_shapes():
    """ds4-spec §1.4's GLM-5.3-Flash tensors."""
    cfg = published_config()
    cfg.validate()
    specs = {s.name: s.shape for s in tensor_specs(cfg)}
    assert specs["blk.0.kda_q.weight"] == (4096, 8192) and specs["blk.0.kda_f_a.weight"] == (4096, 128)
    assert specs["blk.0.kda_f_b.weight"] == (128, 8192) and specs["blk.0.kda_beta.weight"] == (4096, 64)
    assert specs["blk.0.kda_output.weight"] == (8192, 4096) and specs["blk.0.ffn_gate.weight"] == (4096, 12288)
    assert specs["blk.3.attn_k_b.weight"] == (256, 512, 64) and specs["blk.3.attn_v_b.weight"] == (512, 256, 64)
    assert specs["blk.3.ffn_gate_exps.weight"] == (4096, 2048, 288) and "blk.3.indexer.pool_ape.weight" in specs
    # DSA iff L % 4 == 3 or L = 45 (the MTP layer)
    assert "blk.43.attn_k_b.weight" in specs and "blk.44.kda_q.weight" in specs and "blk.44.attn_k_b.weight" not in specs
    assert "blk.45.nextn.eh_proj.weight" in specs and "blk.45.hc_attn_fn.weight" not in specs
    assert "blk.44.hc_attn_fn.weight" in specs and "output_norm.weight" in specs
    llama = {s.name: s.shape for s in tensor_specs(replace(cfg, layout=LLAMA))}
    assert llama["blk.0.ssm_conv1d_q.weight"] == (4, 1, 8192, 1) and llama["blk.0.ssm_a"] == (64,)
    assert llama["blk.3.indexer_compressor_ape.weight"] == (128, 4) and len(llama) == len(specs)


KEY_CASES = [
    (DS4, {"glm5-next.layer_types": [0, 0, 1]}, "glm5-next.layer_types must hold 7 values"),
    (DS4, {"glm5-next.layer_types": None, "glm5-next.attention.head_count_kv": None},
     "missing metadata key glm5-next.layer_types (ds4's layout) or glm5-next.attention.head_count_kv"),
    (DS4, {"glm5-next.attention.indexer.top_k": None}, "missing required metadata key glm5-next.attention.indexer.top_k"),
    (DS4, {"glm5-next.linear_attention.conv_kernel": "four"}, "glm5-next.linear_attention.conv_kernel has type STRING"),
    (DS4, {"glm5-next.layer_types": [0, 0, 1, 0, 0, 1, 0]}, "marks an MTP layer as KDA"),
    (DS4, {"glm5-next.attention.rope_dimension_count": 64}, "has no RoPE part"),
    (LLAMA, {"glm5-next.attention.head_count_kv": [0, 0, 1, 0, 0, 1]},
     "glm5-next.attention.head_count_kv must hold 7 values"),
    (LLAMA, {"glm5-next.attention.indexer.kpool": 3}, "glm5-next.attention.indexer.kpool is 3"),
    (LLAMA, {"glm5-next.attention.key_length": 32}, "caches the 64-wide latent"),
    (LLAMA, {"glm5-next.swiglu_clamp_exp": [1.5, 1.5]}, "glm5-next.swiglu_clamp_exp has 2 entries for 7 layers"),
    (LLAMA, {"glm5-next.attention.indexer.types": [False] * 6}, "makes the first DSA layer (2) reuse"),
]


@pytest.mark.parametrize("layout,meta,message", KEY_CASES)
def test_malformed_keys(tmp_path, layout, meta, message):
    path = write_random_glm5next(tmp_path / "bad.gguf", tiny_config(layout), metadata=meta)
    with pytest.raises(Ds4Error) as e:
        _load(path)
    assert message in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def _drop(name):
    return lambda tensors: [t for t in tensors if t.name != name]


def _retype(name, qtype):
    from ds4tvm.gguf.quant import quantize
    from ds4tvm.gguf.writer import TensorOut

    def edit(tensors):
        return [TensorOut(t.name, qtype, t.shape, lambda t=t: quantize(np.zeros(t.shape), qtype)) if t.name == name
                else t for t in tensors]
    return edit


def _reshape(name):
    from ds4tvm.gguf.writer import TensorOut

    def edit(tensors):
        return [TensorOut(t.name, t.qtype, t.shape[:-1] + (t.shape[-1] + 32,),
                          lambda t=t: np.zeros(t.shape[:-1] + (t.shape[-1] + 32,), np.float16)) if t.name == name
                else t for t in tensors]
    return edit


TENSOR_CASES = [
    (DS4, _drop("blk.0.kda_beta.weight"), "missing tensor blk.0.kda_beta.weight"),
    (LLAMA, _drop("blk.1.ssm_a"), "missing tensor blk.1.ssm_a"),
    (LLAMA, _drop("blk.2.indexer_compressor_gate.weight"), "missing tensor blk.2.indexer_compressor_gate.weight"),
    (DS4, _drop("blk.6.nextn.shared_head_norm.weight"), "missing tensor blk.6.nextn.shared_head_norm.weight"),
    (DS4, _reshape("blk.2.attn_q_b.weight"), "tensor blk.2.attn_q_b.weight has shape [80, 128], expected [48, 128]"),
    (LLAMA, _retype("blk.0.ssm_norm.weight", QT.F16), "tensor blk.0.ssm_norm.weight has unsupported type F16"),
    # an MTP input of neither width (2 E, the output head's input; 5 E, the hc streams) is named
    (DS4, _reshape("blk.6.nextn.eh_proj.weight"), "tensor blk.6.nextn.eh_proj.weight has shape [160, 64], "
                                                    "expected [128, 64]"),
]


@pytest.mark.parametrize("layout,edit,message", TENSOR_CASES)
def test_malformed_tensors(tmp_path, layout, edit, message):
    path = write_random_glm5next(tmp_path / "bad.gguf", tiny_config(layout), edit_specs=edit)
    with pytest.raises(Ds4Error) as e:
        _load(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_llama_layout_without_mtp_shared_head_norm_still_loads(tmp_path):
    """llama.cpp's loader treats nextn.shared_head_norm as optional; ds4's requires it (above)."""
    path = write_random_glm5next(tmp_path / "m.gguf", tiny_config(LLAMA),
                                 edit_specs=_drop("blk.6.nextn.shared_head_norm.weight"))
    _, cfg, unused = _load(path)
    assert cfg.n_nextn == 1 and unused == []


def test_mtp_input_read_from_eh_proj_width(tmp_path):
    """eh_proj [5 E -> E] makes the nextn layer read the hc streams, with hnorm as wide as they are."""
    from ds4tvm.families.glm5next.config import HIDDEN, STREAMS

    for reads in (HIDDEN, STREAMS):
        _, cfg, unused = _load(write_random_glm5next(tmp_path / f"{reads}.gguf", tiny_config(mtp_input=reads)))
        assert cfg.mtp_input == reads and unused == []
    from ds4tvm.gguf.writer import TensorOut

    narrow = TensorOut("blk.6.nextn.hnorm.weight", QT.F32, (64,), lambda: np.ones(64, np.float32))
    path = write_random_glm5next(tmp_path / "bad.gguf", tiny_config(mtp_input=STREAMS),
                                 edit_specs=lambda ts: [narrow if t.name == narrow.name else t for t in ts])
    with pytest.raises(Ds4Error, match=r"tensor blk.6.nextn.hnorm.weight has shape \[64\], expected \[256\]"):
        _load(path)
