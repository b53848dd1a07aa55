"""Side by side, in one run: target-only vs speculative tok/s on the same artifact, and the cost of
a verify of k tokens relative to one decode step. Two modes:

    python benchmarks/speculative.py ARTIFACT_WITH_DRAFTER [--dspark | --mtp-draft N | --mtp | --draft-onnx]
        [--tokens 7,8,9] [-n 160] [--repeats 3]
        one prompt (token ids), the drafter chosen by the ds4 flags;
    python benchmarks/speculative.py --heldout [ARTIFACT] [--prompts 16] [-n 128] [--thetas 0,0.5,0.7,0.9]
        DSpark on windows of the held-out standard-library files (ds4tvm/training/corpus.py), by
        default on the embedded demo pair: for each θ, at temperature 0 and at temperature 1
        (opportunistic and exact), the acceptance per position in the block, the accepted tokens
        per cycle and DSpark vs target-only tok/s (target-only and DSpark alternate per prompt, so
        the machine's drift hits both alike); one cost gate per row (DS4_SPEC_COST_GATE=0: the drafter's
        own back-off alone); the gate acts at temperature 0 only."""

import argparse
import statistics
from pathlib import Path

import numpy as np

from ds4tvm.runtime.drafters import SpecOptions, choose_drafter
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import CostGate, generate, verify_cost


def one_prompt(a, engine):
    options = SpecOptions(dspark=a.dspark or (a.mtp_draft == 1 and not a.draft_onnx and not a.mtp),
                          mtp_draft=a.mtp_draft, mtp_margin=a.mtp_margin, mtp="" if a.mtp else None,
                          draft_onnx="" if a.draft_onnx else None)
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


MODES = (("T=0 greedy", SamplingParams(temperature=0.0), False),
         ("T=1 opportunistic", SamplingParams(temperature=1.0), False),
         ("T=1 exact", SamplingParams(temperature=1.0), True))


def heldout_row(engine, prompts, n, theta, params, exact, stop_ids):
    """Target-only and DSpark over every prompt (alternated); the summed counters."""
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter

    gate = CostGate.from_env()   # one per row, kept over its prompts as an engine keeps its own
    plain_t = spec_t = generated_plain = generated_spec = 0.0
    depth, cycles, accepted, proposed, identical = {}, 0, 0, 0, 0
    for i, prompt in enumerate(prompts):
        engine.reset()
        out_plain, s = generate(engine, prompt, n, params, np.random.default_rng(i), stop_ids=stop_ids)
        plain_t, generated_plain = plain_t + s.seconds, generated_plain + s.generated
        engine.reset()
        out, s = generate(engine, prompt, n, params, np.random.default_rng(i), drafter=DSparkDrafter(engine, theta), gate=gate,
                          exact=exact, stop_ids=stop_ids)
        spec_t, generated_spec = spec_t + s.seconds, generated_spec + s.generated
        identical += out == out_plain
        c = s.counters
        cycles, accepted, proposed = cycles + c["cycles"], accepted + c["accepted_draft"], proposed + c["proposed"]
        for k, v in c["depth"].items():
            depth[int(k)] = depth.get(int(k), 0) + v
    reached = [sum(v for k, v in depth.items() if k >= i) / max(cycles, 1) for i in range(1, 6)]
    return {"plain": generated_plain / plain_t, "spec": generated_spec / spec_t, "per_cycle": accepted / max(cycles, 1),
            "accept_rate": accepted / max(proposed, 1), "reached": reached, "cycles": cycles, "identical": identical}


def heldout(a, engine):
    from ds4tvm.runtime.tokenizer import Tokenizer
    from ds4tvm.training import corpus

    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    prompts = corpus.windows(tok, corpus.stdlib_files(True), a.prompts, a.prompt_len, seed=7)
    thetas = [float(t) for t in a.thetas.split(",")]
    print(f"{len(prompts)} held-out windows of {a.prompt_len} tokens, {a.n} new tokens each "
          f"(stopping at an end of file); accepted per cycle counts the checked guess, as ds4 does")
    print("| mode | θ | target-only tok/s | DSpark tok/s | ratio | accepted per cycle | accept rate | "
          "position 1..5 reached | cycles |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, params, exact in MODES:
        for theta in thetas:
            r = heldout_row(engine, prompts, a.n, theta, params, exact, tok.stop_ids)
            same = f" (identical outputs: {r['identical']}/{len(prompts)})" if params.temperature == 0 else ""
            print(f"| {name}{same} | {theta} | {r['plain']:.1f} | {r['spec']:.1f} | {r['spec'] / r['plain']:.2f} | "
                  f"{r['per_cycle']:.2f} | {100 * r['accept_rate']:.1f}% | "
                  f"{' '.join(f'{x:.2f}' for x in r['reached'])} | {r['cycles']} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?", help="artifact directory (with --heldout: default the embedded demo pair)")
    ap.add_argument("--dspark", action="store_true")
    ap.add_argument("--mtp-draft", type=int, default=1)
    ap.add_argument("--mtp-margin", type=float, default=None)
    ap.add_argument("--draft-onnx", action="store_true")
    ap.add_argument("--mtp", action="store_true", help="the MTP layer inside the model GGUF (GLM-5.3)")
    ap.add_argument("--tokens", default="7,8,9,10,11")
    ap.add_argument("-n", type=int, default=None, help="tokens per generation (160; with --heldout 128)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heldout", action="store_true")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--thetas", default="0,0.5,0.7,0.9")
    a = ap.parse_args()
    if a.artifact is None:
        if not a.heldout:
            ap.error("ARTIFACT is needed without --heldout")
        from ds4tvm.demo import embedded_artifact

        a.artifact = embedded_artifact()
    engine = Engine(a.artifact)
    if a.heldout:
        a.n = a.n or 128
        heldout(a, engine)
    else:
        a.n = a.n or 160
        one_prompt(a, engine)
    cost = verify_cost(engine, min(6, engine.max_verify), repeats=7)
    print("verify(k) / decode: " + "  ".join(f"k={k}: {v:.2f}" for k, v in cost.items()))


if __name__ == "__main__":
    main()
