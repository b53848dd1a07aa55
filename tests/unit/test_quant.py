"""Planes are bit-exact: dequantizing them equals gguf-py's dequantizer on the original bytes."""

import tracemalloc

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ds4tvm.gguf.quant import FORMATS, CHUNK_BYTES, quantize, random_blocks, to_planes

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_K, QT.Q2_K, QT.Q6_K, QT.Q4_1, QT.IQ2_XXS, QT.MXFP4]
# Several blocks per row, several rows, and a leading expert axis: never a single block.
SHAPES = [(7, 768), (3, 5, 512)]


def test_every_required_type_has_planes():
    assert set(TYPES) <= set(FORMATS)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_planes_dequantize_exactly_like_gguf(qtype, shape):
    rng = np.random.default_rng(int(qtype) * 31 + len(shape))
    data = random_blocks(qtype, shape, rng)
    expected = quants.dequantize(data, qtype)
    assert np.isfinite(expected).all()
    planes = to_planes(data, qtype, shape)
    got = planes.dequantize()
    assert got.shape == shape and got.dtype == np.float32
    assert np.array_equal(got, expected)
    # Planes keep the format's bits: same size as the GGUF data, give or take unpacked scales.
    assert planes.nbytes <= data.nbytes * 1.03


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.MXFP4, QT.BF16], ids=lambda t: t.name)
def test_planes_of_quantized_values(qtype):
    """Types with a numpy quantizer: real quantized data, not only random bits."""
    rng = np.random.default_rng(5)
    values = rng.standard_normal((6, 320)).astype(np.float32)
    data = quantize(values, qtype)
    got = to_planes(data, qtype, values.shape).dequantize()
    assert np.array_equal(got, quants.dequantize(data, qtype))
    assert np.abs(got - values).max() < 0.6  # and they are close to what was quantized


def test_plain_planes_are_views():
    data = np.arange(64, dtype=np.float32).reshape(2, 32)
    p = to_planes(data, QT.F32, (2, 32))
    assert np.shares_memory(p.fields["w"], data)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.IQ2_XXS], ids=lambda t: t.name)
def test_real_size_row_count_needs_no_more_than_the_planes(tmp_path, qtype):
    """129,280 rows (DeepSeek-V4's vocabulary, as in output.weight) read from a memory map: the
    split allocates the planes once and works through bounded chunks."""
    rows, K = 129280, 256
    bs, ts = GGML_QUANT_SIZES[qtype]
    path = tmp_path / "raw.bin"
    block = random_blocks(qtype, (1024, K), np.random.default_rng(1))
    with open(path, "wb") as f:
        for _ in range(rows // 1024):
            block.tofile(f)
        block[: rows % 1024].tofile(f)
    raw = np.memmap(path, dtype=np.uint8, mode="r").reshape(rows, K // bs * ts)
    tracemalloc.start()
    try:
        planes = to_planes(raw, qtype, (rows, K))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= planes.nbytes + 4 * CHUNK_BYTES, (peak, planes.nbytes)
    assert planes.nbytes <= raw.nbytes * 1.03
    i = [0, 777, rows - 1]
    expected = quants.dequantize(np.asarray(raw[i]), qtype)
    got = to_planes(np.asarray(raw[i]), qtype, (3, K)).dequantize()
    assert np.array_equal(got, expected)
    assert np.array_equal(planes.dequantize()[i], expected)


def test_q4_k_quantizer_reads_back_through_gguf():
    """The Q4_K test-data quantizer (sub-block minimum and range): gguf's dequantizer gets the
    values back within half a quantization step (plus the 6-bit scale rounding), unbiased."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((16, 768)) * rng.uniform(0.01, 1.0, (16, 1))).astype(np.float32)
    y = quants.dequantize(quantize(x, QT.Q4_K), QT.Q4_K)
    blocks = x.reshape(16, -1, 32)
    step = ((blocks.max(2) - np.minimum(blocks.min(2), 0)) / 15)[..., None]
    err = np.abs(y.reshape(blocks.shape) - blocks)
    assert (err <= 0.5 * step + 0.03 * np.abs(blocks).max(axis=(1, 2), keepdims=True)).all()
    assert abs(float((y - x).mean())) < 1e-2 * float(np.abs(x).mean())   # random blocks: nearly all one sign


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_a_tensor_read_as_float32_is_bound_as_its_dequantized_values(qtype):
    """QWeight.read_as_float32: the engine binds the plane field 'w:f32' as gguf-py's float32 values,
    and the QWeight refuses every read but values()."""
    from tvm.relax.frontend import nn

    from ds4tvm.gguf.quant import derived_plane
    from ds4tvm.nn.qweight import QWeight, parameter_sources

    raw = quantize(np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32), qtype)
    got = derived_plane(to_planes(raw, qtype, (4, 64)), "w:f32")
    assert got.dtype == np.float32 and np.array_equal(got, quants.dequantize(raw, qtype))
    w = QWeight("blk.0.attn_compressor_ape.weight", qtype, (4, 64)).read_as_float32()
    assert parameter_sources(w)[id(w.plane_w)] == ("blk.0.attn_compressor_ape.weight", "w:f32", "model")
    with pytest.raises(ValueError, match="read it with values"):
        w.linear(nn.Tensor.placeholder((1, 64), "float32"))
