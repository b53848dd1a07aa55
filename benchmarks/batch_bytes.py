"""What a call of several rows costs against the bytes it must read: verify(k) (k rows of one
sequence) and a batched decode of B sequences (one row each), beside one decode. Usage:
    python benchmarks/batch_bytes.py ARTIFACT [--max-k 8] [--repeats 15]

A memory-bound MoE call must read the dense weights once and every routed expert some row chose,
once (the union bound): bytes(rows) = dense + experts_per_layer(rows) * expert bytes, where the
experts a call's rows choose are counted as E * (1 - (1 - k/E)^rows) per layer, the expected union
of rows choosing k of E experts independently and uniformly (what a random model's router does;
a trained one's overlap more). Prints, per row count, time / decode time against bytes / decode
bytes: a call at the bound costs what its bytes say; every row read on its own costs `rows` x."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _weights(engine) -> tuple[float, float, int, int]:
    """(bytes of dense weights read per call, bytes of one expert of one layer, experts per layer,
    experts chosen per row) of the engine's model GGUF; the embedding table counts one row."""
    from ds4tvm.families import family_for

    g = engine.gguf
    cfg = family_for(g).config_from_gguf(g)
    E, k = cfg.n_expert, cfg.n_expert_used
    dense = experts = 0
    for name, t in g.tensors.items():
        if name.startswith(f"blk.{cfg.n_layers}.") or name.startswith("mtp.") or "nextn" in name:
            continue   # a drafter's layer: not read by the target's calls
        if "_exps" in name:
            experts += t.data.nbytes
        elif name == "token_embd.weight":
            dense += t.data.nbytes / t.shape[-1]
        else:
            dense += t.data.nbytes
    return dense, experts / (E * cfg.n_layers), E, k


def _median_s(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    from ds4tvm.families import family_for
    from ds4tvm.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    e = Engine(a.artifact)
    dense, per_expert, E, k = _weights(e)
    layers = family_for(e.gguf).config_from_gguf(e.gguf).n_layers

    def bytes_of(rows: int) -> float:
        return dense + layers * per_expert * E * (1 - (1 - k / E) ** rows)

    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(max(1, e.max_batch)):
        seqs.append(e.new_sequence())
        e.attach(seqs[-1])
        e.prefill(rng.integers(0, e.n_vocab, 64).tolist())
    e.attach(seqs[0])
    tokens = rng.integers(0, e.n_vocab, max(a.max_k, e.max_batch)).tolist()

    def decode_batch(b):
        e.decode_batch(seqs[:b], tokens[:b])
        for s in seqs[:b]:
            e.attach(s)
            e.rewind(1)
        e.attach(seqs[0])

    def verify(n):
        e.verify(tokens[:n])
        e.rollback()

    base = _median_s(lambda: decode_batch(1), a.repeats)
    print(f"decode {1e3 * base:.2f} ms, {bytes_of(1) / 1e6:.1f} MB ({bytes_of(1) / base / 1e9:.1f} GB/s); "
          f"dense {dense / 1e6:.1f} MB, {E} experts of {per_expert / 1e6:.2f} MB per layer, {k} chosen per row")
    print(f"{'call':<16} {'time/decode':>11} {'bytes/decode':>12} {'rows':>5} {'distance to bound':>18}")
    rows = [(f"verify({n})", n, lambda n=n: verify(n)) for n in range(1, min(a.max_k, e.max_verify) + 1)]
    rows += [(f"batch of {b}", b, lambda b=b: decode_batch(b)) for b in range(2, e.max_batch + 1)]
    for name, n, fn in rows:
        ratio, bound = _median_s(fn, a.repeats) / base, bytes_of(n) / bytes_of(1)
        print(f"{name:<16} {ratio:11.2f} {bound:12.2f} {n:5d} {ratio - bound:18.2f}")


if __name__ == "__main__":
    main()
