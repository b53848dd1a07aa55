"""Command line: `ds4` (inspect, tokenize, detokenize, convert, demo, ...) and `ds4-compile`.

TVM is never imported at module level: `ds4 --help` and the GGUF tools stay fast and work with a
runtime-only TVM install.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import Ds4Error

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="ds4tvm: run DS4-family models compiled with Apache TVM.")
compile_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                          help="Compile a GGUF model into a TVM artifact.")


def _version(value: bool) -> None:
    if value:
        from . import __version__
        from .runtime.loader import tvm_version

        typer.echo(f"ds4tvm {__version__} (apache-tvm {tvm_version()})")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print the version and exit")):
    """ds4tvm: run DS4-family models compiled with Apache TVM."""


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


# ---------------------------------------------------------------------------- inspect
def inspect_report(path: Path) -> dict:
    from .families import load_model
    from .gguf import open_gguf

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

    from .artifact import Manifest
    from .families import family_named

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
            _echo_json(r)
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
        _echo_json(r)
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
    from .runtime.loader import verify_model

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

    from .cache import entries

    found = entries()
    if as_json:
        _echo_json(found)
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

    from .cache import entries

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
    """Write a GGUF in the DS4 engine's layout from a transformers checkpoint (the family is chosen by
    config.json's model_type)."""
    from .families import REGISTRY, load_attr

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


# ---------------------------------------------------------------------------- demo
@app.command()
def demo(out_dir: Optional[Path] = typer.Option(None, "--dir", help="where the embedded model's artifact is "
                                                 "compiled (default: the ds4tvm cache)")):
    """Complete a Python prompt with the embedded code model, target-only and with DSpark."""
    from .demo import run_demo

    run_demo(out_dir)


def _model_or_embedded(model: Path | None, progress: bool) -> Path:
    """MODEL, or (none given) the embedded code model's artifact, compiled with its DSpark support
    file on first use, so that --dspark speculates with that drafter."""
    if model is not None:
        return model
    from .demo import TARGET_FILE, embedded_artifact

    art = embedded_artifact(progress=progress)
    print(f"ds4: no -m given: using the embedded demo model {TARGET_FILE} and its DSpark drafter ({art})",
          file=sys.stderr, flush=True)
    return art


# ---------------------------------------------------------------------------- run / logits
def _threads(n: int | None) -> None:
    """The CPU thread pool's size, set before TVM starts it (TVM reads TVM_NUM_THREADS once; the
    engine defaults it to every core, or one for a model under 64 MB)."""
    if n is None:
        return
    if n < 1:
        raise Ds4Error(f"--threads {n}: expected at least 1")
    os.environ["TVM_NUM_THREADS"] = str(n)


def _gguf_family(model: Path | None):
    """The family of a GGUF given as MODEL (None for artifacts, packages and missing paths)."""
    if model is None or not model.is_file() or model.suffix == ".tar":
        return None
    from .families import family_for
    from .gguf import open_gguf

    return family_for(open_gguf(model))


def _bounds(family, max_context: int | None = None, max_verify: int | None = None,
            prefill_chunk: int | None = None):
    """The bounds to compile with: what the flags say, the rest as the family prefers (a recurrent
    family keeps max_verify small). Artifacts and packages keep theirs (family None)."""
    from dataclasses import replace

    from .artifact import Bounds

    default = family.default_bounds if family is not None else Bounds()
    given = {"max_context": max_context, "max_verify": max_verify, "prefill_chunk": prefill_chunk}
    return replace(default, **{k: v for k, v in given.items() if v is not None})


# Flags of run, bench and logits, with llama.cpp's spellings beside ours.
CtxOpt = typer.Option(None, "-c", "--ctx", "--ctx-size", help="context when compiling a GGUF on first use (default "
                                                              "4096); with an artifact, at most its own")
TargetOpt = typer.Option("cpu", "--target", help="target when compiling a GGUF on first use (ds4-compile --target "
                                                 "list; auto: this machine's GPU, else its CPU); refused for an "
                                                 "artifact or package, which keep theirs")
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (default: every core; one for a model under "
                                                        "64 MB)")


# The speculation flags, defined once for run, serve and bench (ds4's spellings and meanings).
MtpOpt = Annotated[Optional[str], typer.Option(
    "--mtp", "--mtp-model", help="support GGUF of the drafter (DSpark or legacy MTP); a bare --mtp: the draft "
                                 "layer inside the model GGUF")]
MtpDraftOpt = Annotated[int, typer.Option("--mtp-draft", help="legacy MTP: tokens per cycle, the chosen one "
                                                               "included (1: off, max 16, recommended 2)")]
MtpMarginOpt = Annotated[Optional[float], typer.Option(
    "--mtp-margin", help="legacy MTP: verify a draft only when its top-1 minus top-2 logit margin is at least "
                         "this (default 3.0, DS4_MTP_MIN_MARGIN)")]
MtpTimingOpt = Annotated[bool, typer.Option("--mtp-timing", help="MTP: print one timing line per cycle "
                                                                  "(enables MTP)")]
DSparkOpt = Annotated[bool, typer.Option("--dspark", help="speculate with the DSpark drafter")]
DSparkConfidenceOpt = Annotated[Optional[float], typer.Option(
    "--dspark-confidence", help="confidence threshold (default: the support file's calibrated value, else 0.7; "
                                "at least 0.8 with exact sampling; 0: full blocks); implies --dspark")]
DSparkStrictOpt = Annotated[bool, typer.Option("--dspark-strict", help="load and check the drafter, decode "
                                                                        "target-only")]
DraftOnnxOpt = Annotated[Optional[str], typer.Option(
    "--draft-onnx", help="speculate with ONNX draft heads: those compiled into the artifact (bare --draft-onnx), "
                         "or HEADS.onnx to compile in when MODEL is a GGUF")]
QualityOpt = Annotated[bool, typer.Option("--quality", help="target-only decoding (no speculative acceptance)")]
ExactOpt = Annotated[bool, typer.Option("--mtp-exact-sampling", help="exact speculative sampling")]


def _spec_options(mtp, mtp_draft, mtp_margin, mtp_timing, dspark, dspark_confidence, dspark_strict, quality,
                  exact_sampling, draft_onnx=None):
    from .runtime.drafters import SpecOptions

    if mtp is not None and mtp != "" and not Path(mtp).exists():
        raise Ds4Error(f"--mtp {mtp}: no such support file")
    if draft_onnx and not Path(draft_onnx).is_file():
        raise Ds4Error(f"--draft-onnx {draft_onnx}: no such ONNX file")
    return SpecOptions(mtp=mtp, mtp_draft=mtp_draft, mtp_margin=mtp_margin, mtp_timing=mtp_timing, dspark=dspark,
                       dspark_confidence=dspark_confidence, dspark_strict=dspark_strict,
                       exact_sampling=exact_sampling, quality=quality, draft_onnx=draft_onnx)


@app.command()
def run(model: Optional[Path] = typer.Option(None, "-m", "--model", help="artifact directory or GGUF (compiled on "
                                             "first use); default: the embedded demo model"),
        prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="prompt text (rendered with the chat template)"),
        tokens: Optional[str] = typer.Option(None, "--tokens", help="prompt as token ids, e.g. 1,2,3"),
        raw: bool = typer.Option(False, "--raw", help="tokenize the prompt as is, without the chat template"),
        interactive: bool = typer.Option(False, "-i", "--interactive", help="chat: one user turn per line of "
                                         "standard input (an empty line or end of input ends it); -p: the first"),
        prompt_file: Optional[Path] = typer.Option(None, "-f", "--file", help="read the prompt from this file "
                                                   "(- : standard input)"),
        n_predict: int = typer.Option(64, "-n", "--n-predict", help="tokens to generate (-1: until the end of "
                                                                      "the text or the context)"),
        temp: Optional[float] = typer.Option(None, "--temp", "--temperature", help="temperature; 0 is greedy "
                                             "(default: the model family's, ds4's: 1)"),
        top_p: Optional[float] = typer.Option(None, "--top-p", help="default: the family's (1; GLM-5.3 0.95)"),
        top_k: int = typer.Option(0, "--top-k", help="0: off"),
        min_p: Optional[float] = typer.Option(None, "--min-p", help="default: the family's (0.05; GLM-5.3 0)"),
        seed: Optional[int] = typer.Option(None, "-s", "--seed", help="default: a random one (--json prints it)"),
        mtp: MtpOpt = None, mtp_draft: MtpDraftOpt = 1, mtp_margin: MtpMarginOpt = None,
        mtp_timing: MtpTimingOpt = False, dspark: DSparkOpt = False, dspark_confidence: DSparkConfidenceOpt = None,
        dspark_strict: DSparkStrictOpt = False, draft_onnx: DraftOnnxOpt = None,
        quality: QualityOpt = False, exact_sampling: ExactOpt = False,
        verify_depth: bool = typer.Option(False, "--dspark-verify-depth", help="print the accepted-length "
                                                                                "histogram"),
        ctx: Optional[int] = CtxOpt, target: str = TargetOpt,
        as_json: bool = typer.Option(False, "--json", help="print tokens, text and speeds as JSON"),
        json_schema: Optional[str] = typer.Option(None, "-j", "--json-schema", help="the output is JSON following "
                                                  "this schema (its text, or a file holding it; '{}': any JSON); "
                                                  "needs xgrammar"),
        session: Optional[Path] = typer.Option(None, "--session", help="continue the conversation saved in this "
                                               "file (if any) without re-reading it, and save it back"),
        session_overwrite: bool = typer.Option(False, "--session-overwrite", help="start a new conversation in "
                                               "--session FILE when it holds no usable one (else: an error)"),
        threads: Optional[int] = ThreadsOpt):
    """Generate text from a prompt, optionally with speculative decoding (DSpark, MTP)."""
    _threads(threads)
    import numpy as np

    from .runtime.speculative import CostGate, generate

    _sampling(None, temp, top_p, top_k, min_p)   # bad values fail before anything loads
    seed = secrets.randbits(32) if seed is None else seed
    prompt = _prompt_text(prompt, prompt_file)
    if interactive and (tokens is not None or raw or session is not None or as_json or json_schema is not None):
        raise Ds4Error("-i/--interactive: a chat on standard input; --tokens, --raw, --session, --json and "
                       "--json-schema do not apply")
    if not interactive and (prompt is None) == (tokens is None):
        raise Ds4Error("give exactly one of -p/--prompt, -f/--file and --tokens")
    if n_predict < -1:
        raise Ds4Error(f"-n {n_predict}: expected a count >= 0, or -1 (until the end of the text or the context)")
    options = _spec_options(mtp, mtp_draft, mtp_margin, mtp_timing, dspark, dspark_confidence, dspark_strict,
                            quality, exact_sampling, draft_onnx)
    model = _model_or_embedded(model, progress=not as_json)
    engine, drafter = _speculative_engine(model, options, target, ctx, progress=not as_json)
    params = _sampling(engine, temp, top_p, top_k, min_p)
    if interactive:
        return _chat(engine, drafter, model, params, seed, n_predict, exact_sampling, prompt)
    conversation = _Session(session, engine, drafter, session_overwrite) if session is not None else None
    ids, tok = _prompt_ids(engine, model, prompt, tokens, raw, conversation)
    constraint = _json_constraint(json_schema, tok)
    cached = conversation.resume(ids) if conversation is not None else 0
    if n_predict == -1:
        n_predict = max(0, engine.max_context - len(ids))
    from .runtime.textstream import TextStream

    stream = TextStream(tok, tok.stop_ids)

    def on_token(t):
        piece = stream.push(t)
        if piece and not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    import time

    t0 = time.perf_counter()
    with _prefill_progress(len(ids), engine.chunk, enabled=not as_json) as on_prefill:
        at_prompt = []
        out, stats = generate(engine, ids, n_predict, params, np.random.default_rng(seed), drafter=drafter,
                              exact=exact_sampling, stop_ids=tok.stop_ids, on_token=on_token,
                              on_prefill=on_prefill, gate=CostGate.for_engine(engine),
                              on_prompt=None if conversation is None else lambda: at_prompt.append(engine.snapshot()),
                              constraint=constraint)
    elapsed = time.perf_counter() - t0
    tps = len(out) / stats.seconds if stats.seconds > 0 else 0.0
    prefill_s = max(elapsed - stats.seconds, 1e-9)
    rest = stream.finish()
    if conversation is not None:
        conversation.save(tok, ids, out, stream.content(), at_prompt)
    if as_json:
        info = {"tokens": out, "text": stream.content(), "seed": seed, "n_prompt": len(ids), "n_cached": cached,
                "n_generated": len(out), "prefill_tok_s": round((len(ids) - cached) / prefill_s, 2),
                "decode_tok_s": round(tps, 2)}
        if drafter is not None:
            info["spec"] = stats.as_dict()
        _echo_json(info)
        return
    sys.stdout.write(rest + "\n")
    reused = f" ({cached} continued from --session)" if cached else ""
    print(f"ds4: prompt {len(ids)} tokens{reused}, {(len(ids) - cached) / prefill_s:.1f} tok/s; generated "
          f"{len(out)} tokens, {tps:.1f} tok/s", file=sys.stderr)
    if drafter is not None:
        print(stats.line(), file=sys.stderr)
        if verify_depth:
            print("ds4: verify depth " + " ".join(f"{k}:{v}" for k, v in stats.counters["depth"].items()),
                  file=sys.stderr)


def _sampling(engine, temp, top_p, top_k: int, min_p):
    """The flags given, checked, and the model family's defaults for the others (ds4's: temperature
    1, top-p 1, min-p 0.05; GLM-5.3's top-p 0.95, min-p 0); engine None: the values given alone
    checked, before anything is loaded."""
    from .families import family_named
    from .runtime.sampler import SamplingParams

    t, p, m = family_named(engine.manifest.family).sampling if engine is not None else (1.0, 1.0, 0.05)
    return SamplingParams(t if temp is None else temp, p if top_p is None else top_p, top_k,
                          m if min_p is None else min_p).check()


def _json_constraint(schema: str | None, tok):
    """The grammar of --json-schema (runtime/grammar.py), or None."""
    if schema is None:
        return None
    from .runtime.grammar import Grammars

    text, where = schema, "--json-schema"
    if not schema.lstrip().startswith("{"):
        if not Path(schema).is_file():
            raise Ds4Error(f"--json-schema {schema}: neither a JSON schema object nor a file holding one")
        text, where = Path(schema).read_text(errors="replace"), f"--json-schema {schema}"
    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise Ds4Error(f"{where}: not JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise Ds4Error(f"{where}: expected a JSON schema object")
    return Grammars(tok).json_schema(parsed, where)


@app.command()
def serve(model: Optional[Path] = typer.Option(None, "-m", "--model", help="artifact, package or GGUF (compiled "
                                               "on first use); default: the embedded demo model"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback unless told otherwise)"),
          port: int = typer.Option(8000, "--port"),
          ctx: Optional[int] = typer.Option(None, "-c", "--ctx", "--ctx-size", help="context per request (default: the "
                                            "artifact's; 4096 when compiling a GGUF on first use)"),
          alias: Optional[str] = typer.Option(None, "--alias", help="model id clients use (default: the file name)"),
          temp: Optional[float] = typer.Option(None, "--temp", "--temperature", help="default temperature; 0 is "
                                               "greedy (default: the model family's, ds4's: 1)"),
          top_p: Optional[float] = typer.Option(None, "--top-p", help="default: the family's (1; GLM-5.3 0.95)"),
          top_k: int = typer.Option(0, "--top-k", help="0: off"),
          min_p: Optional[float] = typer.Option(None, "--min-p", help="default: the family's (0.05; GLM-5.3 0)"),
          mtp: MtpOpt = None, mtp_draft: MtpDraftOpt = 1, mtp_margin: MtpMarginOpt = None,
          mtp_timing: MtpTimingOpt = False, dspark: DSparkOpt = False, dspark_confidence: DSparkConfidenceOpt = None,
          dspark_strict: DSparkStrictOpt = False, draft_onnx: DraftOnnxOpt = None, quality: QualityOpt = False,
          exact_sampling: ExactOpt = False,
          keepalive: float = typer.Option(5.0, "--keepalive", help="seconds between SSE keep-alives"),
          slots: int = typer.Option(2, "--slots", help="conversations kept in memory; a request continues the one "
                                                       "that holds the longest prefix of its prompt"),
          kv_cache_dir: Optional[Path] = typer.Option(None, "--kv-cache-dir", help="keep state checkpoints in this "
                                                      "directory (a restarted server resumes from them)"),
          kv_cache_size: str = typer.Option("4GiB", "--kv-cache-size", help="most bytes of checkpoints kept "
                                                                             "(in memory, or in --kv-cache-dir)"),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DS4_API_KEY",
                                                help="require this key (Authorization: Bearer KEY or x-api-key)"),
          cors_origins: list[str] = typer.Option([], "--cors-origin", help="an origin whose web pages may call the "
                                                  "server (repeat for several; * for any)"),
          log_format: str = typer.Option("text", "--log-format", help="one line per request on stderr: text, json "
                                                                        "or none"),
          target: str = TargetOpt, threads: Optional[int] = ThreadsOpt):
    """OpenAI- and Anthropic-compatible HTTP server (chat/completions, completions, messages)."""
    _threads(threads)
    from .runtime.tokenizer import Tokenizer

    _sampling(None, temp, top_p, top_k, min_p)
    if not 0 < port < 65536:
        raise Ds4Error(f"--port {port}: expected 1..65535")
    if ctx is not None and ctx < 2:
        raise Ds4Error(f"--ctx {ctx}: expected at least 2 tokens")
    if keepalive <= 0:
        raise Ds4Error(f"--keepalive {keepalive}: expected seconds > 0")
    if slots < 1:
        raise Ds4Error(f"--slots {slots}: expected at least 1")
    if log_format not in ("text", "json", "none"):
        raise Ds4Error(f"--log-format {log_format!r}: expected text, json or none")
    from .runtime.checkpoint import CheckpointStore, parse_size

    cache_bytes = parse_size(kv_cache_size)
    if kv_cache_dir is not None and kv_cache_dir.exists() and not kv_cache_dir.is_dir():
        raise Ds4Error(f"--kv-cache-dir {kv_cache_dir}: not a directory")
    if api_key is not None and not api_key.strip():
        raise Ds4Error("--api-key: the key is empty")
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:  # fail before the (possibly long) model load, not after it
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as e:
            raise Ds4Error(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    options = _spec_options(mtp, mtp_draft, mtp_margin, mtp_timing, dspark, dspark_confidence, dspark_strict,
                            quality, exact_sampling, draft_onnx)
    model = _model_or_embedded(model, progress=True)
    engine, drafter = _speculative_engine(model, options, target, ctx, progress=True)
    import uvicorn

    from .families import family_named, load_attr

    from .server.api import Defaults
    from .server.app import create_app
    from .runtime.drafters import drafter_tag
    from .server.service import Service

    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=str(model))
    syntax = family_named(engine.manifest.family).tool_syntax
    try:
        store = CheckpointStore(engine, drafter_tag(drafter), cache_bytes, kv_cache_dir)
    except OSError as e:
        raise Ds4Error(f"--kv-cache-dir {kv_cache_dir}: cannot use it ({e.strerror or e})") from None
    service = Service(engine, tok, drafter, exact=exact_sampling, ctx=ctx,
                      tool_syntax=load_attr(syntax) if syntax else None, slots=slots, store=store)
    served = alias or engine.gguf.get("general.name", "str", default=None) or \
        (model.name if model.is_dir() else model.stem)
    p = _sampling(engine, temp, top_p, top_k, min_p)
    application = create_app(service, served, Defaults(p.temperature, p.top_p, p.top_k, p.min_p), keepalive=keepalive,
                             api_key=api_key, log_format=None if log_format == "none" else log_format,
                             cors_origins=tuple(cors_origins))
    if api_key is None and not _loopback(host):
        print(f"ds4 serve: warning: listening on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr, flush=True)
    print(f"ds4 serve: {served} on http://{host}:{port}/v1 (context {service.ctx}, "
          f"{drafter.NAME + ' speculative' if drafter is not None else 'target-only'} decoding)", file=sys.stderr,
          flush=True)
    uvicorn.run(application, host=host, port=port, log_level="warning")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _speculative_engine(model: Path, options, target: str, ctx: int, progress: bool):
    """The engine, and the drafter the speculation flags ask for (None: target-only decoding)."""
    from .runtime.drafters import check_support_given, choose_drafter
    from .runtime.loader import open_engine

    family = _gguf_family(model)
    target = _check_target(model, family, target)
    if family is not None:   # a GGUF, compiled on first use
        check_support_given(family, options, model)
    engine = open_engine(model, target=target, bounds=_bounds(family, ctx), progress=progress,
                         support=options.support, lean=True, heads=options.heads)
    if ctx is not None and ctx > engine.max_context:
        raise Ds4Error(f"--ctx {ctx}: {model} is compiled for a context of {engine.max_context} "
                       f"(ds4-compile --max-context)")
    return engine, choose_drafter(engine, options, model)


def _check_target(model: Path, family, target: str) -> str:
    """The target to compile a GGUF for on first use (`auto`: this machine's device): --target names
    a target, and acts (an artifact or a package keeps its own), for a device this machine has,
    checked before compiling."""
    if target in ("cpu", "auto") and family is None:
        return target
    from .compile.targets import detect, resolve

    target = detect(target)
    if target == "cpu":
        return target
    spec = resolve(target)   # an unknown name: one line listing the valid ones
    if family is None:
        raise Ds4Error(f"--target {target}: {model} is compiled already (its target is in its manifest); --target "
                       f"applies when -m is a GGUF compiled on first use")
    if spec.device == "cpu":
        return target
    from .devices import probe_device

    found = probe_device(spec.device)
    if found is None:
        raise Ds4Error(f"--target {target}: this machine has no {spec.device.upper()} device; compile for it with "
                       f"ds4-compile and run the artifact where the device is")
    if spec.arches and found[1] is not None and found[1] not in spec.arches:
        raise Ds4Error(f"--target {target}: this machine's GPU is {found[1]}")
    return target


@contextlib.contextmanager
def _prefill_progress(n: int, chunk: int, enabled: bool):
    """A progress bar (stderr, cleared when done) for prompts longer than one prefill chunk."""
    if not enabled or n <= chunk:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("prefill", total=n)

        def on_chunk(done, total):
            bar.update(task, completed=done)
            return False

        yield on_chunk


class _Session:
    """`ds4 run --session FILE`: the conversation so far (the messages, or the tokens for --raw and
    --tokens prompts) and the state after it, in one checkpoint file (runtime/checkpoint.py)."""

    def __init__(self, path: Path, engine, drafter, overwrite: bool = False):
        from .runtime.checkpoint import CheckpointError, load_state
        from .runtime.drafters import drafter_tag

        self.path, self.engine, self.tag = path, engine, drafter_tag(drafter)
        meta = {}
        if path.exists():
            try:
                meta = load_state(engine, path, self.tag)
                _check_session_meta(path, meta, engine.n_vocab)
            except CheckpointError as e:
                if not overwrite:   # a user's file (a GGUF given by mistake) is never overwritten
                    raise Ds4Error(f"--session: {e.message}; the file is left as it is (--session-overwrite "
                                   f"replaces it with a new conversation)") from None
                print(f"ds4: --session: {e.message}; starting a new conversation in its place", file=sys.stderr)
                engine.reset()
                meta = {}
        self.tokens = [int(t) for t in meta.get("tokens", [])]          # the conversation so far
        self.messages = list(meta.get("messages", []))

    def resume(self, ids: list[int]) -> int:
        from .runtime.prefix import common_prefix, resume

        held = len(self.engine.history)
        extends = common_prefix(self.engine.history, ids) == held
        cached = resume(self.engine, ids)
        if held and not extends:
            kept = f"continuing from {cached} of them" if cached else "starting fresh"
            print(f"ds4: --session {self.path}: the prompt does not extend the session's {held} tokens; {kept}",
                  file=sys.stderr)
        return cached

    def save(self, tok, ids: list[int], out: list[int], text: str, at_prompt) -> None:
        """Saves the state after the answer, or, for a chat whose template renders the answer into
        other tokens than were generated, the state after the prompt (the next turn's prefix)."""
        from .runtime.chat import chat_prompt_ids
        from .runtime.checkpoint import save_state

        meta = {"tokens": ids + out}
        if self.messages:
            meta["messages"] = self.messages + [{"role": "assistant", "content": text}]
            again = chat_prompt_ids(tok, meta["messages"], add_generation_prompt=False)
            if again[:self.engine.pos] != self.engine.history and at_prompt:
                self.engine.restore(at_prompt[0])
        try:
            save_state(self.engine, self.path, self.tag, meta)
        except OSError as e:
            raise Ds4Error(f"--session {self.path}: cannot write it ({e.strerror or e})") from None


def _chat(engine, drafter, model: Path, params, seed: int, n_predict: int, exact: bool, first: str | None) -> None:
    """`ds4 run -i`: a conversation on standard input, one user turn per line. Each turn is rendered
    with the chat template after the ones before and continues the state they left (only the new
    tokens are prefilled); a turn that does not fit the compiled context ends the chat."""
    import numpy as np

    from .runtime.chat import chat_prompt_ids
    from .runtime.checkpoint import CheckpointStore
    from .runtime.drafters import drafter_tag
    from .runtime.prefix import resume
    from .runtime.speculative import CostGate, generate
    from .runtime.textstream import TextStream
    from .runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=str(model))
    if not tok.chat_template:
        raise Ds4Error(f"{model}: has no chat template; -i needs one")
    rng, messages, text, prompting = np.random.default_rng(seed), [], first, sys.stdin.isatty()
    # the state after each prompt and each answer, in memory: the template may render an answer into
    # other tokens than were generated, and recurrent states rewind only a few positions
    store = CheckpointStore(engine, drafter_tag(drafter))
    while True:
        if text is None:
            if prompting:
                print("> ", end="", file=sys.stderr, flush=True)
            text = sys.stdin.readline().rstrip("\n")
            if not text.strip():
                return
        messages.append({"role": "user", "content": text})
        ids, text = chat_prompt_ids(tok, messages), None
        room = engine.max_context - len(ids)
        if room < 1:
            raise Ds4Error(f"the conversation ({len(ids)} tokens) fills the compiled context of {engine.max_context}")
        cached, stream = resume(engine, ids, store), TextStream(tok, tok.stop_ids)

        def on_token(t):
            sys.stdout.write(stream.push(t))
            sys.stdout.flush()

        out, _ = generate(engine, ids, room if n_predict < 0 else min(n_predict, room), params, rng, drafter=drafter,
                          exact=exact, stop_ids=tok.stop_ids, on_token=on_token, gate=CostGate.for_engine(engine),
                          on_prompt=lambda: store.add(engine.snapshot()))
        store.add(engine.snapshot())
        sys.stdout.write(stream.finish() + "\n")
        sys.stdout.flush()
        print(f"ds4: turn {len(messages) // 2 + 1}: prompt {len(ids)} tokens ({cached} continued), generated "
              f"{len(out)}", file=sys.stderr)
        messages.append({"role": "assistant", "content": stream.content()})


def _prompt_text(prompt: str | None, prompt_file: Path | None) -> str | None:
    """-p TEXT, or -f FILE (- : standard input), as llama.cpp reads a prompt."""
    if prompt_file is None:
        return prompt
    if prompt is not None:
        raise Ds4Error("give one of -p/--prompt and -f/--file")
    try:
        return sys.stdin.read() if str(prompt_file) == "-" else prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Ds4Error(f"-f {prompt_file}: cannot read it as UTF-8 text ({getattr(e, 'strerror', None) or e})") from None


def _check_session_meta(path: Path, meta: dict, n_vocab: int) -> None:
    """What `_Session.save` wrote: the tokens (ids of the vocabulary) and the chat messages."""
    from .runtime.checkpoint import CheckpointError

    tokens, messages = meta.get("tokens", []), meta.get("messages", [])
    if not (isinstance(tokens, list) and all(isinstance(t, int) and 0 <= t < n_vocab for t in tokens)
            and isinstance(messages, list)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
        raise CheckpointError(f"{path}: not a ds4 run --session conversation (its tokens or messages are malformed)")


def _prompt_ids(engine, model, prompt, tokens, raw, session: _Session | None = None):
    from .runtime.chat import chat_prompt_ids
    from .runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=str(model))
    earlier = session.tokens if session is not None else []   # a new turn follows the saved conversation
    if tokens is not None:
        ids = earlier + parse_ids(tokens, "--tokens")
    elif tok.chat_template and not raw:
        messages = (session.messages if session is not None else []) + [{"role": "user", "content": prompt}]
        ids = chat_prompt_ids(tok, messages)
        if session is not None:
            session.messages = messages
    else:
        ids = earlier + tok.encode(prompt, add_bos=None if not earlier else False)
    if not ids:
        raise Ds4Error("the prompt is empty")
    if len(ids) >= engine.max_context:
        raise Ds4Error(f"the prompt has {len(ids)} tokens; the compiled context holds {engine.max_context}")
    return ids, tok


@app.command()
def logits(model: Path = typer.Option(..., "-m", "--model", help="artifact directory or GGUF"),
           tokens: str = typer.Option(..., "--tokens", help="token ids, e.g. 1,2,3"),
           mode: str = typer.Option("prefill", "--mode", help="prefill | decode | verify"),
           out: Path = typer.Option(..., "--out", help="output .npy: float32 [tokens, vocab]"),
           ctx: Optional[int] = CtxOpt, target: str = TargetOpt):
    """Logits of every input token, from one prefill, token-by-token decode, or verify calls."""
    import numpy as np

    from .runtime.loader import open_engine

    if mode not in ("prefill", "decode", "verify"):
        raise Ds4Error(f"--mode {mode!r}: expected prefill, decode or verify")
    ids = parse_ids(tokens, "--tokens")
    if not ids:
        raise Ds4Error("--tokens: no token ids given")
    family = _gguf_family(model)
    target = _check_target(model, family, target)
    engine = open_engine(model, target=target, bounds=_bounds(family, ctx), progress=False, lean=True)
    if len(ids) > engine.max_context:
        raise Ds4Error(f"{len(ids)} tokens exceed the compiled context of {engine.max_context}")
    if mode == "prefill":
        rows = engine.prefill(ids, all_logits=True).logits
    elif mode == "decode":
        rows = np.stack([engine.decode(t).logits for t in ids])
    else:
        parts = []
        for i in range(0, len(ids), engine.max_verify):
            part = ids[i:i + engine.max_verify]
            parts.append(engine.verify(part).logits)
            engine.commit(len(part))
        rows = np.concatenate(parts)
    np.save(out, rows.astype(np.float32))
    typer.echo(f"wrote {out}: {rows.shape[0]} x {rows.shape[1]} float32 ({mode})")


@app.command()
def bench(model: Path = typer.Option(..., "-m", "--model", help="artifact directory or GGUF"),
          mtp: MtpOpt = None, mtp_draft: MtpDraftOpt = 1, mtp_margin: MtpMarginOpt = None,
          dspark: DSparkOpt = False, dspark_confidence: DSparkConfidenceOpt = None, draft_onnx: DraftOnnxOpt = None,
          prompt_len: int = typer.Option(128, "--prompt-len"),
          gen: int = typer.Option(64, "--gen"),
          verify_k: int = typer.Option(6, "--verify-k", help="measure verify(k) for k = 1..K"),
          repeats: int = typer.Option(3, "--repeats"),
          ctx: Optional[int] = CtxOpt, target: str = TargetOpt,
          as_json: bool = typer.Option(False, "--json"),
          plot_file: Optional[Path] = typer.Option(None, "--plot", help="write a PNG of verify cost vs k"),
          threads: Optional[int] = ThreadsOpt):
    """Prefill / decode speed, verify cost per k, and speculative speed with acceptance (with a
    drafter's flags: --dspark, --mtp-draft N, --draft-onnx)."""
    _threads(threads)
    from .runtime import bench as b
    for flag, v, lo in (("--prompt-len", prompt_len, 1), ("--gen", gen, 1), ("--verify-k", verify_k, 1),
                        ("--repeats", repeats, 1)):
        if v < lo:
            raise Ds4Error(f"{flag} {v}: expected a value >= {lo}")
    if verify_k > 16:
        raise Ds4Error(f"--verify-k {verify_k}: expected 1..16")
    options = _spec_options(mtp, mtp_draft, mtp_margin, False, dspark, dspark_confidence, False, False, False,
                            draft_onnx)
    engine, drafter = _speculative_engine(model, options, target, ctx, progress=not as_json)
    if prompt_len + 16 >= engine.max_context:
        raise Ds4Error(f"--prompt-len {prompt_len} leaves no room in the compiled context of {engine.max_context}")
    factory = None
    if drafter is not None:
        from .runtime.drafters import choose_drafter

        factory = lambda e: choose_drafter(e, options, model)  # noqa: E731  a fresh drafter per run
    from .runtime.tokenizer import Tokenizer

    stops = Tokenizer.from_metadata(engine.tokenizer_data, source=str(model)).stop_ids
    r = b.bench(engine, prompt_len, gen, verify_k, repeats, factory, stops)
    if plot_file is not None:
        b.plot(r, plot_file)
    if as_json:
        _echo_json(r)
    else:
        typer.echo(b.table(r))


# ---------------------------------------------------------------------------- ds4-compile
@compile_app.command()
def compile_model(model: Optional[Path] = typer.Argument(None, help="GGUF model"),
                  targets: list[str] = typer.Option(["cpu"], "--target",
                                                    help="llvm | cpu | cuda:sm_90 | cuda:sm_80,sm_90 | rocm:gfx942 | "
                                                         "metal ... ('list' shows them all; repeat with --package)"),
                  out: Optional[Path] = typer.Option(None, "-o", "--out", help="artifact directory"),
                  package: Optional[Path] = typer.Option(None, "--package",
                                                         help="write a package (a directory, or a .tar file) "
                                                              "with the weights and every --target"),
                  max_context: Optional[int] = typer.Option(None, "--max-context", help="default 4096"),
                  max_verify: Optional[int] = typer.Option(None, "--max-verify",
                                                           help="widest verify (default: the family's, 16 for "
                                                                "DeepSeek-V4)"),
                  prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", help="default 256"),
                  no_kv_rounding: bool = typer.Option(False, "--no-kv-rounding",
                                                      help="skip the FP8/FP4 round trips (for oracle comparisons)"),
                  mtp: Optional[Path] = typer.Option(None, "--mtp", "--mtp-model",
                                                     help="support GGUF of a drafter (DSpark or legacy MTP), "
                                                          "compiled into the same artifact"),
                  draft_onnx: Optional[Path] = typer.Option(None, "--draft-onnx",
                                                            help="ONNX draft heads (input hidden [n, D], optional "
                                                                 "tokens [n]; output logits [n, K, V]) compiled "
                                                                 "into the same artifact"),
                  shapes_only: bool = typer.Option(False, "--shapes-only",
                                                   help="compile --family at its published shapes and types "
                                                        "without weights (no MODEL); report time and memory"),
                  family: str = typer.Option("deepseek4", "--family", help="the family --shapes-only compiles"),
                  tune: int = typer.Option(0, "--tune", metavar="TRIALS",
                                           help="tune the static-shape linears with meta-schedule on this CPU, "
                                                "TRIALS candidates each; winners are saved to --records"),
                  records: Optional[Path] = typer.Option(None, "--records",
                                                         help="tuning database directory to apply and tune into "
                                                              "(default: ds4tvm/schedules/tuned/<target>)"),
                  int8_activations: bool = typer.Option(False, "--int8-activations",
                                                        help="CPU: quantize the inputs of the Q8_0/Q4_K/Q2_K/IQ2_XXS "
                                                             "(and on AVX2 MXFP4) linears to int8 and use "
                                                             "integer dot products (AVX-512 VNNI or AVX2; faster "
                                                             "decode; logits change by the 8-bit rounding)"),
                  report: Optional[Path] = typer.Option(None, "--report", metavar="FILE.json",
                                                        help="write, for each compiled function, the kernels a "
                                                             "call runs and the rule that scheduled each"),
                  quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
                  version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                               help="print the version and exit"),
                  force: bool = typer.Option(False, "--force", help="let -o replace a directory that holds another "
                                                                    "model's artifact or other files")):
    """Compile MODEL (and the drafter of its --mtp support file) for TARGET into an artifact directory or a
    package."""
    import shutil
    import tempfile

    from .compile.targets import listing, resolve

    if "list" in targets:
        typer.echo(listing())
        return
    if any(t in ("auto", "cuda", "rocm") for t in targets):
        from .compile.targets import detect

        targets = [detect(t) for t in targets]   # the device of this machine
    if shapes_only:
        if model is not None or package is not None or len(targets) != 1:
            raise Ds4Error("--shapes-only takes no MODEL and no --package, and one --target")
    elif model is None:
        raise Ds4Error("missing MODEL: the GGUF to compile (or --target list, or --shapes-only)")
    if any(t.startswith("cuda") for t in targets):
        from .compile.toolchains import prepare_cuda

        prepare_cuda()   # before anything imports TVM
    from .compile.driver import check_int8_activations, compile_gguf

    for t in targets:   # a bad --target fails before any work
        check_int8_activations(resolve(t), int8_activations)

    if len(targets) > 1 and package is None:
        raise Ds4Error("--target given several times: an artifact directory holds one target; "
                       "use --package for several")
    if package is not None and out is not None:
        raise Ds4Error("give either -o/--out (an artifact directory) or --package, not both")
    if report is not None and package is not None:
        raise Ds4Error("--report describes one target's compile: use it with -o/--out or --shapes-only, not --package")
    if report is not None and (report.is_dir() or not report.parent.is_dir()):
        raise Ds4Error(f"--report {report}: expected a file path in an existing directory")
    from .families import family_named

    fam = family_named(family) if shapes_only else _gguf_family(model)
    bounds = _bounds(fam, max_context, max_verify, prefill_chunk)
    if not 0 <= tune <= 100000:
        raise Ds4Error(f"--tune {tune}: expected a number of trials per kernel, 0..100000")
    if records is not None and records.exists() and not records.is_dir():
        raise Ds4Error(f"--records {records}: not a directory")
    if shapes_only:
        from .compile.driver import compile_shapes

        out = out or Path(f"{fam.name}-shapes-{resolve(targets[0]).name}")
        _echo_json(compile_shapes(family, targets[0], bounds, out, progress=not quiet,
                                  int8_activations=int8_activations, report=report))
        return
    if package is None:
        out = out or Path(f"{model.stem}-{resolve(targets[0]).name}.ds4tvm")
        _check_out_dir(out, model, force)
        compile_gguf(model, targets[0], out, bounds, kv_rounding=not no_kv_rounding, progress=not quiet,
                     support=mtp, tune_trials=tune, records=records, draft_onnx=draft_onnx,
                     int8_activations=int8_activations, report=report)
        if tune:
            for line in json.loads((out / "manifest.json").read_text())["extra"]["tuning"]:
                typer.echo(json.dumps(line))
        typer.echo(f"wrote {out}")
        return
    from .package import build_package

    work = Path(tempfile.mkdtemp(prefix=".ds4-package-", dir=package.resolve().parent))
    try:
        arts = [compile_gguf(model, t, work / str(i), bounds, kv_rounding=not no_kv_rounding, progress=not quiet,
                             support=mtp, tune_trials=tune, records=records, draft_onnx=draft_onnx,
                             int8_activations=int8_activations)
                for i, t in enumerate(targets)]
        build_package(arts, package)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    typer.echo(f"wrote {package}")


def _check_out_dir(out: Path, model: Path, force: bool) -> None:
    """-o DIR: new, empty, or an artifact of this same GGUF (compiled again in place); another
    model's artifact or a folder of other files is refused unless --force."""
    from .artifact import MANIFEST, MODEL, same_file

    if force or not out.exists():
        return
    if not out.is_dir():
        raise Ds4Error(f"-o {out}: exists and is not a directory")
    if not any(out.iterdir()):
        return
    try:
        ident = json.loads((out / MANIFEST).read_text())["weights"][MODEL]
        if Path(ident["gguf_path"]).resolve() == model.resolve() and same_file(model, ident):
            return
        what = f"the artifact of another model file ({ident['gguf_path']})"
    except (OSError, ValueError, KeyError, TypeError):
        what = "files that are not an artifact of this model"
    raise Ds4Error(f"-o {out}: holds {what}; choose another directory, or pass --force to replace it")


def _run(typer_app, prog: str) -> None:
    """Runs a command; bad input of any kind (click's usage errors included, which typer would draw
    as a box of several lines) is one line on stderr and exit 2."""
    from typer._click import exceptions as click   # typer (pinned) carries its own click

    try:
        code = typer_app(standalone_mode=False, prog_name=prog)
    except click.NoArgsIsHelpError as e:
        print(e.format_message(), file=sys.stderr)
        sys.exit(2)
    except click.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        print(f"ds4: error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(2)
    except click.ClickException as e:
        print(f"ds4: error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("ds4: interrupted", file=sys.stderr)
        sys.exit(130)
    except Ds4Error as e:
        print(f"ds4: error: {e.message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("ds4: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _bare_flags(argv: list[str]) -> list[str]:
    """`--mtp` with no file (the next word is a flag, or nothing) selects the draft layer inside the
    model GGUF, as in ds4, and a bare `--draft-onnx` the heads compiled into the artifact; click's
    options need a value, so they become `--mtp=` and `--draft-onnx=`."""
    return [(a + "=" if a in ("--mtp", "--draft-onnx") and (i + 1 == len(argv) or argv[i + 1].startswith("-"))
             else a) for i, a in enumerate(argv)]


def main() -> None:
    # `ds4 -m MODEL -p PROMPT` (no subcommand) is `ds4 run`, as in the reference engine's command lines.
    if len(sys.argv) > 1 and sys.argv[1].startswith("-") and sys.argv[1] not in ("--help", "-h", "--version"):
        sys.argv.insert(1, "run")
    sys.argv[1:] = _bare_flags(sys.argv[1:])
    _run(app, "ds4")


def compile_main() -> None:
    _run(compile_app, "ds4-compile")


if __name__ == "__main__":
    main()
