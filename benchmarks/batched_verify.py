"""A batched verify (Engine.verify_batch: a block of k rows of each of B sequences in one call)
against the same blocks verified one sequence after another, beside a batched decode of B and a
decode, in one process, alternated (this machine's speed drifts between minutes). Usage:
    python benchmarks/batched_verify.py ARTIFACT [--batches 2,4,8] [--k 2,4] [--rounds 6] [--steps 10]

Each of max(batches) sequences holds a 64-token prompt; a step verifies a block of k random tokens
in each of the first B of them (or decodes one token of each) and rolls it back. Prints per (B, k)
the median step of each way, their ratio, and each in decode steps."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _median_ms(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    from ds4tvm.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    sizes, widths = [int(b) for b in a.batches.split(",")], [int(k) for k in a.k.split(",")]
    engine, rng = Engine(a.artifact), np.random.default_rng(0)
    seqs = [engine.new_sequence() for _ in range(max(sizes))]
    for s in seqs:
        engine.attach(s)
        engine.prefill(rng.integers(0, engine.n_vocab, 64))
    blocks = {k: [rng.integers(0, engine.n_vocab, k).tolist() for _ in seqs] for k in widths}

    def batched(b, k):
        engine.verify_batch(seqs[:b], blocks[k][:b])

    def one_by_one(b, k):
        for s, block in zip(seqs[:b], blocks[k]):
            engine.attach(s)
            engine.verify(block)

    def decode(b):
        if b == 1:
            engine.attach(seqs[0])
            engine.decode(5)
        else:
            engine.decode_batch(seqs[:b], [5] * b)
        for s in seqs[:b]:
            engine.attach(s)
            engine.rewind(1)

    cases = [("decode", 1, 1, lambda: decode(1))] + [("decode", b, 1, lambda b=b: decode(b)) for b in sizes]
    cases += [(way, b, k, (lambda b=b, k=k, f=f: f(b, k))) for b in sizes for k in widths
              for way, f in (("batched", batched), ("one by one", one_by_one))]
    for *_, step in cases:   # first calls (storage, threads) outside the timing
        step()
    times: dict = {}
    for _ in range(a.rounds):
        for way, b, k, step in cases:
            times.setdefault((way, b, k), []).append(_median_ms(step, a.steps))
    med = {key: statistics.median(v) for key, v in times.items()}
    d = med[("decode", 1, 1)]
    print(f"decode {d:.2f} ms;  " + "  ".join(f"decode of {b}: {med[('decode', b, 1)]:.2f} ms "
                                              f"({med[('decode', b, 1)] / d:.2f} decodes)" for b in sizes))
    print(f"{'B':>3} {'k':>3} {'batched ms':>11} {'one by one ms':>14} {'ratio':>6} {'batched / decode':>17} "
          f"{'one by one / decode':>20}")
    for b in sizes:
        for k in widths:
            x, y = med[("batched", b, k)], med[("one by one", b, k)]
            print(f"{b:>3} {k:>3} {x:>11.2f} {y:>14.2f} {x / y:>6.2f} {x / d:>17.2f} {y / d:>20.2f}")


if __name__ == "__main__":
    main()
