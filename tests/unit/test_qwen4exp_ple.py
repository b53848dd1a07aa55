"""Qwen3.8's PLE rows (families/qwen4exp/ple.py) against transformers' `Qwen4ExpTextNGramEmbedding`:
the table rows each token reads (u64 XOR hashes, the EOS cut, the head ranges) at the real model's
vocabulary and head sizes, and the rows read from a GGUF table in each stored type against gguf-py's
dequantizer of the whole table."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4tvm.families.qwen4exp.ple import TABLE, context_windows, read_rows, row_indices

pytestmark = pytest.mark.unit
EOS = 248044


def _hf_rows(cfg_kw: dict, ids: np.ndarray) -> tuple[np.ndarray, object]:
    """The rows transformers' module gathers for ids (one sequence from position 0)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as q

    cfg = Qwen4ExpTextConfig(**cfg_kw)
    with torch.device("meta"):   # the real table would be 200 GB
        m = q.Qwen4ExpTextNGramEmbedding(cfg, cfg.hidden_size, layer_idx=1, ple_layer_index=0)
    m.layer_multipliers = q._build_layer_multipliers(m.unigram_vocab_size, m.ngram_size, 0, m.seed)
    m.ngram_heads_vocab_sizes = torch.tensor(m.head_vocab_sizes, dtype=torch.long)
    m.ngram_heads_offsets = torch.tensor(m.head_offsets, dtype=torch.long)

    class RowIds(torch.nn.Module):   # stands in for the (here ~320M-row) table: returns the row ids
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, rows):
            return rows.to(torch.float64).unsqueeze(-1)

    m.ngram_embedding = RowIds()
    with torch.no_grad():
        out = m(torch.tensor(ids[None]), None)[0]
    return out.numpy().astype(np.int64), m


def test_rows_match_transformers_at_real_sizes():
    kw = dict(vocab_size=248320, hidden_size=2560, eos_token_id=EOS, ngram_size=3, heads_per_ngram=8,
              ple_layer_ids=[2], num_hidden_layers=4, layer_types=["linear_attention"] * 4)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 248320, 64)
    ids[[0, 5, 6, 20, 41, 63]] = EOS      # at the start, twice in a row, inside, last
    want, m = _hf_rows(kw, ids)
    mult = [int(v) for v in m.layer_multipliers]
    assert max(mult) > 2 ** 40            # the products need 64-bit arithmetic
    ctx = context_windows(ids, 0, 3, EOS)
    got = row_indices(ctx, mult, [int(v) for v in m.ngram_heads_offsets], [int(v) for v in m.ngram_heads_vocab_sizes], 8)
    np.testing.assert_array_equal(got, want)
    # the same rows when the tokens come in calls of a few, the context from the history before them
    parts, start = [], 0
    for n in (1, 2, 5, 1, 30, 25):
        before = list(ids[max(0, start - 2):start])
        parts.append(row_indices(context_windows(before + list(ids[start:start + n]), len(before), 3, EOS), mult,
                                 [int(v) for v in m.ngram_heads_offsets], [int(v) for v in m.ngram_heads_vocab_sizes], 8))
        start += n
    np.testing.assert_array_equal(np.concatenate(parts), want)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_1, QT.Q4_0])
def test_rows_read_from_the_table_match_gguf_dequantization(qtype, tmp_path):
    from gguf.quants import dequantize

    from ds4tvm.gguf import open_gguf
    from ds4tvm.gguf.quant import quantize
    from ds4tvm.gguf.writer import TensorOut, write_gguf

    rng = np.random.default_rng(0)
    values = rng.standard_normal((300, 64)).astype(np.float32)
    data = quantize(values, qtype)
    write_gguf(tmp_path / "t.gguf", "qwen4exp", {}, [TensorOut(TABLE, qtype, values.shape, lambda: data)])
    table = open_gguf(tmp_path / "t.gguf").tensors[TABLE]
    rows = rng.integers(0, 300, (7, 4))
    whole = dequantize(np.asarray(table.data), qtype).reshape(300, 64)
    np.testing.assert_array_equal(read_rows(table, rows), whole[rows.reshape(-1)].reshape(7, 4 * 64))
