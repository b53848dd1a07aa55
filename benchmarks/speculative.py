"""Side by side, in one run: target-only vs speculative tok/s on the same artifact (its drafter
chosen by the ds4 flags: --dspark, --mtp-draft N for the legacy MTP, --draft-onnx for ONNX heads), and the cost of a verify
of k tokens relative to one decode step. Usage:
    python benchmarks/speculative.py ARTIFACT_WITH_DRAFTER [--dspark | --mtp-draft N | --draft-onnx] [--tokens 7,8,9] [-n 160]
        [--repeats 3]"""

import argparse
import statistics
from pathlib import Path

import numpy as np

from ds4tvm.runtime.drafters import SpecOptions, choose_drafter
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import generate, verify_cost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--dspark", action="store_true")
    ap.add_argument("--mtp-draft", type=int, default=1)
    ap.add_argument("--mtp-margin", type=float, default=None)
    ap.add_argument("--draft-onnx", action="store_true")
    ap.add_argument("--tokens", default="7,8,9,10,11")
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    engine = Engine(a.artifact)
    options = SpecOptions(dspark=a.dspark or (a.mtp_draft == 1 and not a.draft_onnx), mtp_draft=a.mtp_draft,
                          mtp_margin=a.mtp_margin, draft_onnx="" if a.draft_onnx else None)
    prompt = [int(x) for x in a.tokens.split(",")]
    greedy = SamplingParams(temperature=0.0)
    plain, spec, accept = [], [], []
    for _ in range(a.repeats):  # alternate, so drift on a noisy machine hits both sides alike
        engine.reset()
        _, s = generate(engine, prompt, a.n, greedy, np.random.default_rng(0))
        plain.append(s.tok_s)
        engine.reset()
        drafter = choose_drafter(engine, options, Path(a.artifact))
        _, s = generate(engine, prompt, a.n, greedy, np.random.default_rng(0), drafter=drafter)
        spec.append(s.tok_s)
        accept.append(s.counters["accept_rate"])
    p, s = statistics.median(plain), statistics.median(spec)
    print(f"target-only {p:.1f} tok/s | {type(drafter).__name__} {s:.1f} tok/s | ratio {s / p:.2f} | "
          f"accept rate {accept[0]:.2%}")
    cost = verify_cost(engine, 6, repeats=7)
    print("verify(k) / decode: " + "  ".join(f"k={k}: {v:.2f}" for k, v in cost.items()))


if __name__ == "__main__":
    main()
