"""The demo models' corpus: the Python standard library source of the interpreter that runs the
training, as a fixed, sorted file list. Files whose top-level name starts with one of HELD_OUT are
never trained on; they give the held-out perplexity and the speculation benchmarks' prompts."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

HELD_OUT = ("s",)
# tests, generated tables and data blobs rather than code a user would write
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings",
                           "pydoc_data", "turtledemo"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(held_out: bool, limit: int | None = None) -> list[Path]:
    root = stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts))
    chosen = [p for p in files if p.relative_to(root).parts[0].lower().startswith(HELD_OUT) == held_out]
    return chosen[:limit] if limit else chosen


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def windows(tok, files: list[Path], n: int, length: int, seed: int) -> list[list[int]]:
    """n windows of `length` tokens cut from the files at random places, drawn with a fixed seed."""
    rng = np.random.default_rng(seed)
    out, tries = [], 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        ids = tok.encode(read(files[rng.integers(len(files))])[:20000], add_bos=False)
        if len(ids) > length:
            start = int(rng.integers(len(ids) - length))
            out.append(ids[start:start + length])
    return out


def greedy_continuations(engine, prompts: list[list[int]], n_new: int, output: str, bar=None):
    """(rows of `output` [L, ...], tokens [L], prompt length) per prompt: the prompt plus the
    target's greedy continuation, and that output of the target for every position (the drafter
    functions of an artifact read `captured`; every artifact returns `hidden`)."""
    from ..runtime.sampler import SamplingParams
    from ..runtime.speculative import generate

    data = []
    for w in prompts:
        engine.reset()
        out, _ = generate(engine, w, n_new, SamplingParams(temperature=0.0), np.random.default_rng(0))
        seq = w + out
        engine.reset()
        data.append((engine.prefill(seq, all_logits=True).outputs[output], np.array(seq), len(w)))
        if bar is not None:
            bar()
    return data
