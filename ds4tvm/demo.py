"""The embedded default: a small DeepSeek-V4 code model of the real architecture and its DSpark
drafter, trained on the Python standard library's source by scripts/train_demo.py and shipped as
package data (data/demo: training.json says how they were trained, SHA256SUMS what they are).
`ds4 demo` compiles them for this CPU on first use and completes a Python prompt target-only and
with DSpark; `ds4 run` and `ds4 serve` use them when no model is given."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .errors import Ds4Error

DATA = Path(__file__).resolve().parent / "data" / "demo"
TARGET_FILE = "ds4-demo-target.gguf"
SUPPORT_FILE = "ds4-demo-dspark.gguf"
PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n    with open(path) as f:\n'
N_TOKENS = 64
ROUNDS = 9      # runs of each kind (forced first; then target-only and cost model alternated): medians
BOUNDS = dict(max_context=2048, max_verify=8, prefill_chunk=256, max_batch=4)   # ds4 serve: 4 at once


def _echo(message: str, err: bool = False) -> None:
    import typer   # not at import: the GPU check's pack reads BOUNDS and the pair without the CLI's libraries

    typer.echo(message, err=err)


def embedded_pair() -> tuple[Path, Path]:
    """(target GGUF, DSpark support GGUF) of the installed package."""
    model, support = DATA / TARGET_FILE, DATA / SUPPORT_FILE
    for p in (model, support):
        if not p.is_file():
            raise Ds4Error(f"{p}: the embedded demo model is missing from this installation of ds4tvm")
    return model, support


def default_dir() -> Path:
    from .cache import cache_root

    return cache_root().parent / "demo"


def _current(art: Path) -> bool:
    """Whether a cached artifact exists, this ds4tvm and TVM can run it and the files it was compiled
    from are where it says (a reinstalled or moved ds4tvm ships them elsewhere) (else: rebuild)."""
    from .artifact import Manifest

    if not (art / "manifest.json").is_file():
        return False
    try:
        m = Manifest.read(art)
        m.check_runtime(art)
        m.weight_paths(art)
    except Ds4Error:
        return False
    return all(m.bounds.get(k) == v for k, v in BOUNDS.items())


def embedded_artifact(out_dir: Path | None = None, progress: bool = True) -> Path:
    """The artifact of the embedded pair for this CPU, compiled on first use under out_dir (one per
    version of the shipped files)."""
    from .artifact import Bounds, file_sha256
    from .cache import build_once
    from .compile.driver import CompileRequest, compile_gguf

    model, support = embedded_pair()
    stamp = file_sha256(model)[:12] + file_sha256(support)[:12]
    art = Path(out_dir or default_dir()) / f"artifact-{stamp}"

    def compile_into(tmp: Path) -> None:
        if progress:
            _echo("ds4: first use of the embedded model: compiling it with its DSpark drafter for this CPU "
                  "(about a minute)", err=True)
        compile_gguf(model, tmp, CompileRequest("cpu", Bounds(**BOUNDS), progress=progress, support=support))

    def waiting():
        if progress:
            _echo("ds4: another process is compiling the embedded model: waiting for its artifact", err=True)

    if not _current(art):
        build_once(art, lambda: _current(art), compile_into, waiting)
    return art


def run_demo(out_dir: Path | None = None) -> None:
    from .families.deepseek4.config import Config
    from .gguf import open_gguf
    from .runtime.drafters.dspark import DSparkDrafter, default_theta
    from .runtime.engine import Engine
    from .runtime.sampler import SamplingParams
    from .runtime.costs import model_for
    from .runtime.speculative import generate
    from .runtime.tokenizer import Tokenizer

    t_start = time.perf_counter()
    art = embedded_artifact(out_dir)
    engine = Engine(art)
    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=TARGET_FILE)
    f = open_gguf(embedded_pair()[0])
    cfg = Config.from_gguf(f)
    _echo(f"demo model: {TARGET_FILE} (DeepSeek-V4 architecture, {cfg.n_layers} layers, width {cfg.n_embd}, "
          f"vocab {cfg.n_vocab}, {f.n_params() / 1e6:.1f}M parameters, trained on Python's standard library) "
          f"+ DSpark drafter {SUPPORT_FILE}")
    ids = tok.encode(PROMPT)
    greedy = SamplingParams(temperature=0.0)
    theta = default_theta(engine, exact=False)
    # measured before any prompt is in the state (the measurement resets it), once per machine
    model = model_for(engine, DSparkDrafter(engine, theta), lambda: DSparkDrafter(engine, theta))

    def run(drafter=None, cost_model=None):
        engine.reset()
        return generate(engine, ids, N_TOKENS, greedy, np.random.default_rng(0), drafter=drafter,
                        stop_ids=tok.stop_ids, model=cost_model)

    speeds = {"plain": [], "forced": [], "spec": []}
    if model is not None:   # the forced runs' proposals teach the model what this drafter accepts here
        model.forced = True
    for _ in range(ROUNDS):   # medians: a generation here takes a few tens of milliseconds
        forced, forced_stats = run(DSparkDrafter(engine, theta), model)
        speeds["forced"].append(forced_stats.tok_s)
    if model is not None:
        model.forced = False
    for r in range(ROUNDS):   # alternated, after the forced ones (which leave the caches to the drafter)
        if r % 2:   # each first every other round: what a run leaves behind hits both alike
            spec, stats = run(DSparkDrafter(engine, theta), model)
            plain, plain_stats = run()
        else:
            plain, plain_stats = run()
            spec, stats = run(DSparkDrafter(engine, theta), model)
        speeds["plain"].append(plain_stats.tok_s)
        speeds["spec"].append(stats.tok_s)
    tok_s = {key: statistics.median(v) for key, v in speeds.items()}
    rule = "-" * 72
    _echo(f"prompt ({len(ids)} tokens) and its greedy completion ({len(spec)} tokens):\n{rule}\n"
          f"{PROMPT}{tok.decode(spec, skip_special=True)}\n{rule}")
    same = "identical to" if spec == plain == forced else "DIFFERENT from"
    fc, c = forced_stats.counters, stats.counters
    _echo(f"target-only: {tok_s['plain']:.1f} tok/s; DSpark (θ={theta:g}) asked every cycle: "
          f"{tok_s['forced']:.1f} tok/s, {fc['avg_accept']:.2f} tokens accepted per cycle "
          f"({100 * fc['accept_rate']:.0f}% of proposed); with the cost model: {tok_s['spec']:.1f} tok/s "
          f"(the drafter left out of {c['cost_skips']} of {len(spec)} steps); the outputs are {same} target-only "
          f"decoding at temperature 0")
    if model is not None:
        _echo(model.explain("DSpark"))
    print(stats.line(), file=sys.stderr)
    _echo(f"ds4 demo: done in {time.perf_counter() - t_start:.1f} s")
