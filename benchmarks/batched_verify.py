"""A batched verify (Engine.verify_batch: a block of k rows of each of B sequences in one call)
against the same blocks verified one sequence after another, beside a batched decode of B and a
decode, in one process, alternated (this machine's speed drifts between minutes). Usage:
    python benchmarks/batched_verify.py ARTIFACT [--batches 2,4,8] [--k 2,4] [--rounds 6] [--steps 10]
        [--generations N [--gen 64]]

Each of max(batches) sequences holds a 64-token prompt; a step verifies a block of k random tokens
in each of the first B of them (or decodes one token of each) and rolls it back. Prints per (B, k)
the median step of each way, their ratio, and each in decode steps; then a round where one of
the B verifies a block of k and the others decode: in one call (the decodes as one-row blocks)
against a batched decode of B - 1 and the verify. With --generations N (an
artifact whose GGUF holds its MTP draft layer: GLM-5.3, Qwen3.8): N greedy generations of --gen
tokens through the scheduler, each with its drafter asked every cycle (DS4_SPEC_COST_MODEL=0), their
verify blocks batched and one by one, alternated: aggregate tok/s and sequences per verify call."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from batch_ab import _step


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
    ap.add_argument("--generations", type=int, default=0)
    ap.add_argument("--gen", type=int, default=64)
    a = ap.parse_args()
    sizes, widths = [int(b) for b in a.batches.split(",")], [int(k) for k in a.k.split(",")]
    os.environ.setdefault("DS4_SPEC_COST_MODEL", "0")
    engine, rng = Engine(a.artifact), np.random.default_rng(0)
    if a.generations:
        generations(engine, a.generations, a.gen, a.rounds)
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

    def mixed(b, k):
        engine.verify_batch(seqs[:b], blocks[k][:1] + [[5]] * (b - 1))

    def apart(b, k):
        decode(b - 1, seqs[1:b])
        engine.attach(seqs[0])
        engine.verify(blocks[k][0])

    def decode(b, seqs=seqs):
        _step(engine, seqs, b)

    cases = [("decode", 1, 1, lambda: decode(1))] + [("decode", b, 1, lambda b=b: decode(b)) for b in sizes]
    cases += [(way, b, k, (lambda b=b, k=k, f=f: f(b, k))) for b in sizes for k in widths
              for way, f in (("batched", batched), ("one by one", one_by_one), ("mixed", mixed), ("apart", apart))]
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
    print(f"{'B':>3} {'k':>3} {'1 verify + B-1 decodes, one call ms':>36} {'apart ms':>9} {'ratio':>6}")
    for b in sizes:
        for k in widths:
            x, y = med[("mixed", b, k)], med[("apart", b, k)]
            print(f"{b:>3} {k:>3} {x:>36.2f} {y:>9.2f} {x / y:>6.2f}")


def generations(engine, n: int, gen: int, rounds: int) -> None:
    """n speculating generations through the scheduler (runtime/bench.concurrency), verify blocks
    batched against one by one."""
    from ds4tvm.cli.common import spec_options
    from ds4tvm.runtime.bench import concurrency
    from ds4tvm.runtime.drafters import choose_drafter

    options = spec_options("", 1, None, False, False, None, False, False, False)
    batched = engine.verify_batch

    def one_by_one(seqs, blocks):
        return [batched([s], [b])[0] for s, b in zip(seqs, blocks)]

    results = {"batched": [], "one by one": []}
    for _ in range(rounds):
        for way, verify_batch in (("batched", batched), ("one by one", one_by_one)):
            engine.verify_batch = verify_batch
            c = concurrency(engine, n, 64, gen, 1, drafter_factory=lambda e: choose_drafter(e, options, e.dir))
            results[way].append((c["together_tok_s"], c["mean_verify_batch"]))
    engine.verify_batch = batched
    for way, rs in results.items():
        print(f"{n} speculating generations, verify blocks {way}: {statistics.median(r[0] for r in rs):.1f} tok/s "
              f"(runs: {', '.join(f'{r[0]:.1f}' for r in rs)}), {statistics.median(r[1] for r in rs):.2f} sequences "
              f"per verify call")


if __name__ == "__main__":
    main()
