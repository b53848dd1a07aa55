"""What the commands share: the two Typer apps, and the options that several commands read the same
way (bounds, threads, the target, the speculation and sampling flags, the engine they open)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import Ds4Error


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="ds4tvm: run DS4-family models compiled with Apache TVM.")


compile_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                          help="Compile a GGUF model into a TVM artifact.")


def print_version(value: bool) -> None:
    if value:
        from .. import __version__
        from ..runtime.loader import tvm_version

        typer.echo(f"ds4tvm {__version__} (apache-tvm {tvm_version()})")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                          help="print the version and exit")):
    """ds4tvm: run DS4-family models compiled with Apache TVM."""


def echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def parse_ids(text: str, flag: str = "IDS") -> list[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise Ds4Error(f"{flag}: expected token ids separated by commas or spaces, got {text!r}") from None


def model_or_embedded(model: Path | None, progress: bool) -> Path:
    """MODEL, or (none given) the embedded code model's artifact, compiled with its DSpark support
    file on first use, so that --dspark speculates with that drafter."""
    if model is not None:
        return model
    from ..demo import TARGET_FILE, embedded_artifact

    art = embedded_artifact(progress=progress)
    print(f"ds4: no -m given: using the embedded demo model {TARGET_FILE} and its DSpark drafter ({art})",
          file=sys.stderr, flush=True)
    return art


# ---------------------------------------------------------------------------- run / logits
def set_threads(n: int | None) -> None:
    """The CPU thread pool's size, set before TVM starts it (TVM reads TVM_NUM_THREADS once; the
    engine defaults it to every core, or one for a model under 64 MB)."""
    if n is None:
        return
    if n < 1:
        raise Ds4Error(f"--threads {n}: expected at least 1")
    os.environ["TVM_NUM_THREADS"] = str(n)


def gguf_family(model: Path | None):
    """The family of a GGUF given as MODEL (None for artifacts, packages and missing paths)."""
    if model is None or not model.is_file() or model.suffix == ".tar":
        return None
    from ..families import family_for
    from ..gguf import open_gguf

    return family_for(open_gguf(model))


def bounds_for(family, max_context: int | None = None, max_verify: int | None = None,
               prefill_chunk: int | None = None, max_batch: int | None = None):
    """The bounds to compile with: what the flags say, the rest as the family prefers (a recurrent
    family keeps max_verify small). Artifacts and packages keep theirs (family None)."""
    from dataclasses import replace

    from ..artifact import Bounds

    default = family.default_bounds if family is not None else Bounds()
    given = {"max_context": max_context, "max_verify": max_verify, "prefill_chunk": prefill_chunk,
             "max_batch": max_batch}
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


def spec_options(mtp, mtp_draft, mtp_margin, mtp_timing, dspark, dspark_confidence, dspark_strict, quality,
                  exact_sampling, draft_onnx=None):
    from ..runtime.drafters import SpecOptions

    if mtp is not None and mtp != "" and not Path(mtp).exists():
        raise Ds4Error(f"--mtp {mtp}: no such support file")
    if draft_onnx and not Path(draft_onnx).is_file():
        raise Ds4Error(f"--draft-onnx {draft_onnx}: no such ONNX file")
    return SpecOptions(mtp=mtp, mtp_draft=mtp_draft, mtp_margin=mtp_margin, mtp_timing=mtp_timing, dspark=dspark,
                       dspark_confidence=dspark_confidence, dspark_strict=dspark_strict,
                       exact_sampling=exact_sampling, quality=quality, draft_onnx=draft_onnx)


def speculative_engine(model: Path, options, target: str, ctx: int, progress: bool, batch: int = 1):
    """The engine, the drafter the speculation flags ask for (None: target-only decoding) and the
    cost model that says when to ask it (runtime/costs.py; measured here, before any prompt). batch:
    sequences one call decodes, where a GGUF is compiled on first use by a family that batches."""
    from ..runtime.costs import model_for
    from ..runtime.drafters import check_support_given, choose_drafter
    from ..runtime.loader import open_engine

    family = gguf_family(model)
    target = check_target(model, family, target)
    if family is not None:   # a GGUF, compiled on first use
        check_support_given(family, options, model)
    batch = batch if family is not None and family.batches else None
    engine = open_engine(model, target=target, bounds=bounds_for(family, ctx, max_batch=batch), progress=progress,
                         support=options.support, lean=True, heads=options.heads)
    if ctx is not None and ctx > engine.max_context:
        raise Ds4Error(f"--ctx {ctx}: {model} is compiled for a context of {engine.max_context} "
                       f"(ds4-compile --max-context)")
    drafter = choose_drafter(engine, options, model)
    return engine, drafter, model_for(engine, drafter, lambda: choose_drafter(engine, options, model))


def check_target(model: Path, family, target: str) -> str:
    """The target to compile a GGUF for on first use (`auto`: this machine's device): --target names
    a target, and acts (an artifact or a package keeps its own), for a device this machine has,
    checked before compiling."""
    if target in ("cpu", "auto") and family is None:
        return target
    from ..compile.targets import detect, resolve

    target = detect(target)
    if target == "cpu":
        return target
    spec = resolve(target)   # an unknown name: one line listing the valid ones
    if family is None:
        raise Ds4Error(f"--target {target}: {model} is compiled already (its target is in its manifest); --target "
                       f"applies when -m is a GGUF compiled on first use")
    if spec.device == "cpu":
        return target
    from ..devices import probe_device

    found = probe_device(spec.device)
    if found is None:
        raise Ds4Error(f"--target {target}: this machine has no {spec.device.upper()} device; compile for it with "
                       f"ds4-compile and run the artifact where the device is")
    if spec.arches and found[1] is not None and found[1] not in spec.arches:
        raise Ds4Error(f"--target {target}: this machine's GPU is {found[1]}")
    return target


def sampling_params(engine, temp, top_p, top_k: int, min_p):
    """The flags given, checked, and the model family's defaults for the others (ds4's: temperature
    1, top-p 1, min-p 0.05; GLM-5.3's top-p 0.95, min-p 0); engine None: the values given alone
    checked, before anything is loaded."""
    from ..families import family_named
    from ..runtime.sampler import SamplingParams

    t, p, m = family_named(engine.manifest.family).sampling if engine is not None else (1.0, 1.0, 0.05)
    return SamplingParams(t if temp is None else temp, p if top_p is None else top_p, top_k,
                          m if min_p is None else min_p).check()
