"""A batched verify (Engine.verify_batch: a block of k rows of each of B sequences in one call)
against the same blocks verified one sequence after another, beside a batched decode of B and a
decode, in one process, alternated (this machine's speed drifts between minutes). Usage:
    python benchmarks/batched_verify.py ARTIFACT [--batches 2,4,8] [--k 2,4] [--rounds 6] [--steps 10]
        [--generations N [--gen 64] [--against OLD_ARTIFACT]] [--drafter-steps]

Each of max(batches) sequences holds a 64-token prompt; a step verifies a block of k random tokens
in each of the first B of them (or decodes one token of each, a different one in each) and rolls it
back. Prints per (B, k) the median step of each way, their ratio, and each in decode steps; then a
round where one of the B verifies a block of k and the others decode: in one call (the decodes as
one-row blocks) against a batched decode of B - 1 and the verify. With --generations N (an
artifact whose GGUF holds its MTP draft layer: GLM-5.3, Qwen3.8; or with DSpark, its blocks never
cut: --dspark-confidence 0): N greedy generations of --gen tokens through the scheduler, each with
its drafter asked every cycle (DS4_SPEC_COST_MODEL=0), their
verify blocks batched and one by one, alternated: aggregate tok/s and sequences per verify call.
With --against OLD_ARTIFACT (the same model compiled otherwise, e.g. by an earlier commit: without
batched drafter steps), the N generations on each artifact in turn, all batched: tok/s of each,
their ratio per round, and the drafter steps run in calls of several sequences and alone
(Engine.step_calls; an artifact without batched copies counts none).
With --drafter-steps: the drafter's step (an MTP layer's mtp_step, DSpark's dspark_propose) for B
sequences of --batches in one call of its batched copy against B calls."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from batch_ab import _step, distinct_tokens

from ds4tvm.artifact import batch_name


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
    ap.add_argument("--against", default=None)
    ap.add_argument("--drafter-steps", action="store_true")
    a = ap.parse_args()
    sizes, widths = [int(b) for b in a.batches.split(",")], [int(k) for k in a.k.split(",")]
    os.environ.setdefault("DS4_SPEC_COST_MODEL", "0")
    engine, rng = Engine(a.artifact), np.random.default_rng(0)
    if a.generations and a.against:
        return against(Engine(a.against), engine, a.generations, a.gen, a.rounds)
    if a.drafter_steps:
        return drafter_steps(engine, sizes, a.rounds, a.steps)
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
        engine.verify_batch(seqs[:b], blocks[k][:1] + [[t] for t in distinct_tokens(engine, b - 1)])

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
    batched = engine.verify_batch

    def one_by_one(seqs, blocks):
        return [batched([s], [b])[0] for s, b in zip(seqs, blocks)]

    results = {"batched": [], "one by one": []}
    for _ in range(rounds):
        for way, verify_batch in (("batched", batched), ("one by one", one_by_one)):
            engine.verify_batch = verify_batch
            c = _speculating(engine, n, gen)
            results[way].append((c["together_tok_s"], c["mean_verify_batch"]))
    engine.verify_batch = batched
    for way, rs in results.items():
        print(f"{n} speculating generations, verify blocks {way}: {statistics.median(r[0] for r in rs):.1f} tok/s "
              f"(runs: {', '.join(f'{r[0]:.1f}' for r in rs)}), {statistics.median(r[1] for r in rs):.2f} sequences "
              f"per verify call")


def _speculating(engine, n: int, gen: int) -> dict:
    """n greedy generations through the scheduler, each with its drafter (runtime/bench.concurrency)."""
    from ds4tvm.cli.common import spec_options
    from ds4tvm.runtime.bench import concurrency
    from ds4tvm.runtime.drafters import choose_drafter

    if "dspark" in engine.drafters:   # --dspark --dspark-confidence 0: a random drafter's blocks are never cut
        options = spec_options(None, 1, None, False, True, 0.0, False, False, False)
    else:                             # --mtp: the MTP layer in the model's GGUF
        options = spec_options("", 1, None, False, False, None, False, False, False)
    return concurrency(engine, n, 64, gen, 1, drafter_factory=lambda e: choose_drafter(e, options, e.dir))


def against(old, new, n: int, gen: int, rounds: int) -> None:
    """n speculating generations on each artifact in turn: tok/s, new / old per round, and the
    drafter rows each ran in batched steps."""
    tok_s: dict = {"old": [], "new": []}
    for _ in range(rounds):
        for name, engine in (("old", old), ("new", new)):
            before = engine.step_calls
            tok_s[name].append(_speculating(engine, n, gen)["together_tok_s"])
            calls = engine.step_calls - before   # sequences per drafter step call -> calls
            print(f"{name}: {tok_s[name][-1]:.1f} tok/s, drafter steps {sum(b * c for b, c in calls.items() if b > 1)} "
                  f"in calls of several sequences, {calls[1]} alone", flush=True)
    ratios = [b / a for a, b in zip(tok_s["old"], tok_s["new"])]
    print(f"{n} speculating generations: old {statistics.median(tok_s['old']):.1f} tok/s, new "
          f"{statistics.median(tok_s['new']):.1f} tok/s; new / old per round {', '.join(f'{r:.2f}' for r in ratios)}")


def _mtp_step_inputs(engine, step) -> dict:
    prev = ({"hidden_prev": step.outputs[engine.drafters["glm_mtp"]["reads"]][-1:]} if "glm_mtp" in engine.drafters
            else {"hc_prev": step.outputs["hc_state"][-1:]})   # GLM-5.3's, or DeepSeek-V4's legacy MTP
    return {**prev, "tokens": [engine.history[-1]], "start": engine.pos}


def _dspark_propose_inputs(engine, step) -> dict:
    engine.call("dspark_observe", captured=step.outputs["captured"], start=0)   # the prompt's rows in its rings
    d = engine.drafters["dspark"]
    return {"captured": step.outputs["captured"][-1:], "tokens": [engine.history[-1]] + [d["noise_token_id"]] * (
        d["block_size"] - 1), "start": engine.pos - 1}


# the drafter steps with batched copies: their inputs after a prompt's prefill step
STEP_INPUTS = {"mtp_step": _mtp_step_inputs, "dspark_propose": _dspark_propose_inputs}


def drafter_steps(engine, sizes: list[int], rounds: int, steps: int) -> None:
    """The drafter's step for B sequences (after a 64-token prompt each): one call of its batched
    copy (Engine.call_batch) against B calls, alternated: medians and the median ratio per B."""
    fn = next(f for f in STEP_INPUTS if batch_name(2, f) in engine.functions)
    rng, seqs, inputs = np.random.default_rng(0), [], []
    for _ in range(max(sizes)):
        engine.attach(engine.new_sequence())
        seqs.append(engine.seq)
        inputs.append(STEP_INPUTS[fn](engine, engine.prefill(rng.integers(0, engine.n_vocab, 64))))

    def apart(b):
        for s, x in zip(seqs[:b], inputs[:b]):
            engine.attach(s)
            engine.call(fn, **x)

    for b in sizes:
        ratios, times = [], []
        for _ in range(rounds):
            times.append((_median_ms(lambda: engine.call_batch(fn, seqs[:b], inputs[:b]), steps),
                          _median_ms(lambda: apart(b), steps)))
            ratios.append(times[-1][0] / times[-1][1])
        print(f"{fn} of {b} sequences: one call {statistics.median(t[0] for t in times):.2f} ms, {b} calls "
              f"{statistics.median(t[1] for t in times):.2f} ms, ratio {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
