"""What each kernel costs per row: the kernels of a decode, of verify(k) (k rows of one sequence)
and of a batched decode of B sequences, each call timed alone, repeated with its own arguments
(weights and state warm in the caches: a kernel's compute, without the VM around it and without
the memory's speed; benchmarks/kernel_profile.py times them in place). Usage:
    python benchmarks/kernel_rows.py ARTIFACT [--k 8] [--batch 8] [--repeats 30] [--top 30]

Prints each step's kernel total, then per kind of kernel (its name less the trailing number the
compiler gives copies, and verify's copies' suffix) the ms of each step, largest in verify first. A kind whose time grows with
the rows faster than its weights' reads do is where a batch pays per row."""

from __future__ import annotations

import argparse
import collections
import re
import time

from batch_ab import _loaded, _step, distinct_tokens


def captured(engine, step) -> list:
    """(name, kernel, arguments) of every kernel call step() makes (VM built-ins left out)."""
    calls = []

    def hook(func, name, before_run, _ret, *args):
        if before_run and not name.startswith("vm."):
            calls.append((name, func, args))
        return 0   # run the call as usual

    engine.vm.set_instrument(hook)
    try:
        step()
    finally:
        engine.vm.set_instrument(None)
    return calls


def kernel_ms(calls: list, repeats: int) -> collections.Counter:
    """ms per kind of kernel: each captured call run alone `repeats` times (after 3 untimed)."""
    out: collections.Counter = collections.Counter()
    for name, func, args in calls:
        for _ in range(3):
            func(*args)
        t = time.perf_counter()
        for _ in range(repeats):
            func(*args)
        kind = re.sub(r"\d+$", "", name.removesuffix("_few_rows"))   # verify's copies (schedules/llvm.py) too
        out[kind] += (time.perf_counter() - t) / repeats * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--k", type=int, default=8, help="rows of the verify")
    ap.add_argument("--batch", type=int, default=8, help="sequences of the batched decode (<= --max-batch)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    engine, seqs = _loaded(a.artifact, max(1, a.batch))

    def verify():
        engine.attach(seqs[0])
        engine.verify(distinct_tokens(engine, a.k))
        engine.rollback()

    def decode():
        _step(engine, seqs, 1)

    def batch():
        _step(engine, seqs, a.batch)

    steps = {"decode": decode, f"verify({a.k})": verify}
    if a.batch > 1:
        steps[f"batch of {a.batch}"] = batch
    ms = {}
    for what, step in steps.items():
        step()   # the first call of a function pays for its setup
        ms[what] = kernel_ms(captured(engine, step), a.repeats)
    print("kernels, each alone, warm: " + ", ".join(f"{w} {sum(m.values()):.3f} ms" for w, m in ms.items()))
    print("".join(f"{w:>12}" for w in ms) + "  kind")
    order = sorted(ms[f"verify({a.k})"], key=lambda n: -ms[f"verify({a.k})"][n])
    for kind in order[:a.top]:
        print("".join(f"{m[kind]:12.3f}" for m in ms.values()) + f"  {kind}")


if __name__ == "__main__":
    main()
