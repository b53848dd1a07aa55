"""The random demo pair the tests share (conftest.demo_pair): a tiny DeepSeek-V4 with every layer
kind and a small byte-level BPE vocabulary, its residual writers scaled down so that its next token
is nearly a function of the current one, and a DSpark support file whose Markov head is read off the
target's own greedy continuation of PROMPT (so the drafter agrees with the target, as the server,
package and target tests need). Built from fixed seeds, compiled once per run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

SEED = 2026
MODEL_FILE = "ds4-demo-tiny-deepseek4.gguf"
SUPPORT_FILE = "ds4-demo-tiny-dspark.gguf"
RESIDUAL_SCALE = 1e-4
PROMPT = "Hello, world!"
N_TOKENS = 160


def random_model(out_dir: Path) -> Path:
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
    from ds4tvm.gguf.validate import DENSE

    path = Path(out_dir) / MODEL_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        # Q8_0 for dense projections, as in the published recipe; the rest as default_type says.
        type_of = lambda s: QT.Q8_0 if s.types == DENSE and s.shape[0] % 32 == 0 else default_type(s)  # noqa: E731
        write_random_deepseek4(tmp, tiny_config(), seed=SEED, type_of=type_of, residual_scale=RESIDUAL_SCALE)
        tmp.replace(path)
    return path


def _successors(engine, prompt: list[int], n: int, vocab: int) -> np.ndarray:
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    out, _ = generate(engine, prompt, n, SamplingParams(temperature=0.0), np.random.default_rng(0))
    nxt = np.arange(vocab)
    seq = [prompt[-1]] + out
    for a, b in zip(seq, seq[1:]):
        nxt[a] = b
    return nxt


def build_random_demo(out_dir: Path):
    """Writes (once) the model, its support file and the artifact that pairs them. Returns (model
    path, support path, artifact dir, the prompt's token ids)."""
    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import CompileRequest, compile_gguf
    from ds4tvm.families.deepseek4.config import Config
    from ds4tvm.families.dspark.agreeing import write_markov_dspark
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.chat import chat_prompt_ids
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.tokenizer import Tokenizer

    out_dir = Path(out_dir)
    model = random_model(out_dir)
    f = open_gguf(model)
    cfg = Config.from_gguf(f)
    prompt = chat_prompt_ids(Tokenizer.from_gguf(f), [{"role": "user", "content": PROMPT}])
    # batched calls of 2 sequences (the server's tests need calls of several; larger batches are
    # tiny_artifact's, up to 3): each further size is two more functions to compile
    bounds = Bounds(max_context=512, max_verify=8, prefill_chunk=256, max_batch=2)
    support, art = out_dir / SUPPORT_FILE, out_dir / "artifact"
    if not (art / "manifest.json").is_file() or not support.exists():
        plain_art = out_dir / "artifact-target-only"
        if not (plain_art / "manifest.json").is_file():
            # one sequence at a time (its users: greedy references), so no batched functions
            compile_gguf(model, plain_art, CompileRequest("cpu", replace(bounds, max_batch=1)))
        nxt = _successors(Engine(plain_art), prompt, N_TOKENS, cfg.n_vocab)
        write_markov_dspark(support, cfg, nxt, seed=SEED)
        compile_gguf(model, art, CompileRequest("cpu", bounds, support=support))
    return model, support, art, prompt
