"""Side by side, in one run: target-only vs DSpark tok/s on the same artifact, and the cost of a
verify of k tokens relative to one decode step. Usage:
    python benchmarks/speculative.py ARTIFACT_WITH_DRAFTER [--tokens 7,8,9] [-n 160] [--repeats 3]"""

import argparse
import statistics

import numpy as np

from ds4tvm.runtime.drafters.dspark import DSparkDrafter
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import generate, verify_cost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--tokens", default="7,8,9,10,11")
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    engine = Engine(a.artifact)
    prompt = [int(x) for x in a.tokens.split(",")]
    greedy = SamplingParams(temperature=0.0)
    plain, spec, accept = [], [], []
    for _ in range(a.repeats):  # alternate, so drift on a noisy machine hits both sides alike
        engine.reset()
        _, s = generate(engine, prompt, a.n, greedy, np.random.default_rng(0))
        plain.append(s.generated / s.seconds)
        engine.reset()
        _, s = generate(engine, prompt, a.n, greedy, np.random.default_rng(0), drafter=DSparkDrafter(engine))
        spec.append(s.generated / s.seconds)
        accept.append(s.as_dict()["accept_rate"])
    p, s = statistics.median(plain), statistics.median(spec)
    print(f"target-only {p:.1f} tok/s | DSpark {s:.1f} tok/s | ratio {s / p:.2f} | accept rate {accept[0]:.2%}")
    cost = verify_cost(engine, 6, repeats=7)
    print("verify(k) / decode: " + "  ".join(f"k={k}: {v:.2f}" for k, v in cost.items()))


if __name__ == "__main__":
    main()
