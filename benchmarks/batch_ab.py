"""Two artifacts of one model in one process, a decode and batched decodes of each timed in
alternation (this machine's speed drifts by 10-30% between runs: only what runs side by side
compares). Usage:
    python benchmarks/batch_ab.py OLD_ARTIFACT NEW_ARTIFACT [--batches 1,4,8] [--rounds 10] [--steps 20]
        [--prefill 64,256] [--verify 2,4,6]

Each artifact gets max(batches) sequences with a 64-token prompt; a step decodes one token of the
first B of them, a different token in each (B = 1: Engine.decode, else Engine.decode_batch), and
rewinds it. Per round, each artifact runs `steps` steps of each size, `steps` verify(k) of each
--verify k in the first sequence (rolled back), and a prefill of each --prefill length into a
sequence of its own, reset (2 of each); prints per size the medians and the median of the per-round
ratios new / old, then each artifact's batch / decode ratios."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _loaded(path: str, sequences: int):
    from ds4tvm.runtime.engine import Engine

    engine, rng = Engine(path), np.random.default_rng(0)
    seqs = [engine.new_sequence() for _ in range(sequences)]
    for s in seqs:
        engine.attach(s)
        engine.prefill(rng.integers(0, engine.n_vocab, 64))
    return engine, seqs


def distinct_tokens(engine, n: int) -> list[int]:
    """n different token ids, the same every call: rows of one token would choose the same experts
    in the layers that route by token id (a batch reading fewer experts than a real one does)."""
    return [(1000 + 977 * i) % engine.n_vocab for i in range(n)]


def _step(engine, seqs, b: int) -> None:
    if b == 1:
        engine.attach(seqs[0])
        engine.decode(distinct_tokens(engine, 1)[0])
    else:
        engine.decode_batch(seqs[:b], distinct_tokens(engine, b))
    for s in seqs[:b]:
        engine.attach(s)
        engine.rewind(1)


def _median_s(engine, seqs, b: int, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        _step(engine, seqs, b)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _verify_s(engine, seq, k: int, steps: int) -> float:
    engine.attach(seq)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.verify(distinct_tokens(engine, k))
        engine.rollback()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _prefill_s(engine, seq, n: int, repeats: int = 2) -> float:
    tokens = np.random.default_rng(n).integers(0, engine.n_vocab, n)
    times = []
    engine.attach(seq)
    for _ in range(repeats):
        engine.reset()
        t = time.perf_counter()
        engine.prefill(tokens)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", default="", help="prompt lengths to prefill too, e.g. 64,256")
    ap.add_argument("--verify", default="", help="verify widths to time too, e.g. 2,4,6")
    a = ap.parse_args()
    sizes = [int(b) for b in a.batches.split(",")]
    prompts = [int(n) for n in a.prefill.split(",") if n]
    widths = [int(k) for k in a.verify.split(",") if k]
    pair = [_loaded(a.old, max(sizes) + 1), _loaded(a.new, max(sizes) + 1)]   # the last one for prefills
    for engine, seqs in pair:   # each function's first call (storage, threads) outside the timing
        for b in sizes:
            _median_s(engine, seqs, b, 2)
    times: dict = {}
    for _ in range(a.rounds):
        for i, (engine, seqs) in enumerate(pair):
            for b in sizes:
                times.setdefault((i, b), []).append(_median_s(engine, seqs, b, a.steps))
            for k in widths:
                times.setdefault((i, f"verify({k})"), []).append(_verify_s(engine, seqs[0], k, a.steps))
            for n in prompts:
                times.setdefault((i, f"prefill {n}"), []).append(_prefill_s(engine, seqs[-1], n))
    for b in [*sizes, *(f"verify({k})" for k in widths), *(f"prefill {n}" for n in prompts)]:
        old, new = times[(0, b)], times[(1, b)]
        ratio = statistics.median(y / x for x, y in zip(old, new))
        name = b if isinstance(b, str) else "decode" if b == 1 else f"batch of {b}"
        print(f"{name:<12} old {1e3 * statistics.median(old):7.3f} ms   "
              f"new {1e3 * statistics.median(new):7.3f} ms   new / old {ratio:.3f}")
    if 1 in sizes and len(sizes) > 1:
        for i, name in enumerate(("old", "new")):
            print(f"{name}: " + "  ".join(
                f"batch of {b} / decode {statistics.median(x / d for x, d in zip(times[(i, b)], times[(i, 1)])):.2f}"
                for b in sizes if b > 1))


if __name__ == "__main__":
    main()
