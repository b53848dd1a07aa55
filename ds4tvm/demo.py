"""`ds4 demo`: the embedded default model, built on the spot from a fixed seed.

The tiny DeepSeek-V4 GGUF has every layer kind of the real model (sliding, ratio-4 with the
indexer, ratio-128, a hash-routed layer) and a small byte-level BPE vocabulary, so the demo runs
offline in seconds on any machine.
"""

from __future__ import annotations

from pathlib import Path

import typer

DEMO_SEED = 2026
DEMO_FILE = "ds4-demo-tiny-deepseek4.gguf"


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
        write_random_deepseek4(tmp, tiny_config(), seed=DEMO_SEED, type_of=type_of)
        tmp.replace(path)
    return path


def run_demo(out_dir: Path) -> None:
    from .cli import inspect_report
    from .gguf import open_gguf
    from .runtime.chat import ChatTemplate
    from .runtime.tokenizer import Tokenizer

    path = demo_model(out_dir)
    r = inspect_report(path)
    typer.echo(f"demo model: {path}")
    typer.echo(f"  {r['family']} ({r['role']}): {r['n_layers']} layers, width {r['n_embd']}, "
               f"vocab {r['n_vocab']}, {r['n_tensors']} tensors, {r['n_params']:,} parameters, "
               f"{r['file_bytes']:,} bytes")
    typer.echo("  types: " + ", ".join(f"{k} x{v}" for k, v in r["quant_types"].items()))
    f = open_gguf(path)
    tok = Tokenizer.from_gguf(f)
    template = ChatTemplate(f.get("tokenizer.chat_template", "str"),
                            bos_token=tok.tokens[tok.bos_id], eos_token=tok.tokens[tok.eos_id])
    prompt = template.render([{"role": "user", "content": "Hello, world!"}])
    ids = tok.encode(prompt, add_bos=False)
    typer.echo(f"  chat prompt {prompt!r}")
    typer.echo(f"  -> {len(ids)} tokens {ids}")
    typer.echo(f"  -> decoded back: {tok.decode(ids)!r}")
