"""When the pool's worker starts and how long it takes, against the calling thread, inside one
parallel kernel: two tasks of the same work (a multiply-add over N floats each), the TSC read
(`llvm.readcyclecounter`) at the launch, at each task's start and end and after the join. Usage:
    python benchmarks/pool_lag.py [--floats 256,4096,65536] [--calls 3000]

Prints, per size, the medians (and 90th percentiles) in TSC cycles of: each task's start after the
launch, each task's time, the whole call. With TVM_NUM_THREADS=2 and the engine's spin count. A
worker whose task takes longer than the caller's for the same work at every size pays a fixed cost
per parallel kernel (coming back from its spin)."""

from __future__ import annotations

import argparse
import os

import numpy as np

from ds4tvm.runtime.threads import SPIN_COUNT


def kernel(n: int):
    from tvm.script import tirx as T

    @T.prim_func
    def timed(a: T.Buffer((2, n), "float32"), ts: T.Buffer((8,), "int64")):
        ts[0] = T.call_llvm_intrin("int64", "llvm.readcyclecounter")
        for p in T.parallel(2):
            ts[1 + p * 2] = T.call_llvm_intrin("int64", "llvm.readcyclecounter")
            for i in range(n):
                a[p, i] = a[p, i] * T.float32(1.0001) + T.float32(0.5)
            ts[2 + p * 2] = T.call_llvm_intrin("int64", "llvm.readcyclecounter")
        ts[5] = T.call_llvm_intrin("int64", "llvm.readcyclecounter")

    return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--floats", default="256,4096,65536")
    ap.add_argument("--calls", type=int, default=3000)
    a = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = "2"
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", SPIN_COUNT)
    import tvm

    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    print("| floats per task | caller starts | worker starts | caller's task | worker's task | whole call |")
    print("|---|---|---|---|---|---|")
    for n in (int(v) for v in a.floats.split(",")):
        f = tvm.compile(kernel(n), target=target)
        buf = tvm.runtime.tensor(np.zeros((2, n), "float32"))
        ts = tvm.runtime.tensor(np.zeros(8, "int64"))
        rows = []
        for i in range(a.calls):
            f(buf, ts)
            if i >= 100:   # the pool and the caches warm
                rows.append(ts.numpy().copy())
        r = np.array(rows, dtype=np.float64)
        cols = (r[:, 1] - r[:, 0], r[:, 3] - r[:, 0], r[:, 2] - r[:, 1], r[:, 4] - r[:, 3], r[:, 5] - r[:, 0])
        print(f"| {n} | " + " | ".join(f"{np.median(c):.0f} ({np.percentile(c, 90):.0f})" for c in cols) + " |",
              flush=True)


if __name__ == "__main__":
    main()
