"""`ds4 bench`: prefill and decode speed, the cost of verify(k) against one decode, and speculative
speed with acceptance when a drafter is compiled in. Medians over repeats after a warm-up; the
plain and speculative runs alternate so that a noisy machine's drift hits both alike."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter

import numpy as np

from .sampler import SamplingParams, argmax
from .costs import model_for
from .scheduler import Scheduler
from .speculative import generate, verify_cost


def _median_rate(n: int, seconds: list[float]) -> float:
    return n / statistics.median(seconds) if seconds else 0.0


def bench(engine, prompt_len: int = 128, gen: int = 64, verify_k: int = 6, repeats: int = 3,
          drafter_factory=None, stop_ids=frozenset()) -> dict:
    rng = np.random.default_rng(0)
    vocab = engine.n_vocab
    prompt = [int(t) for t in rng.integers(0, vocab, prompt_len) if int(t) not in stop_ids][:prompt_len]
    gen = max(1, min(gen, engine.max_context - len(prompt) - engine.max_verify))
    engine.reset()
    engine.decode(int(argmax(engine.prefill(prompt[:8]).logits)))  # warm-up
    prefill_s, decode_s = [], []
    for _ in range(repeats):
        engine.reset()
        t = time.perf_counter()
        logits = engine.prefill(prompt).logits
        prefill_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(gen):
            logits = engine.decode(argmax(logits)).logits
        decode_s.append(time.perf_counter() - t)
    out = {"prompt_len": len(prompt), "gen": gen, "repeats": repeats,
           "prefill_tok_s": round(_median_rate(len(prompt), prefill_s), 2),
           "decode_tok_s": round(_median_rate(gen, decode_s), 2),
           "verify_cost": {str(k): round(v, 3) for k, v in
                           verify_cost(engine, min(verify_k, engine.max_verify), repeats=max(3, repeats)).items()}}
    if drafter_factory is not None:
        greedy = SamplingParams(temperature=0.0)
        plain_tps, spec_tps, rates = [], [], []
        model = model_for(engine, drafter_factory(engine), lambda: drafter_factory(engine))
        for _ in range(repeats):
            engine.reset()
            _, s = generate(engine, prompt, gen, greedy, np.random.default_rng(0), stop_ids=stop_ids)
            plain_tps.append(s.generated / s.seconds)
            engine.reset()
            _, s = generate(engine, prompt, gen, greedy, np.random.default_rng(0), drafter=drafter_factory(engine),
                            stop_ids=stop_ids, model=model)
            spec_tps.append(s.generated / s.seconds)
            rates.append(s.as_dict()["accept_rate"])
        out["speculative"] = {"plain_tok_s": round(statistics.median(plain_tps), 2),
                              "spec_tok_s": round(statistics.median(spec_tps), 2),
                              "ratio": round(statistics.median(spec_tps) / statistics.median(plain_tps), 3),
                              "accept_rate": round(statistics.median(rates), 4)}
    return out


def concurrency(engine, n: int, prompt_len: int, gen: int, repeats: int, stop_ids=frozenset(),
                drafter_factory=None) -> dict:
    """n greedy generations (distinct prompts of prompt_len, gen tokens each; each with a drafter
    of its own where drafter_factory makes one) at once through the scheduler against one alone:
    aggregate tok/s (prompts included), medians over repeats, and the sequences per decode call,
    per verify call and per drafter step call (Engine.decode_calls, verify_calls and step_calls
    over the last run)."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, engine.n_vocab, prompt_len) if int(t) not in stop_ids]
               for _ in range(n)]

    def run(k: int) -> tuple[float, Counter, Counter, Counter]:
        scheduler, seqs = Scheduler(engine), [engine.new_sequence() for _ in range(k)]
        decodes, verifies, drafts = Counter(engine.decode_calls), Counter(engine.verify_calls), engine.step_calls

        def one(i):
            drafter = drafter_factory(engine) if drafter_factory is not None else None
            with scheduler.member(seqs[i]) as seq_engine:
                generate(seq_engine, prompts[i], gen, SamplingParams(temperature=0.0), np.random.default_rng(0),
                         stop_ids=stop_ids, drafter=drafter)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - t
        scheduler.close()
        return seconds, engine.decode_calls - decodes, engine.verify_calls - verifies, engine.step_calls - drafts

    def mean(calls: Counter) -> float:
        return round(sum(b * c for b, c in calls.items()) / max(1, sum(calls.values())), 2)

    run(min(n, 2))   # warm-up: the batched function's first call
    alone = [run(1)[0] for _ in range(repeats)]
    together = [run(n) for _ in range(repeats)]
    single, many = gen / statistics.median(alone), n * gen / statistics.median(s for s, *_ in together)
    return {"clients": n, "alone_tok_s": round(single, 2), "together_tok_s": round(many, 2),
            "ratio": round(many / single, 3), "max_batch": engine.max_batch, "mean_batch": mean(together[-1][1]),
            "verify_calls": sum(together[-1][2].values()), "mean_verify_batch": mean(together[-1][2]),
            "draft_calls": sum(together[-1][3].values()), "mean_draft_batch": mean(together[-1][3])}


def table(r: dict) -> str:
    lines = [f"prefill  {r['prefill_tok_s']:>10.1f} tok/s   ({r['prompt_len']} tokens, median of {r['repeats']})",
             f"decode   {r['decode_tok_s']:>10.1f} tok/s   ({r['gen']} tokens)",
             "verify(k) / decode  " + "  ".join(f"k={k}: {v:.2f}" for k, v in r["verify_cost"].items())]
    if "speculative" in r:
        s = r["speculative"]
        lines.append(f"speculative {s['spec_tok_s']:.1f} tok/s vs {s['plain_tok_s']:.1f} plain "
                     f"(x{s['ratio']:.2f}), accept rate {100 * s['accept_rate']:.1f}%")
    if "concurrency" in r:
        c = r["concurrency"]
        lines.append(f"{c['clients']} at once  {c['together_tok_s']:.1f} tok/s vs {c['alone_tok_s']:.1f} alone "
                     f"(x{c['ratio']:.2f}), {c['mean_batch']:.2f} sequences per decode call "
                     f"(compiled for up to {c['max_batch']})"
                     + (f", {c['mean_verify_batch']:.2f} per verify call" if c["verify_calls"] else "")
                     + (f", {c['mean_draft_batch']:.2f} per drafter step call" if c["draft_calls"] else ""))
    return "\n".join(lines)


def plot(r: dict, path) -> None:
    from ..errors import Ds4Error

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Ds4Error("--plot needs matplotlib (pip install matplotlib)") from None
    ks = [int(k) for k in r["verify_cost"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ks, [r["verify_cost"][str(k)] for k in ks], marker="o", label="verify(k) / decode")
    ax.plot(ks, ks, linestyle="--", color="gray", label="k decodes")
    ax.set_xlabel("k (tokens verified at once)")
    ax.set_ylabel("time relative to one decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
