"""`ds4 demo`: the embedded default, built on the spot from fixed seeds, compiled for this CPU and
run with DSpark speculative decoding.

The tiny DeepSeek-V4 target has every layer kind of the real model (sliding, ratio-4 with the
indexer, ratio-128, a hash-routed layer) and a small byte-level BPE vocabulary; its residual writers
are scaled down so that its next token is nearly a function of the current one. Its DSpark support
file has random stages and a Markov head read off the target's own greedy continuation of the demo
prompt, so the drafter agrees with the target the way a trained one would on easy text. Everything
is cached after the first run (under ~/.cache/ds4tvm/demo)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import typer

DEMO_SEED = 2026
DEMO_FILE = "ds4-demo-tiny-deepseek4.gguf"
SUPPORT_FILE = "ds4-demo-tiny-dspark.gguf"
RESIDUAL_SCALE = 1e-4
PROMPT = "Hello, world!"
N_TOKENS = 160


def demo_model(out_dir: Path) -> Path:
    from gguf import GGMLQuantizationType as QT

    from .families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
    from .gguf.validate import DENSE

    path = Path(out_dir) / DEMO_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        # Q8_0 for dense projections, as in the published recipe; the rest as default_type says.
        type_of = lambda s: QT.Q8_0 if s.types == DENSE and s.shape[0] % 32 == 0 else default_type(s)  # noqa: E731
        write_random_deepseek4(tmp, tiny_config(), seed=DEMO_SEED, type_of=type_of, residual_scale=RESIDUAL_SCALE)
        tmp.replace(path)
    return path


def _successors(engine, prompt: list[int], n: int, vocab: int) -> np.ndarray:
    from .runtime.sampler import SamplingParams
    from .runtime.speculative import generate

    out, _ = generate(engine, prompt, n, SamplingParams(temperature=0.0), np.random.default_rng(0))
    nxt = np.arange(vocab)
    seq = [prompt[-1]] + out
    for a, b in zip(seq, seq[1:]):
        nxt[a] = b
    return nxt


def _current(art: Path) -> bool:
    """Whether a cached demo artifact exists and this ds4tvm and TVM can run it (else: rebuild)."""
    from .artifact import Manifest
    from .errors import Ds4Error

    if not (art / "manifest.json").is_file():
        return False
    try:
        Manifest.read(art).check_runtime(art)
    except Ds4Error:
        return False
    return True


def build_demo(out_dir: Path, progress: bool = True):
    """Writes (once) the demo model, its DSpark support file and the artifact that pairs them.
    Returns (model path, support path, artifact dir, the demo prompt's token ids)."""
    from .compile.driver import compile_gguf
    from .families.deepseek4.config import Config
    from .artifact import Bounds
    from .families.dspark.agreeing import write_markov_dspark
    from .gguf import open_gguf
    from .runtime.chat import chat_prompt_ids
    from .runtime.engine import Engine
    from .runtime.tokenizer import Tokenizer

    out_dir = Path(out_dir)
    model = demo_model(out_dir)
    f = open_gguf(model)
    cfg = Config.from_gguf(f)
    prompt = chat_prompt_ids(Tokenizer.from_gguf(f), [{"role": "user", "content": PROMPT}])
    bounds = Bounds(max_context=512, max_verify=8, prefill_chunk=256)
    support = out_dir / SUPPORT_FILE
    art = out_dir / "artifact"
    if not _current(art) or not support.exists():
        if progress:
            typer.echo("ds4 demo: first run: building the tiny DeepSeek-V4 + DSpark pair and compiling it "
                       "for this CPU (about a minute)", err=True)
        plain_art = out_dir / "artifact-target-only"
        if not _current(plain_art):
            compile_gguf(model, "cpu", plain_art, bounds, progress=progress)
        nxt = _successors(Engine(plain_art), prompt, N_TOKENS, cfg.n_vocab)
        write_markov_dspark(support, cfg, nxt, seed=DEMO_SEED)
        compile_gguf(model, "cpu", art, bounds, progress=progress, support=support)
    return model, support, art, prompt


def run_demo(out_dir: Path) -> None:
    from .families.deepseek4.config import Config
    from .gguf import open_gguf
    from .runtime.drafters.dspark import DSparkDrafter
    from .runtime.engine import Engine
    from .runtime.sampler import SamplingParams
    from .runtime.speculative import generate
    from .runtime.tokenizer import Tokenizer

    t_start = time.perf_counter()
    model, support, art, prompt = build_demo(out_dir)
    f = open_gguf(model)
    tok = Tokenizer.from_gguf(f)
    engine = Engine(art)
    greedy = SamplingParams(temperature=0.0)
    cfg = Config.from_gguf(f)
    typer.echo(f"demo model: {model.name} ({cfg.n_layers} layers, width {cfg.n_embd}, vocab {cfg.n_vocab}, "
               f"{f.n_params():,} parameters) + DSpark support {support.name}")
    typer.echo(f"prompt: {tok.decode(prompt)!r} ({len(prompt)} tokens)")
    plain, plain_stats = generate(engine, prompt, N_TOKENS, greedy, np.random.default_rng(0))
    engine.reset()
    spec, stats = generate(engine, prompt, N_TOKENS, greedy, np.random.default_rng(0),
                           drafter=DSparkDrafter(engine), stop_ids=tok.stop_ids)
    typer.echo("output: " + repr(tok.decode(spec)))
    same = "identical to" if spec == plain[:len(spec)] else "DIFFERENT from"
    typer.echo(f"target-only: {plain_stats.generated / plain_stats.seconds:.1f} tok/s; with DSpark: "
               f"{stats.generated / stats.seconds:.1f} tok/s ({len(spec)} tokens, {same} target-only decoding)")
    print(stats.line(), file=sys.stderr)
    typer.echo(f"ds4 demo: done in {time.perf_counter() - t_start:.1f} s")
