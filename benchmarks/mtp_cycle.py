"""An MTP cycle (GLM-5.3's or Qwen3.8's nextn layer), side by side in one run: the cost of its parts
relative to one decode step (verify of 2 and 3 rows, the nextn layer's step, a chained step, the
rows it writes for a committed token) and the speed-ups they allow at the two ends (every draft
accepted; every draft rejected) at each depth the drafter has (GLM: 2; Qwen: 2 and 3). The parts
alternate within each repeat, so the machine's drift hits all of them alike.

With --end-to-end, whole generations too (target-only, then the drafter at each depth setting,
then the drafter with its drafts replaced by target-only's tokens, which the target accepts every
time), alternated over --rounds: tok/s and the ratio to target-only with the acceptance seen.

    python benchmarks/mtp_cycle.py ARTIFACT [--context 64] [--repeats 25] [--end-to-end [--gen 64]]"""

import argparse
import os
import statistics
import time

import numpy as np

from ds4tvm.runtime.engine import Engine


def _prev_input(e: Engine) -> tuple[str, str]:
    """(the nextn step's input of the target's state before a token, the target output it comes from)."""
    name = e.functions["mtp_step"].inputs[0][0]
    return name, {"hidden_prev": "hidden", "streams_prev": "streams"}[name]


def parts(e: Engine, context: int, repeats: int) -> dict[str, float]:
    prev, output = _prev_input(e)
    h = e.prefill([1 + i % (e.n_vocab - 1) for i in range(context)]).outputs[output][-1:]

    def decode():
        e.decode(5)
        e.rewind(1)

    def verify(k):
        e.verify([5, 6, 7][:k])
        e.rollback()

    fns = {"decode": decode, "verify2": lambda: verify(2),
           "mtp_step": lambda: e.call("mtp_step", **{prev: h}, tokens=[5], start=e.pos),
           "mtp_observe": lambda: e.call("mtp_observe", **{prev: h}, tokens=[5], start=e.pos)}
    if e.max_verify >= 3 and "qwen_mtp" in e.drafters:
        fns["verify3"] = lambda: verify(3)
        for n in (2, 3):   # the pass after an accept: the accepted drafts' rows, then the new token's
            fns[f"mtp_step{n}"] = lambda n=n: e.call("mtp_step", **{prev: np.repeat(h, n, axis=0)},
                                                     tokens=[5, 6, 7][:n], start=e.pos)
    times = {k: [] for k in fns}
    for _ in range(3):
        for f in fns.values():
            f()
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def print_bounds(t: dict[str, float]) -> None:
    d = t["decode"]
    print("  ".join(f"{k} {1000 * v:.2f} ms ({v / d:.2f}x decode)" for k, v in t.items()))
    if "verify3" not in t:   # GLM: rows written by mtp_observe after an accept
        full, miss = t["verify2"] + t["mtp_step"] + t["mtp_observe"], t["verify2"] + t["mtp_step"]
        print(f"depth 2: every draft accepted: 2 tokens per {full / d:.2f} decodes (x{2 * d / full:.2f}); "
              f"every draft rejected: 1 token per {miss / d:.2f} decodes (x{d / miss:.2f})")
        return
    # Qwen: an accepted draft's row goes into the next step's pass (mtp_step over 2 rows)
    for depth, verify, drafts in ((2, t["verify2"], [t["mtp_step2"]]), (3, t["verify3"], [t["mtp_step3"], t["mtp_step"]])):
        full, miss = verify + sum(drafts), verify + t["mtp_step"] * (depth - 1)
        print(f"depth {depth}: every draft accepted: {depth} tokens per {full / d:.2f} decodes "
              f"(x{depth * d / full:.2f}); every draft rejected: 1 token per {miss / d:.2f} decodes (x{d / miss:.2f})")


def end_to_end(artifact: str, gen: int, rounds: int) -> None:
    from ds4tvm.runtime.drafters.qwen_mtp import QwenMTPDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    e = Engine(artifact)
    prompt = [1 + (7 * i) % (e.n_vocab - 1) for i in range(64)]
    greedy = SamplingParams(0.0)
    want, _ = generate(e, prompt, gen, greedy, np.random.default_rng(0))

    class Agreeing(QwenMTPDrafter):
        def draft(self, engine, token, max_tokens):
            out = super().draft(engine, token, max_tokens)
            return [want[engine.pos + 1 + i - len(prompt)] for i in range(len(out))]

    arms = {"target-only": ("0", None)}
    for depth in ("2", "3", "0"):
        arms[f"mtp depth {depth if depth != '0' else 'adaptive'}"] = (depth, QwenMTPDrafter)
        arms[f"agreeing depth {depth if depth != '0' else 'adaptive'}"] = (depth, Agreeing)
    results = {k: [] for k in arms}
    for _ in range(rounds):
        for name, (depth, cls) in arms.items():
            os.environ["DS4_QWEN4_MTP_DEPTH"] = depth
            e.reset()
            out, stats = generate(e, prompt, gen, greedy, np.random.default_rng(0),
                                  drafter=cls(e) if cls else None)
            assert out == want, name
            results[name].append((stats.tok_s, stats.counters))
    base = statistics.median(r[0] for r in results["target-only"])
    for name, rows in results.items():
        tok_s = statistics.median(r[0] for r in rows)
        c = rows[0][1]
        acc = f", accepted {c['accepted_draft']}/{c['proposed']} drafts in {c['cycles']} cycles" if c else ""
        print(f"{name}: {tok_s:.1f} tok/s (x{tok_s / base:.2f}){acc}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--end-to-end", action="store_true", help="whole generations (Qwen3.8 artifacts)")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    e = Engine(a.artifact)
    if not {"glm_mtp", "qwen_mtp"} & set(e.drafters):
        raise SystemExit(f"{a.artifact}: no MTP layer in this artifact")
    print_bounds(parts(e, a.context, a.repeats))
    if a.end_to_end:
        if "qwen_mtp" not in e.drafters:
            raise SystemExit("--end-to-end: Qwen3.8 artifacts only")
        end_to_end(a.artifact, a.gen, a.rounds)


if __name__ == "__main__":
    main()
