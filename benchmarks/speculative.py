"""Side by side, in one run: target-only vs speculative tok/s on the same artifact, and the cost of
a verify of k tokens relative to one decode step. Two modes:

    python benchmarks/speculative.py ARTIFACT_WITH_DRAFTER [--dspark | --mtp-draft N | --mtp | --draft-onnx]
        [--tokens 7,8,9] [-n 160] [--repeats 7]
        one prompt (token ids), the drafter chosen by the ds4 flags;
    python benchmarks/speculative.py --markov MODEL.gguf [--tokens ...] [-n 160] [--repeats 7]
        the first mode, on a DeepSeek-V4 GGUF (the benchmark model of benchmarks/model50m.py) paired
        with two DSpark files written for it (families/dspark/agreeing.py): one whose Markov head
        proposes the target's own greedy continuation of the prompt (drafts that pay, where the
        drafter's cost allows) and one that proposes the token after it (never accepted); the
        artifacts compiled once into .bench/markov-NAME/;
    python benchmarks/speculative.py --heldout [ARTIFACT] [--prompts 16] [-n 128] [--thetas 0,0.5,0.7,0.9]
        [--rounds 3]
        DSpark on windows of the held-out standard-library files (ds4tvm/training/corpus.py), by
        default on the embedded demo pair: for each θ, at temperature 0 and at temperature 1
        (opportunistic and exact), the acceptance per position in the block, the accepted tokens
        per cycle and target-only, DSpark asked every cycle and DSpark with the cost model
        (runtime/costs.py) in tok/s (the three alternate per prompt, so the machine's drift hits
        them alike; each kind's tok/s over all prompts, the median of --rounds passes); one cost model
        per row, its costs measured once per artifact and machine. Times include a drafter's
        deferred writes after the last token (`finish`)."""

import argparse
import statistics
from pathlib import Path

import numpy as np

from ds4tvm.runtime.drafters import SpecOptions, choose_drafter
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import generate, verify_cost


KINDS = ("plain", "forced", "model")


def rotated(r: int) -> tuple:
    """KINDS in the order of alternation r: each goes first in turn, so what a run leaves behind
    (caches, the machine's drift) falls on every kind alike."""
    return KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]


def median_ratio(rates: dict, a: str, b: str) -> float:
    """The median over alternations of kind a's tok/s over kind b's in the same alternation."""
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]))


def one_prompt(a, engine):
    from ds4tvm.runtime.costs import CostModel, costs_for

    options = SpecOptions(dspark=a.dspark or (a.mtp_draft == 1 and not a.draft_onnx and not a.mtp),
                          mtp_draft=a.mtp_draft, mtp_margin=a.mtp_margin, mtp="" if a.mtp else None,
                          draft_onnx="" if a.draft_onnx else None)
    prompt = [int(x) for x in a.tokens.split(",")]
    greedy = SamplingParams(temperature=0.0)

    def drafter():
        return choose_drafter(engine, options, Path(a.artifact))

    name = drafter().NAME
    model = CostModel(costs_for(engine, name, drafter, engine.max_verify), engine.max_verify)
    rates, accept, skips = {k: [] for k in KINDS}, [], []
    for r in range(a.repeats):
        for kind in rotated(r):
            engine.reset()
            _, s = generate(engine, prompt, a.n, greedy, np.random.default_rng(0),
                            drafter=None if kind == "plain" else drafter(), model=model if kind == "model" else None)
            rates[kind].append(s.tok_s)
            if kind == "forced":
                accept.append(s.counters["accept_rate"])
            if kind == "model":
                skips.append(s.counters["cost_skips"])
    p, f, m = (statistics.median(rates[k]) for k in KINDS)
    print(f"target-only {p:.1f} tok/s | {name} asked every cycle {f:.1f} tok/s "
          f"(x{median_ratio(rates, 'forced', 'plain'):.2f}, accept rate {accept[0]:.2%}) | with the cost model "
          f"{m:.1f} tok/s (x{median_ratio(rates, 'model', 'plain'):.2f}; "
          f"x{median_ratio(rates, 'model', 'forced'):.2f} of forced; left out of {skips[-1]} of {a.n} steps in "
          f"the last run); medians over {a.repeats} alternations (of the ratios, per alternation)")
    print(f"  {model.explain(name)}")


MODES = (("T=0 greedy", SamplingParams(temperature=0.0), False),
         ("T=1 opportunistic", SamplingParams(temperature=1.0), False),
         ("T=1 exact", SamplingParams(temperature=1.0), True))


def heldout_row(engine, prompts, n, theta, params, exact, stop_ids, rounds):
    """Target-only, DSpark asked every cycle and DSpark with the cost model over every prompt,
    `rounds` times (alternated per prompt, the order rotated so that none always runs first): each
    kind's tok/s and the ratios, medians over the rounds; the first round's forced counters."""
    from ds4tvm.runtime.costs import CostModel, costs_for
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter

    # one model per row, kept over its prompts as an engine keeps its own; the costs measured once
    model = CostModel(costs_for(engine, DSparkDrafter.NAME, lambda: DSparkDrafter(engine, theta), engine.max_verify),
                      engine.max_verify)
    rates = {k: [] for k in KINDS}
    depth, cycles, accepted, proposed, identical = {}, 0, 0, 0, 0
    for r in range(rounds):
        seconds, generated = dict.fromkeys(KINDS, 0.0), dict.fromkeys(KINDS, 0)
        for i, prompt in enumerate(prompts):
            outs = {}
            for kind in rotated(i + r):
                engine.reset()
                drafter = None if kind == "plain" else DSparkDrafter(engine, theta)
                outs[kind], s = generate(engine, prompt, n, params, np.random.default_rng(i), drafter=drafter,
                                         model=model if kind == "model" else None, exact=exact, stop_ids=stop_ids)
                seconds[kind], generated[kind] = seconds[kind] + s.seconds, generated[kind] + s.generated
                if kind == "forced" and r == 0:
                    c = s.counters
                    cycles, accepted, proposed = cycles + c["cycles"], accepted + c["accepted_draft"], proposed + c["proposed"]
                    for k, v in c["depth"].items():
                        depth[int(k)] = depth.get(int(k), 0) + v
            identical += r == 0 and outs["plain"] == outs["forced"] == outs["model"]
        for k in KINDS:
            rates[k].append(generated[k] / seconds[k])
    reached = [sum(v for k, v in depth.items() if k >= i) / max(cycles, 1) for i in range(1, 6)]
    spread = [x / y for x, y in zip(rates["model"], rates["plain"])]
    return {**{k: statistics.median(rates[k]) for k in KINDS}, "model/plain": median_ratio(rates, "model", "plain"),
            "model/forced": median_ratio(rates, "model", "forced"), "spread": spread,
            "per_cycle": accepted / max(cycles, 1), "accept_rate": accepted / max(proposed, 1), "reached": reached,
            "cycles": cycles, "identical": identical, "explain": model.explain("DSpark")}


def heldout(a, engine):
    from ds4tvm.runtime.tokenizer import Tokenizer
    from ds4tvm.training import corpus

    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    prompts = corpus.windows(tok, corpus.stdlib_files(True), a.prompts, a.prompt_len, seed=7)
    thetas = [float(t) for t in a.thetas.split(",")]
    print(f"{len(prompts)} held-out windows of {a.prompt_len} tokens, {a.n} new tokens each "
          f"(stopping at an end of file); accepted per cycle counts the checked guess, as ds4 does; 'forced': "
          f"DSpark asked every cycle, 'cost model': asked as runtime/costs.py decides")
    print(f"tok/s and ratios: medians over {a.rounds} rounds (the model / target-only ratio's range over them)")
    print("| mode | θ | target-only tok/s | DSpark forced | DSpark cost model | model / target-only | model / forced | "
          "accepted per cycle (forced) | accept rate | position 1..5 reached | cycles |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, params, exact in MODES:
        for theta in thetas:
            r = heldout_row(engine, prompts, a.n, theta, params, exact, tok.stop_ids, a.rounds)
            same = f" (identical outputs: {r['identical']}/{len(prompts)})" if params.temperature == 0 else ""
            print(f"| {name}{same} | {theta} | {r['plain']:.1f} | {r['forced']:.1f} | {r['model']:.1f} | "
                  f"{r['model/plain']:.2f} ({min(r['spread']):.2f}-{max(r['spread']):.2f}) | {r['model/forced']:.2f} | "
                  f"{r['per_cycle']:.2f} | "
                  f"{100 * r['accept_rate']:.1f}% | {' '.join(f'{x:.2f}' for x in r['reached'])} | {r['cycles']} |",
                  flush=True)
            if params.temperature == 0:   # a sampled generation plans from its own tokens: the row's model is unused
                print(f"  {r['explain']}", flush=True)


def markov_pairs(gguf: Path, prompt: list[int], n: int) -> dict[str, Path]:
    """Artifacts of `gguf` with an agreeing and a never-agreeing Markov DSpark (built once)."""
    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import CompileRequest, compile_gguf
    from ds4tvm.families.deepseek4.config import Config
    from ds4tvm.families.dspark.agreeing import write_markov_dspark
    from ds4tvm.gguf import open_gguf

    out = Path(".bench") / f"markov-{gguf.stem}"
    bounds = Bounds(max_context=1024, max_verify=8, prefill_chunk=256)
    arts = {name: out / f"artifact-{name}" for name in ("agreeing", "never-agreeing")}
    if all((art / "manifest.json").is_file() for art in arts.values()):
        return arts
    cfg = Config.from_gguf(open_gguf(gguf))
    plain = out / "artifact-target-only"
    if not (plain / "manifest.json").is_file():
        compile_gguf(gguf, plain, CompileRequest("cpu", bounds))
    continuation, _ = generate(Engine(plain), prompt, n, SamplingParams(temperature=0.0), np.random.default_rng(0))
    successor = dict(zip(prompt[-1:] + continuation, continuation))
    wrong = {a: (b + 1) % cfg.n_vocab for a, b in successor.items()}
    for name, table in (("agreeing", successor), ("never-agreeing", wrong)):
        support = write_markov_dspark(out / f"{name}.gguf", cfg, table, seed=6)
        compile_gguf(gguf, arts[name], CompileRequest("cpu", bounds, support=support))
    return arts


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
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--heldout", action="store_true")
    ap.add_argument("--markov", type=Path, help="a DeepSeek-V4 GGUF: its agreeing and never-agreeing DSpark pairs")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--thetas", default="0,0.5,0.7,0.9")
    ap.add_argument("--rounds", type=int, default=3, help="with --heldout: passes over the prompts (medians)")
    a = ap.parse_args()
    if a.markov:
        a.n, a.dspark = a.n or 160, True
        for name, art in markov_pairs(a.markov, [int(x) for x in a.tokens.split(",")], a.n).items():
            print(f"{a.markov.name} with the {name} DSpark:")
            a.artifact = art
            one_prompt(a, Engine(art))
        return
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
