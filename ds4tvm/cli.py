"""Command line: `ds4` (inspect, tokenize, detokenize, convert, demo, ...) and `ds4-compile`.

TVM is never imported at module level: `ds4 --help` and the GGUF tools stay fast and work with a
runtime-only TVM install.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import Ds4Error

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="ds4tvm: run DS4-family models compiled with Apache TVM.")
compile_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                          help="Compile a GGUF model into a TVM artifact.")


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


# ---------------------------------------------------------------------------- inspect
def inspect_report(path: Path) -> dict:
    from .families import load_model
    from .gguf import open_gguf

    f = open_gguf(path)
    m = load_model(f)
    return {
        "architecture": f.architecture,
        "family": m.family.name,
        "role": m.family.role,
        "n_layers": m.config.n_layers,
        "n_embd": m.config.n_embd,
        "n_vocab": m.config.n_vocab,
        "n_tensors": len(f.tensors),
        "n_params": f.n_params(),
        "file_bytes": f.file_bytes,
        "quant_types": f.type_counts(),
        "unused_tensors": m.unused_tensors,
    }


@app.command()
def inspect(model: Path = typer.Argument(..., help="GGUF file"),
            as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Family, shape, size and tensor types of a GGUF model, validated against its family."""
    r = inspect_report(model)
    if as_json:
        _echo_json(r)
        return
    typer.echo(f"{model}")
    typer.echo(f"  family        {r['family']} ({r['architecture']}, {r['role']})")
    typer.echo(f"  layers        {r['n_layers']}")
    typer.echo(f"  width         {r['n_embd']}")
    typer.echo(f"  vocab         {r['n_vocab']}")
    typer.echo(f"  tensors       {r['n_tensors']}")
    typer.echo(f"  parameters    {r['n_params']:,}")
    typer.echo(f"  file size     {r['file_bytes']:,} bytes")
    typer.echo("  types         " + ", ".join(f"{k} x{v}" for k, v in r["quant_types"].items()))
    if r["unused_tensors"]:
        typer.echo(f"  unused        {len(r['unused_tensors'])} tensors not read by {r['family']}: "
                   + ", ".join(r["unused_tensors"][:8]) + (" ..." if len(r["unused_tensors"]) > 8 else ""))


# ---------------------------------------------------------------------------- tokenizer
@app.command()
def tokenize(model: Path = typer.Argument(..., help="GGUF file (a vocabulary-only GGUF is enough)"),
             text: str = typer.Argument(..., help="text to tokenize"),
             add_bos: Optional[bool] = typer.Option(None, "--bos/--no-bos",
                                                    help="prepend BOS (default: as the GGUF says)"),
             as_json: bool = typer.Option(False, "--json", help='print {"ids": [...]}')):
    """Token ids of TEXT under the model's tokenizer."""
    from .gguf import open_gguf
    from .runtime.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf(open_gguf(model)).encode(text, add_bos=add_bos)
    if as_json:
        typer.echo(json.dumps({"ids": ids}))
    else:
        typer.echo(" ".join(map(str, ids)))


def parse_ids(text: str, flag: str = "IDS") -> list[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise Ds4Error(f"{flag}: expected token ids separated by commas or spaces, got {text!r}") from None


@app.command()
def detokenize(model: Path = typer.Argument(..., help="GGUF file (a vocabulary-only GGUF is enough)"),
               ids: str = typer.Argument(..., help="token ids, e.g. 1,2,3 or '1 2 3'")):
    """Text of token IDS under the model's tokenizer."""
    from .gguf import open_gguf
    from .runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(model))
    typer.echo(tok.decode(parse_ids(ids)))


# ---------------------------------------------------------------------------- convert
@app.command()
def convert(hf_dir: Path = typer.Argument(..., help="transformers checkpoint directory (config.json + safetensors)"),
            out: Path = typer.Argument(..., help="output .gguf"),
            type_: str = typer.Option("f16", "--type", help="dense weights: f32|f16|bf16|q8_0"),
            experts_type: Optional[str] = typer.Option(None, "--experts-type",
                                                       help="routed experts: q8_0|mxfp4|f16|f32 (default: --type)"),
            quiet: bool = typer.Option(False, "--quiet", help="no progress bar")):
    """Write a GGUF in the DS4 engine's layout from a transformers checkpoint."""
    from .gguf.convert import convert_hf

    path = convert_hf(hf_dir, out, dense_type=type_, experts_type=experts_type, progress=not quiet)
    typer.echo(f"wrote {path}")


# ---------------------------------------------------------------------------- demo
@app.command()
def demo(out_dir: Path = typer.Option(Path.home() / ".cache" / "ds4tvm" / "demo", "--dir",
                                      help="where the embedded demo model is written")):
    """Build the embedded tiny DeepSeek-V4 model and show what ds4 sees in it."""
    from .demo import run_demo

    run_demo(out_dir)


# ---------------------------------------------------------------------------- ds4-compile
@compile_app.command()
def compile_model(model: Path = typer.Argument(..., help="GGUF model"),
                  target: str = typer.Option("cpu", "--target", help="llvm | cpu | ..."),
                  out: Optional[Path] = typer.Option(None, "-o", "--out", help="artifact directory")):
    """Validate MODEL and compile it for TARGET."""
    from .families import load_model
    from .gguf import open_gguf

    m = load_model(open_gguf(model))
    raise Ds4Error(f"{model}: compiling the {m.family.name} family is not available in this build "
                   f"of ds4tvm yet (the file itself is valid)")


def _run(typer_app) -> None:
    try:
        typer_app()
    except Ds4Error as e:
        print(f"ds4: error: {e.message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("ds4: interrupted", file=sys.stderr)
        sys.exit(130)


def main() -> None:
    _run(app)


def compile_main() -> None:
    _run(compile_app)


if __name__ == "__main__":
    main()
