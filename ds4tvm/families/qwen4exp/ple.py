"""Qwen3.8's per-layer n-gram embeddings (PLE, ds4-spec §5): which rows of the hashed table each
token reads, and reading them. The table (`per_layer_token_embd.weight`, ~95 GiB in the real BF16
file) is never bound to the compiled module: for every call the host computes each token's rows
from its n-gram context and reads only those rows from the mmap, dequantized to float32, and passes
them in as the `ple` input (families.Family.host_inputs)."""

from __future__ import annotations

import weakref

import numpy as np

TABLE = "per_layer_token_embd.weight"


def context_windows(tokens, n_before: int, ngram: int, eos: int) -> np.ndarray:
    """[n, ngram] uint64: for each token after the first n_before of `tokens` (which are its
    context only), the token and the ngram - 1 before it, newest first. An entry is EOS when it lies
    before the sequence or an EOS lies between it and the token (an EOS ends its n-grams)."""
    tokens = [int(t) for t in tokens]
    n = len(tokens) - n_before
    out = np.empty((n, ngram), np.uint64)
    for t in range(n):
        p = n_before + t
        out[t, 0] = tokens[p]
        cut = False
        for j in range(1, ngram):
            q = p - j
            cut = cut or q < 0 or tokens[q] == eos
            out[t, j] = eos if cut else tokens[q]
    return out


def row_indices(ctx: np.ndarray, multipliers, offsets, vocab_sizes, heads_per_ngram: int) -> np.ndarray:
    """[n, (ngram - 1) * heads_per_ngram] int64 table rows: for n-gram order m = 2..ngram the hash
    h = XOR_j<m (ctx_j * multiplier_j) (u64, wrapping) and, for each head g of that order,
    h mod vocab_sizes[g] + offsets[g]."""
    mult = np.asarray(multipliers, np.uint64)
    ngram = ctx.shape[1]
    with np.errstate(over="ignore"):
        prod = ctx * mult[None, :ngram]
    cols = []
    for m in range(2, ngram + 1):
        h = np.bitwise_xor.reduce(prod[:, :m], axis=1)
        for g in range((m - 2) * heads_per_ngram, (m - 1) * heads_per_ngram):
            cols.append((h % np.uint64(vocab_sizes[g])).astype(np.int64) + int(offsets[g]))
    return np.stack(cols, axis=1)


def read_rows(table, rows: np.ndarray) -> np.ndarray:
    """float32 [n, heads * width] of the table rows (a reader TensorInfo, its data an mmap view), touching only
    those rows' pages."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    qtype = QT(table.ggml_type)
    flat = rows.reshape(-1)
    data = np.asarray(table.data[flat])
    values = data.astype(np.float32) if qtype in (QT.F32, QT.F16) else dequantize(data, qtype)
    return values.reshape(rows.shape[0], -1).astype(np.float32, copy=False)


_CONFIGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # GGUFFile -> Config, gone with the file


def host_rows(engine, inputs) -> np.ndarray:
    """The `ple` input of a call (families.Family.host_inputs): for the call's tokens at positions
    start.., their table rows read from the model GGUF; the context before them is the engine's
    committed history. Zeros for a model without PLE."""
    from .config import Config

    f = engine.files["model"]
    cfg = _CONFIGS.get(f)
    if cfg is None:
        cfg = _CONFIGS[f] = Config.from_gguf(f)
    ids = np.asarray(inputs["ids"], dtype=np.int64).reshape(-1)
    if not cfg.ple_layers:
        return np.zeros((len(ids), cfg.n_embd), np.float32)
    start = int(inputs.get("start", engine.pos))
    before = [int(t) for t in engine.history[max(0, start - (cfg.ngram - 1)):start]]
    ctx = context_windows(before + ids.tolist(), len(before), cfg.ngram, cfg.eos)
    rows = row_indices(ctx, cfg.multipliers, cfg.head_offsets, cfg.head_vocab_sizes, cfg.heads_per_ngram)
    return read_rows(f.tensors[TABLE], rows)
