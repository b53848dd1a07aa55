"""Decode speed when another process keeps one core busy, side by side with the quiet machine, in
one run: each setting is a fresh process (TVM's pool reads its environment once), quiet and then
beside a busy loop pinned to the last core. Usage:
    python benchmarks/contention.py ARTIFACT [--threads 2] [-n 24] [--repeats 1]

Settings: the engine's default (TVM_NUM_THREADS = --threads; workers spin between kernels and the
pool shrinks to one thread while another process keeps a core busy: runtime/threads.py), workers
that sleep at once (no spinning), and one thread fewer. Prints decode tok/s and contended/quiet."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, numpy as np
from ds4tvm.runtime.engine import Engine
e = Engine(sys.argv[1]); n = int(sys.argv[2])
logits = e.prefill([5, 17, 29, 41, 53, 65, 77, 89]).logits
tok = int(np.argmax(logits)); logits = e.decode(tok).logits   # warm
t = time.perf_counter()
for _ in range(n):
    tok = int(np.argmax(logits)); logits = e.decode(tok).logits
print(json.dumps({"decode": n / (time.perf_counter() - t)}))
"""

BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def settings(threads: int) -> dict[str, dict[str, str]]:
    return {f"engine default (spinning workers, one thread beside a busy core), {threads} threads":
            {"TVM_NUM_THREADS": str(threads)},
            f"workers that sleep at once (TVM_THREAD_POOL_SPIN_COUNT=0), {threads} threads":
            {"TVM_NUM_THREADS": str(threads), "TVM_THREAD_POOL_SPIN_COUNT": "0"},
            f"{max(1, threads - 1)} thread(s)": {"TVM_NUM_THREADS": str(max(1, threads - 1))}}


def decode_rate(artifact: str, n: int, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, artifact, str(n)], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])["decode"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    core = max(os.sched_getaffinity(0))
    print("| setting | quiet tok/s | one core busy tok/s | busy / quiet |")
    print("|---|---|---|---|")
    for name, env in settings(a.threads).items():
        quiet = statistics.median(decode_rate(a.artifact, a.n, env) for _ in range(a.repeats))
        busy = subprocess.Popen([sys.executable, "-c", BUSY, str(core)])
        try:
            time.sleep(0.5)
            loaded = statistics.median(decode_rate(a.artifact, a.n, env) for _ in range(a.repeats))
        finally:
            busy.kill()
            busy.wait()
        print(f"| {name} | {quiet:.1f} | {loaded:.1f} | {loaded / quiet:.2f} |", flush=True)


if __name__ == "__main__":
    main()
