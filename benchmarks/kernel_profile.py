"""Per-kernel time of one decode step and of one prefill, through the VM's instrument hook (a
device sync around every call, so the sums exceed a plain step). Usage:
    python benchmarks/kernel_profile.py ARTIFACT [--prompt 64] [--top 20]

Prints, for decode and for prefill: kernel name, calls, ms, share of the step, largest first."""

from __future__ import annotations

import argparse
import collections
import time


def kernel_profile(engine, step) -> list[list]:
    """[name, calls, ms] of the kernels `step()` runs (after one unmeasured call), largest first,
    headed by ["all", calls, ms]."""
    times, calls, start = collections.defaultdict(float), collections.Counter(), [0.0]

    def hook(func, name, before_run, ret_val, *args):
        engine.dev.sync()
        if before_run:
            start[0] = time.perf_counter()
        else:
            times[name] += time.perf_counter() - start[0]
            calls[name] += 1
        return 0   # run the call as usual

    engine.vm.set_instrument(hook)
    try:
        step()
        times.clear()
        calls.clear()
        step()
    finally:
        engine.vm.set_instrument(None)
    rows = sorted(([n, calls[n], round(t * 1e3, 3)] for n, t in times.items()), key=lambda r: -r[2])
    return [["all", sum(calls.values()), round(sum(times.values()) * 1e3, 3)]] + rows


def main() -> None:
    from ds4tvm.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    engine = Engine(a.artifact)
    prompt = [i * 7 % 30000 + 5 for i in range(a.prompt)]

    def prefill():
        engine.reset()
        engine.prefill(prompt)

    engine.prefill(prompt)
    for what, step in (("decode", lambda: engine.decode(7)), (f"prefill of {a.prompt} tokens", prefill)):
        rows = kernel_profile(engine, step)
        total = rows[0][2]
        print(f"{what}: {total:.3f} ms in {rows[0][1]} calls")
        for name, n, ms in rows[1:a.top + 1]:
            print(f"  {ms:9.3f} ms {100 * ms / total:5.1f}% {n:5d} calls  {name}")


if __name__ == "__main__":
    main()
