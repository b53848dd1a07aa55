"""GLM-5.3's MTP cycle, side by side in one run: the cost of its parts relative to one decode step
(verify of 2 rows, the nextn layer's step, the rows it writes for a committed token), and the
speed-ups they allow at the two ends (every draft accepted: 2 tokens per verify + step + row; every
draft rejected: 1 token per verify + step). The parts alternate within each repeat, so the
machine's drift hits all of them alike.

    python benchmarks/mtp_cycle.py GLM_ARTIFACT [--context 64] [--repeats 25]"""

import argparse
import statistics
import time

from ds4tvm.runtime.engine import Engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=25)
    a = ap.parse_args()
    e = Engine(a.artifact)
    if "glm_mtp" not in e.drafters:
        raise SystemExit(f"{a.artifact}: no GLM MTP layer in this artifact")
    h = e.prefill([1 + i % (e.n_vocab - 1) for i in range(a.context)]).outputs["hidden"][-1:]

    def decode():
        e.decode(5)
        e.rewind(1)

    def verify2():
        e.verify([5, 6])
        e.rollback()

    parts = {"decode": decode, "verify2": verify2,
             "mtp_step": lambda: e.call("mtp_step", hidden_prev=h, tokens=[5], start=e.pos),
             "mtp_observe": lambda: e.call("mtp_observe", hidden_prev=h, tokens=[5], start=e.pos)}
    times = {k: [] for k in parts}
    for _ in range(3):
        for f in parts.values():
            f()
    for _ in range(a.repeats):
        for k, f in parts.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    t = {k: statistics.median(v) for k, v in times.items()}
    d = t["decode"]
    print("  ".join(f"{k} {1000 * v:.2f} ms ({v / d:.2f}x decode)" for k, v in t.items()))
    full, miss = t["verify2"] + t["mtp_step"] + t["mtp_observe"], t["verify2"] + t["mtp_step"]
    print(f"every draft accepted: 2 tokens per {full / d:.2f} decodes (x{2 * d / full:.2f}); "
          f"every draft rejected: 1 token per {miss / d:.2f} decodes (x{d / miss:.2f})")


if __name__ == "__main__":
    main()
