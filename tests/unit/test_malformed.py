"""A corpus of malformed inputs: each one gives exit code 2 and one line naming the problem."""

import struct

import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

from conftest import run_ds4
from ds4tvm.families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
from ds4tvm.gguf.validate import TensorSpec

CFG = tiny_config()


def _good(path):
    return write_random_deepseek4(path, CFG, seed=3)


def _patch(src, dst, edits):
    data = bytearray(src.read_bytes())
    for offset, value in edits:
        data[offset:offset + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


def _tensor_field_offsets(path, name):
    """Byte offsets of a tensor's type id and data offset inside its tensor-info record."""
    r = GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    pos = t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)
    return pos, pos + 4


def _specs_without(name):
    return lambda specs: [s for s in specs if s.name != name]


def _specs_replace(name, **changes):
    def edit(specs):
        return [TensorSpec(s.name, changes.get("shape", s.shape), s.types, s.optional, s.index_bound)
                if s.name == name else s for s in specs]
    return edit


def _typed(name, qtype):
    return lambda spec: qtype if spec.name == name else default_type(spec)


def build_corpus(d):
    good = _good(d / "good.gguf")
    size = good.stat().st_size
    r = GGUFReader(good)
    data_start = min(t.data_offset for t in r.tensors)
    type_pos, off_pos = _tensor_field_offsets(good, "blk.1.attn_q_a.weight")
    cases = {}

    def add(name, path, expect):
        cases[name] = (path, expect)

    add("missing path", d / "nope.gguf", "no such file")
    (d / "a_dir.gguf").mkdir()
    add("directory", d / "a_dir.gguf", "directory")
    (d / "empty.gguf").write_bytes(b"")
    add("zero-length", d / "empty.gguf", "empty")
    (d / "short.gguf").write_bytes(b"GGUF\x03\x00")
    add("shorter than a header", d / "short.gguf", "too short")
    add("wrong magic", _patch(good, d / "magic.gguf", [(0, b"GGML")]), "not a GGUF")
    add("bad version", _patch(good, d / "version.gguf", [(4, struct.pack("<I", 99))]), "version 99")
    for cut in (40, 300, 2000, data_start - 10, data_start + 100, size - 1000):
        p = d / f"trunc{cut}.gguf"
        p.write_bytes(good.read_bytes()[:cut])
        add(f"truncated at {cut}", p, "truncated")
    add("data offset past the end", _patch(good, d / "offset.gguf", [(off_pos, struct.pack("<Q", size * 4))]),
        "past the end")
    add("unknown type id", _patch(good, d / "typeid.gguf", [(type_pos, struct.pack("<I", 250))]),
        "unknown GGML type")
    add("missing key", write_random_deepseek4(d / "nokey.gguf", CFG, metadata={"deepseek4.block_count": None}),
        "deepseek4.block_count")
    add("wrong-typed key", write_random_deepseek4(d / "strkey.gguf", CFG, metadata={"deepseek4.block_count": "five"}),
        "deepseek4.block_count")
    add("wrong-typed array", write_random_deepseek4(d / "strarr.gguf", CFG,
                                                    metadata={"deepseek4.swiglu_clamp_exp": ["a"] * 5}),
        "swiglu_clamp_exp")
    add("ratios of wrong length", write_random_deepseek4(d / "ratios.gguf", CFG,
                                                         metadata={"deepseek4.attention.compress_ratios": [0, 4]}),
        "compress_ratios")
    add("unsupported ratio", write_random_deepseek4(d / "ratio8.gguf", CFG,
                                                    metadata={"deepseek4.attention.compress_ratios": [0, 0, 8, 128, 4]}),
        "compress_ratios")
    add("two kv heads", write_random_deepseek4(d / "kv2.gguf", CFG, metadata={"deepseek4.attention.head_count_kv": 2}),
        "head_count_kv")
    add("unknown architecture", write_random_deepseek4(d / "arch.gguf", CFG, metadata={"general.architecture": "llama"}),
        "architecture 'llama'")
    add("missing tensor", write_random_deepseek4(d / "notensor.gguf", CFG, edit_specs=_specs_without("blk.2.attn_kv.weight")),
        "missing tensor blk.2.attn_kv.weight")
    add("missing compressor tensor", write_random_deepseek4(
        d / "nocomp.gguf", CFG, edit_specs=_specs_without("blk.3.attn_compressor_ape.weight")),
        "blk.3.attn_compressor_ape.weight")
    add("wrong shape", write_random_deepseek4(d / "shape.gguf", CFG, edit_specs=_specs_replace(
        "blk.0.attn_q_b.weight", shape=(32, 128))), "blk.0.attn_q_b.weight has shape")
    add("unsupported type", write_random_deepseek4(d / "q5.gguf", CFG, type_of=_typed("blk.1.attn_q_a.weight", QT.Q5_0)),
        "unsupported type Q5_0")
    add("int tensor as float", write_random_deepseek4(d / "tid.gguf", CFG, type_of=_typed("blk.0.ffn_gate_tid2eid.weight", QT.F32)),
        "blk.0.ffn_gate_tid2eid.weight")
    tid = next(t for t in r.tensors if t.name == "blk.0.ffn_gate_tid2eid.weight")
    add("expert id out of range", _patch(good, d / "tid99.gguf", [(tid.data_offset + 8, struct.pack("<i", 99))]),
        "blk.0.ffn_gate_tid2eid.weight holds 99, expected values in 0..3")
    for name, key, value in (("sinkhorn 10^8", "hyper_connection.sinkhorn_iterations", 10 ** 8),
                             ("sinkhorn -5", "hyper_connection.sinkhorn_iterations", -5),
                             ("NaN epsilon", "attention.layer_norm_rms_epsilon", float("nan")),
                             ("window 2^31-1", "attention.sliding_window", 2 ** 31 - 1)):
        add(name, write_random_deepseek4(d / f"{name}.gguf", CFG, metadata={f"deepseek4.{key}": value}),
            f"metadata key deepseek4.{key} is")
    raw = good.read_bytes()
    at = raw.index(b"ds4tvm random")
    add("string not UTF-8", _patch(good, d / "utf8.gguf", [(at + 3, b"\xff")]), "not valid UTF-8")
    add("array nested 3000 deep", _nested(d / "nested.gguf", 3000), "truncated or corrupt GGUF header")
    return cases


def _nested(path, depth):
    """A GGUF whose one key is an array of an array of ... (ggml's reader would recurse as deep)."""
    key = b"x.deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)   # ARRAY
    body += (struct.pack("<I", 9) + struct.pack("<Q", 1)) * depth + struct.pack("<I", 4) + struct.pack("<Q", 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("malformed"))


def test_corpus_is_large_enough(corpus):
    assert len(corpus) >= 20


def test_good_file_is_accepted(tmp_path):
    r = run_ds4("inspect", _good(tmp_path / "g.gguf"), "--json")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("case", [
    "missing path", "directory", "zero-length", "shorter than a header", "wrong magic", "bad version",
    "truncated at 40", "truncated at 300", "truncated at 2000", "data offset past the end",
    "unknown type id", "missing key", "wrong-typed key", "wrong-typed array", "ratios of wrong length",
    "unsupported ratio", "two kv heads", "unknown architecture", "missing tensor",
    "missing compressor tensor", "wrong shape", "unsupported type", "int tensor as float",
    "expert id out of range", "sinkhorn 10^8", "sinkhorn -5", "NaN epsilon", "window 2^31-1",
    "string not UTF-8", "array nested 3000 deep"])
def test_malformed_file_exits_2_with_one_line(corpus, case):
    path, expect = corpus[case]
    r = run_ds4("inspect", path)
    assert r.returncode == 2, (case, r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, (case, r.stderr)
    assert lines[0].startswith("ds4: error: ") and expect in lines[0], (case, lines[0])


def test_truncations_in_tensor_data(corpus):
    """Cuts inside the tensor data (whatever the exact offset) are caught too."""
    names = [n for n in corpus if n.startswith("truncated at") and n not in
             ("truncated at 40", "truncated at 300", "truncated at 2000")]
    assert len(names) == 3
    for n in names:
        path, _ = corpus[n]
        r = run_ds4("inspect", path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (n, r.stderr)
        assert "truncated" in r.stderr or "past the end" in r.stderr, (n, r.stderr)


@pytest.mark.parametrize("family, key, value", [
    ("glm5next", "glm5-next.hyper_connection.sinkhorn_iterations", 0),
    ("glm5next", "glm5-next.attention.layer_norm_rms_epsilon", float("inf")),
    ("qwen4exp", "qwen4exp.attention.layer_norm_rms_epsilon", float("nan")),
    ("qwen4exp", "qwen4exp.context_length", 2 ** 31 + 5)])
def test_every_family_checks_its_key_ranges(tmp_path, family, key, value):
    import importlib

    from ds4tvm.errors import Ds4Error
    from ds4tvm.families import load_model
    from ds4tvm.gguf import open_gguf

    mod = importlib.import_module(f"ds4tvm.families.{family}.random_model")
    write = getattr(mod, f"write_random_{family}")
    path = write(tmp_path / "m.gguf", mod.tiny_config(), metadata={key: value})
    with pytest.raises(Ds4Error, match=f"metadata key {key} is"):
        load_model(open_gguf(path))
