"""`ds4 inspect`, `verify`, `list`, `rm`, `tokenize`, `detokenize`, `convert`: model files, artifacts and
the cache, without running a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import Ds4Error
from .common import echo_json, app, parse_ids


# ---------------------------------------------------------------------------- inspect
def inspect_report(path: Path) -> dict:
    from ..families import load_model
    from ..gguf import open_gguf

    f = open_gguf(path)
    m = load_model(f)
    cfg, n_params = m.config, f.n_params()
    template = "in the file" if f.has("tokenizer.chat_template") else \
        ("the family's (the file carries none)" if m.family.chat_template else "none")
    return {
        "architecture": f.architecture,
        "family": m.family.name,
        "title": m.family.title or m.family.name,
        "role": m.family.role,
        "n_layers": cfg.n_layers,
        "n_embd": cfg.n_embd,
        "n_vocab": cfg.n_vocab,
        "context_length": getattr(cfg, "context_length", None),
        "experts": (f"{cfg.n_expert_used} of {cfg.n_expert} routed per token"
                    if getattr(cfg, "n_expert", 0) and hasattr(cfg, "n_expert_used") else None),
        "n_tensors": len(f.tensors),
        "n_params": n_params,
        "bits_per_weight": round(8 * f.file_bytes / n_params, 2) if n_params else None,
        "chat_template": template if m.family.role == "target" else None,
        "file_bytes": f.file_bytes,
        "quant_types": f.type_counts(),
        "unused_tensors": m.unused_tensors,
        "details": {**(m.family.describe(m.config) if m.family.describe else {}),
                    # tensors held in another valid layout than the family's table (gguf/validate.same_layout)
                    **({"layouts": "; ".join(f"{n} {note}" for n, note in f.layout_notes.items())}
                       if f.layout_notes else {})},
    }


def artifact_report(path: Path) -> dict:
    """An artifact directory as its manifest describes it, with what running it holds in memory: the
    weight files (mapped) and one sequence's state tensors (each server slot holds another)."""
    import numpy as np

    from ..artifact import Manifest
    from ..families import family_named

    m = Manifest.read(path)
    fam = family_named(m.family)
    states = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in m.state_specs())
    weights = {role: {"path": w["gguf_path"], "bytes": w["gguf_size"]} for role, w in m.weights.items()}
    lib = Path(path) / m.library
    return {"artifact": str(path), "family": m.family, "title": fam.title or m.family, "target": m.target_name,
            "device": m.device, "bounds": m.bounds, "drafters": sorted(m.drafters), "weights": weights,
            "library_bytes": lib.stat().st_size if lib.is_file() else None,
            "functions": sorted(m.function_specs()), "state_bytes_per_sequence": states,
            "memory_bytes": sum(w["bytes"] for w in weights.values()) + states}


@app.command()
def inspect(model: Path = typer.Argument(..., help="GGUF file, or an artifact directory"),
            as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Family, shape, size and tensor types of a GGUF model, validated against its family; for an
    artifact directory, its target, bounds, drafters, weight files and memory."""
    if model.is_dir():
        if not (model / "manifest.json").is_file():
            raise Ds4Error(f"{model}: a directory, neither a GGUF file nor an artifact (no manifest.json)")
        r = artifact_report(model)
        if as_json:
            echo_json(r)
            return
        typer.echo(f"{model}\n  model         {r['title']} ({r['family']})\n  target        {r['target']} ({r['device']})")
        b = r["bounds"]
        typer.echo(f"  context       {b['max_context']} (verify up to {b['max_verify']}, prefill chunk {b['prefill_chunk']})")
        typer.echo(f"  drafters      {', '.join(r['drafters']) or 'none'}")
        for role, w in r["weights"].items():
            typer.echo(f"  weights       {role}: {w['path']} ({w['bytes'] / 2**30:.2f} GiB)")
        typer.echo(f"  memory        {r['memory_bytes'] / 2**30:.2f} GiB: the weights and one sequence's state "
                   f"({r['state_bytes_per_sequence'] / 2**20:.1f} MiB; each server slot holds one more)")
        return
    r = inspect_report(model)
    if as_json:
        echo_json(r)
        return
    typer.echo(f"{model}")
    typer.echo(f"  model         {r['title']} ({r['family']}, {r['architecture']}, {r['role']})")
    typer.echo(f"  layers        {r['n_layers']}")
    typer.echo(f"  width         {r['n_embd']}")
    for label, value in (("context", r["context_length"]), ("experts", r["experts"]),
                         ("chat template", r["chat_template"])):
        if value is not None:
            typer.echo(f"  {label:<13} {value}")
    for label, text in r["details"].items():
        typer.echo(f"  {label:<13} {text}")
    vocab = r["n_vocab"] or "the target model's (a support file)"
    typer.echo(f"  vocab         {vocab}")
    typer.echo(f"  tensors       {r['n_tensors']}")
    typer.echo(f"  parameters    {r['n_params']:,} ({r['bits_per_weight']} bits per weight)")
    typer.echo(f"  file size     {r['file_bytes']:,} bytes (the weights' memory when run: mapped, not copied)")
    typer.echo("  types         " + ", ".join(f"{k} x{v}" for k, v in r["quant_types"].items()))
    if r["unused_tensors"]:
        typer.echo(f"  unused        {len(r['unused_tensors'])} tensors not read by {r['family']}: "
                   + ", ".join(r["unused_tensors"][:8]) + (" ..." if len(r["unused_tensors"]) > 8 else ""))


# ---------------------------------------------------------------------------- tokenizer
@app.command()
def verify(model: Path = typer.Argument(..., help="artifact directory or package (.tar or directory)"),
           quiet: bool = typer.Option(False, "--quiet", help="no progress bar, only the last line")):
    """Hash every file of an artifact or a package in full (library, tokenizer, weights) and check the
    weights as the engine does before running; exit 2 naming the first file that differs."""
    from ..runtime.loader import verify_model

    if not model.exists():
        raise Ds4Error(f"{model}: no such artifact directory or package")
    lines = verify_model(model, progress=not quiet)
    for line in lines if not quiet else []:
        typer.echo(line)
    typer.echo(f"{model}: every file matches ({len(lines)} checks)")


@app.command("list")
def list_cache(as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """The artifacts compiled on first use and the packages unpacked in the ds4tvm cache."""
    import time

    from ..cache import entries

    found = entries()
    if as_json:
        echo_json(found)
        return
    for e in found:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["modified"]))
        typer.echo(f"{e['key']}  {e['kind']:<8} {e['family'] or '?':<9} {e['target'] or '?':<16} "
                   f"{e['bytes'] / 2**20:8.1f} MiB  {when}  {e['source'] or '?'}")
    if not found:
        typer.echo("the cache holds no compiled artifact or unpacked package")


@app.command("rm")
def remove_cached(keys: list[str] = typer.Argument(None, help="keys that `ds4 list` shows"),
                  remove_all: bool = typer.Option(False, "--all", help="every artifact and package in the cache")):
    """Remove compiled artifacts or unpacked packages from the ds4tvm cache (they are made again on
    next use); nothing outside the cache is touched."""
    import shutil

    from ..cache import entries

    found = {e["key"]: e for e in entries()}
    if remove_all == bool(keys):
        raise Ds4Error("give the keys to remove (ds4 list shows them) or --all, not both or neither")
    missing = [k for k in keys or [] if k not in found]
    if missing:
        raise Ds4Error(f"{missing[0]}: no artifact or package with this key in the cache (see ds4 list)")
    for key in (found if remove_all else keys):
        shutil.rmtree(found[key]["path"])
        typer.echo(f"removed {found[key]['kind']} {key} ({found[key]['bytes'] / 2**20:.1f} MiB)")


@app.command()
def tokenize(model: Path = typer.Argument(..., help="GGUF file (a vocabulary-only GGUF is enough)"),
             text: str = typer.Argument(..., help="text to tokenize"),
             add_bos: Optional[bool] = typer.Option(None, "--bos/--no-bos",
                                                    help="prepend BOS (default: as the GGUF says)"),
             as_json: bool = typer.Option(False, "--json", help='print {"ids": [...]}')):
    """Token ids of TEXT under the model's tokenizer."""
    from ..gguf import open_gguf
    from ..runtime.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf(open_gguf(model)).encode(text, add_bos=add_bos)
    if as_json:
        typer.echo(json.dumps({"ids": ids}))
    else:
        typer.echo(" ".join(map(str, ids)))


@app.command()
def detokenize(model: Path = typer.Argument(..., help="GGUF file (a vocabulary-only GGUF is enough)"),
               ids: str = typer.Argument(..., help="token ids, e.g. 1,2,3 or '1 2 3'")):
    """Text of token IDS under the model's tokenizer."""
    from ..gguf import open_gguf
    from ..runtime.tokenizer import Tokenizer

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
    """Write a GGUF in the DS4 engine's layout from a transformers checkpoint (the family is chosen by
    config.json's model_type)."""
    from ..families import REGISTRY, load_attr

    if not hf_dir.is_dir():
        raise Ds4Error(f"{hf_dir}: not a directory (expected a transformers checkpoint directory)")
    try:
        model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise Ds4Error(f"{hf_dir / 'config.json'}: unreadable transformers config ({e})") from None
    fam = next((f for f in REGISTRY.values() if model_type in f.hf_model_types and f.convert), None)
    if fam is None:
        known = sorted(t for f in REGISTRY.values() if f.convert for t in f.hf_model_types)
        raise Ds4Error(f"{hf_dir / 'config.json'}: model_type is {model_type!r}; ds4 convert reads {', '.join(known)}")
    path = load_attr(fam.convert)(hf_dir, out, dense_type=type_, experts_type=experts_type, progress=not quiet)
    typer.echo(f"wrote {path}")
