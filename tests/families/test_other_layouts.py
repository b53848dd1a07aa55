"""GGUFs written the way other converters write them (gguf-py from numpy arrays, other llama.cpp
versions): shapes without ggml's trailing size-1 axes, 0/1 integers for booleans, HC and PLE norm
gammas grouped [n_embd, n_hc] instead of flat. They are the same model: `ds4 inspect` says how they
are stored, and the engine gives the flat file's logits from them. A transposed matrix (same element
count, another order) is still refused."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGUFValueType

from conftest import compile_here, run_ds4
from ds4tvm.artifact import MODEL, Manifest, file_identity
from ds4tvm.errors import Ds4Error
from ds4tvm.families import load_model
from ds4tvm.gguf import open_gguf
from ds4tvm.gguf.validate import same_layout

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300]


def _trailing_ones_dropped(names):
    """gguf-py stores a numpy array's own axes: one without ggml's padding axes of 1."""
    def edit(tensors):
        out = []
        for t in tensors:
            if t.name in names:
                shape = t.shape
                while len(shape) > 1 and shape[0] == 1:   # numpy order: ggml's trailing axes lead
                    shape = shape[1:]
                assert shape != t.shape, f"{t.name} {t.shape} has no trailing size-1 axis to drop"
                t = replace(t, shape=shape, produce=lambda p=t.produce, s=shape: p().reshape(s))
            out.append(t)
        return out
    return edit


def _grouped(names, groups):
    """Flat [n_hc * n_embd] vectors written as [n_embd, n_hc] (numpy (n_hc, n_embd)): the same bytes."""
    def edit(tensors):
        out = []
        for t in tensors:
            if t.name in names:
                shape = (groups, t.shape[0] // groups)
                t = replace(t, shape=shape, produce=lambda p=t.produce, s=shape: p().reshape(s))
            out.append(t)
        return out
    return edit


def _swap_manifest_weights(art, other_gguf, dst):
    """A copy of art whose model file is other_gguf: the same compiled code, so the logits of a file
    in another layout can be compared with the flat file's without a second compile."""
    shutil.copytree(art, dst)
    raw = json.loads((dst / "manifest.json").read_text())
    raw["weights"][MODEL] = file_identity(other_gguf)
    (dst / "manifest.json").write_text(json.dumps(raw))
    Manifest.read(dst)
    return dst


def _prefill_logits(art):
    from ds4tvm.runtime.engine import Engine

    return Engine(art).prefill(PROMPT).logits


def _assert_same_logits(flat, other, tmp_path):
    """The flat file compiled, and the same artifact reading the other file: bit-identical logits."""
    compile_here(flat, "--target", "llvm", "-o", tmp_path / "art", "--max-context", "64", "--max-verify", "4",
                 "--prefill-chunk", "16", "--quiet")
    want = _prefill_logits(tmp_path / "art")
    got = _prefill_logits(_swap_manifest_weights(tmp_path / "art", other, tmp_path / "art-other"))
    np.testing.assert_array_equal(got, want)


def _write_glm(path, **kw):
    from ds4tvm.families.glm5next.config import LLAMA
    from ds4tvm.families.glm5next.random_model import tiny_config, write_random_glm5next

    cfg = tiny_config(LLAMA, n_nextn=0, layer_types=(0, 0, 1, 0, 0, 1), swiglu_exp=(1.5,) * 6, swiglu_shexp=(1.5,) * 6,
                      idx_full=(True,) * 5 + (False,))
    return write_random_glm5next(path, cfg, seed=4, **kw), cfg


def test_glm_trailing_axes_and_integer_booleans(tmp_path):
    flat, cfg = _write_glm(tmp_path / "flat.gguf")
    convs = [f"blk.{i}.ssm_conv1d_{x}.weight" for i in (0, 1) for x in "qkv"]
    key = "glm5-next.attention.indexer.types"
    other, _ = _write_glm(tmp_path / "other.gguf", edit_specs=_trailing_ones_dropped(convs),
                          metadata={key: ([int(b) for b in cfg.idx_full], GGUFValueType.INT32)})
    f = open_gguf(other)
    assert f.tensors[convs[0]].shape == open_gguf(flat).tensors[convs[0]].shape[:-1]
    assert f._reader.fields[key].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    m = load_model(f)
    assert m.config.idx_full == cfg.idx_full
    assert set(f.layout_notes) == set(convs)

    r = run_ds4("inspect", other, "--json")
    assert r.returncode == 0, r.stderr
    layouts = json.loads(r.stdout)["details"]["layouts"]
    assert all(f"{name} stored as [4, 1, 64] for [4, 1, 64, 1] (trailing size-1 axes)" in layouts
               for name in convs), layouts

    _assert_same_logits(flat, other, tmp_path)


def test_integer_booleans_other_than_0_1_are_refused(tmp_path):
    key = "glm5-next.attention.indexer.types"
    bad, _ = _write_glm(tmp_path / "bad.gguf", metadata={key: ([1, 1, 2, 1, 1, 0], GGUFValueType.INT32)})
    with pytest.raises(Ds4Error, match=f"{key} holds 2, expected booleans"):
        load_model(open_gguf(bad))


def test_qwen_grouped_norm_gammas(tmp_path):
    from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp

    cfg = tiny_config()
    flat = write_random_qwen4exp(tmp_path / "flat.gguf", cfg, seed=2)
    names = ["blk.0.hc_attn_norm.weight", "blk.1.hc_ffn_norm.weight", "output_hc_norm.weight",
             "blk.1.ple_norm_key.weight", "blk.1.ple_norm_conv.weight"]
    other = write_random_qwen4exp(tmp_path / "other.gguf", cfg, seed=2, edit_specs=_grouped(names, cfg.hc))
    f = open_gguf(other)
    assert f.tensors[names[0]].shape == (cfg.n_embd, cfg.hc)
    load_model(f)
    assert set(f.layout_notes) == set(names)
    assert "a vector stored as a matrix of its rows" in f.layout_notes[names[0]]

    _assert_same_logits(flat, other, tmp_path)


def test_a_transposed_matrix_is_refused(tmp_path):
    """Same element count, other order: never accepted by count alone."""
    from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp

    cfg = tiny_config()
    name = "blk.0.hc_attn_down.weight"   # [W, rank]

    def transpose(tensors):
        return [replace(t, shape=t.shape[::-1], produce=lambda p=t.produce: np.ascontiguousarray(p().T))
                if t.name == name else t for t in tensors]

    other = write_random_qwen4exp(tmp_path / "t.gguf", cfg, seed=2, edit_specs=transpose)
    with pytest.raises(Ds4Error, match=f"tensor {name} has shape \\[{cfg.hc_rank}, {cfg.hc * cfg.n_embd}\\]"):
        load_model(open_gguf(other))


@pytest.mark.parametrize("stored, expected, ok", [
    ((4, 1, 96), (4, 1, 96, 1), True), ((4, 1, 96, 1, 1), (4, 1, 96), True), ((64, 4), (256,), True),
    ((256, 1), (256,), True), ((4, 96), (4, 1, 96, 1), False), ((4, 64), (64, 4), False),
    ((2, 2, 64), (256,), False), ((255,), (256,), False)])
def test_same_layout_rules(stored, expected, ok):
    assert (same_layout(stored, expected) is not None) == ok
