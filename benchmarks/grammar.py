"""What a grammar costs per token: the embedded demo pair decoding the same prompt with and without
a JSON-schema constraint (runtime/grammar.py), alternated, greedy, target-only and with DSpark;
prints tokens/s side by side and the mask's share of a step.

    .venv/bin/python benchmarks/grammar.py [--runs 5] [--tokens 96]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ds4tvm.demo import embedded_artifact
from ds4tvm.runtime.drafters.dspark import DSparkDrafter
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.grammar import Grammars
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import generate
from ds4tvm.runtime.tokenizer import Tokenizer

SCHEMA = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def timed(engine, tok, prompt, n, grammars, drafted: bool) -> tuple[float, int, float]:
    """(tokens/s of the generation, tokens, seconds spent masking)."""
    engine.reset()
    c = grammars.json_schema(SCHEMA) if grammars is not None else None
    spent = [0.0]
    if c is not None:
        mask = c.mask

        def counted(logits):
            t0 = time.perf_counter()
            out = mask(logits)
            spent[0] += time.perf_counter() - t0
            return out

        c.mask = counted
    out, stats = generate(engine, prompt, n, SamplingParams(0.0), np.random.default_rng(0),
                          drafter=DSparkDrafter(engine) if drafted else None, stop_ids=tok.stop_ids, constraint=c)
    return len(out) / stats.seconds, len(out), spent[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    engine = Engine(embedded_artifact())
    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    grammars, prompt = Grammars(tok), tok.encode("# a record as JSON\nrecord = ")
    print("| decoding | free tok/s | with the schema tok/s | ratio | mask ms per token |")
    print("|---|---|---|---|---|")
    for drafted in (False, True):
        free, bound, mask_ms = [], [], []
        for _ in range(args.runs):
            free.append(timed(engine, tok, prompt, args.tokens, None, drafted)[0])
            rate, n, spent = timed(engine, tok, prompt, args.tokens, grammars, drafted)
            bound.append(rate)
            mask_ms.append(1e3 * spent / max(n, 1))
        f, b = float(np.median(free)), float(np.median(bound))
        print(f"| {'DSpark' if drafted else 'target-only'} | {f:.1f} | {b:.1f} | {b / f:.2f} | "
              f"{float(np.median(mask_ms)):.3f} |")


if __name__ == "__main__":
    main()
