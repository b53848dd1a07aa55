"""Whether a batch's linears run at their bytes: the benchmark model's routed experts (16 x 512 x
512, 4 chosen per token) and a 2048 x 512 dense matrix, Q8_0 in the interleaved int8 kernels, at a
static 1, 2, 4 and 8 tokens (the rows of a decode and of batched decodes), each timed with its
weights read from memory (COPIES copies of them called in turn, more than the last-level cache
holds) and warm (one copy, again and again). Usage:
    python benchmarks/cold_linears.py [--copies 120] [--threads 2]

Prints per token count the experts used, their bytes and cold time (GB/s), the warm time, and the
same for the dense matrix: a cold call near the memory's GB/s at 8 tokens means the rows' compute
hides under the reads."""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from ds4tvm.runtime.threads import SPIN_COUNT

E, N, K, J = 16, 512, 512, 4
DENSE = N * E // 4   # cpu_kernels.build's dense matrix: 2048 x 512
TOKENS = (1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=120)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", SPIN_COUNT)
    import tvm
    from gguf import GGMLQuantizationType as QT

    from cpu_kernels import build
    from ds4tvm.gguf.quant import random_blocks, to_planes

    vm, bind = build(QT.Q8_0, E, N, K, J, a.threads, "int8", static=TOKENS)
    rng = np.random.default_rng(0)
    planes = {"we": to_planes(random_blocks(QT.Q8_0, (E, N, K), rng), QT.Q8_0, (E, N, K)),
              "w": to_planes(random_blocks(QT.Q8_0, (DENSE, K), rng), QT.Q8_0, (DENSE, K))}
    copies = [bind(planes) for _ in range(a.copies)]
    print(f"{sum(w.numpy().nbytes for w in copies[0]) * a.copies / 1e6:.0f} MB of weights in {a.copies} copies, "
          f"{a.threads} threads")

    def cold(fn, inputs):
        f = vm[fn]
        for args in copies[:3]:
            f(*inputs, *args)
        t = time.perf_counter()
        for args in copies:
            f(*inputs, *args)
        return (time.perf_counter() - t) / len(copies) * 1e6

    def warm(fn, inputs):
        return vm.time_evaluator(fn, tvm.cpu(), number=100, repeat=3)(*inputs, *copies[0]).min * 1e6

    dense_kb = DENSE * K * 34 / 32 / 1e3
    for t in TOKENS:
        x = tvm.runtime.tensor(rng.standard_normal((t, K)).astype(np.float32))
        chosen = np.stack([rng.choice(E, J, replace=False) for _ in range(t)]).astype(np.int32)
        sel = tvm.runtime.tensor(chosen)
        kb = len(set(chosen.ravel().tolist())) * N * K * 34 / 32 / 1e3
        runs = [(cold(f"experts{t}", [x, sel]), warm(f"experts{t}", [x, sel]), cold(f"dense{t}", [x]),
                 warm(f"dense{t}", [x])) for _ in range(3)]
        ec, ew, dc, dw = (min(r[i] for r in runs) for i in range(4))
        print(f"{t} tokens: experts ({kb:.0f} KB) cold {ec:.1f} us ({kb / ec:.1f} GB/s), warm {ew:.1f} us; "
              f"dense ({dense_kb:.0f} KB) cold {dc:.1f} us ({dense_kb / dc:.1f} GB/s), warm {dw:.1f} us", flush=True)


if __name__ == "__main__":
    main()
