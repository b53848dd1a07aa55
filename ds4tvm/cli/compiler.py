"""`ds4-compile`: its flags, checked before anything is compiled (compile/driver.py compiles)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import Ds4Error
from .common import bounds_for, echo_json, gguf_family, print_version, compile_app


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
                  max_batch: Optional[int] = typer.Option(None, "--max-batch",
                                                          help="most sequences one call decodes (ds4 serve "
                                                               "--parallel; default 1: none batched)"),
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
                  int8_activations: Optional[bool] = typer.Option(
                      None, "--int8-activations/--float-activations",
                      help="CPU: quantize the inputs of the Q8_0/Q4_K/Q2_K/IQ2_XXS (and on AVX2 MXFP4) linears "
                           "to int8 and use integer dot products (AVX-512 VNNI or AVX2; the default on CPUs that "
                           "have one: faster, logits within the 8-bit rounding), or keep them float32 (logits as "
                           "transformers computes them, to ~1e-5)"),
                  report: Optional[Path] = typer.Option(None, "--report", metavar="FILE.json",
                                                        help="write, for each compiled function, the kernels a "
                                                             "call runs and the rule that scheduled each"),
                  quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
                  version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                               help="print the version and exit"),
                  force: bool = typer.Option(False, "--force", help="let -o replace a directory that holds another "
                                                                    "model's artifact or other files")):
    """Compile MODEL (and the drafter of its --mtp support file) for TARGET into an artifact directory or a
    package."""
    from ..compile.driver import CompileRequest
    from ..compile.targets import listing

    if "list" in targets:
        typer.echo(listing())
        return
    targets = _check_targets(targets, model, package, out, report, shapes_only, int8_activations)
    from ..families import family_named

    fam = family_named(family) if shapes_only else gguf_family(model)
    bounds = bounds_for(fam, max_context, max_verify, prefill_chunk, max_batch)
    if not 0 <= tune <= 100000:
        raise Ds4Error(f"--tune {tune}: expected a number of trials per kernel, 0..100000")
    if records is not None and records.exists() and not records.is_dir():
        raise Ds4Error(f"--records {records}: not a directory")
    req = CompileRequest(targets[0], bounds, kv_rounding=not no_kv_rounding, progress=not quiet, support=mtp,
                         tune_trials=tune, records=records, draft_onnx=draft_onnx, int8_activations=int8_activations,
                         report=report)
    if shapes_only:
        _compile_shapes(fam, out, req)
    elif package is None:
        _compile_artifact(model, out, req, force)
    else:
        _compile_package(model, package, targets, req)


def _check_targets(targets: list[str], model, package, out, report, shapes_only: bool, int8_activations: bool | None):
    """The --target values (`auto`, `cuda`, `rocm`: this machine's device) checked with the flags they
    go with, before any work; CUDA's toolchain set up before anything imports TVM."""
    if any(t in ("auto", "cuda", "rocm") for t in targets):
        from ..compile.targets import detect

        targets = [detect(t) for t in targets]
    if shapes_only:
        if model is not None or package is not None or len(targets) != 1:
            raise Ds4Error("--shapes-only takes no MODEL and no --package, and one --target")
    elif model is None:
        raise Ds4Error("missing MODEL: the GGUF to compile (or --target list, or --shapes-only)")
    if any(t.startswith("cuda") for t in targets):
        from ..compile.toolchains import prepare_cuda

        prepare_cuda()
    from ..compile.driver import check_int8_activations
    from ..compile.targets import resolve

    for t in targets:
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
    return targets


def _compile_shapes(fam, out: Path | None, req) -> None:
    from ..compile.driver import compile_shapes
    from ..compile.targets import resolve

    out = out or Path(f"{fam.name}-shapes-{resolve(req.target).name}")
    echo_json(compile_shapes(fam.name, out, req))


def _compile_artifact(model: Path, out: Path | None, req, force: bool) -> None:
    from ..compile.driver import compile_gguf
    from ..compile.targets import resolve

    out = out or Path(f"{model.stem}-{resolve(req.target).name}.ds4tvm")
    _check_out_dir(out, model, force)
    compile_gguf(model, out, req)
    if req.tune_trials:
        for line in json.loads((out / "manifest.json").read_text())["extra"]["tuning"]:
            typer.echo(json.dumps(line))
    typer.echo(f"wrote {out}")


def _compile_package(model: Path, package: Path, targets: list[str], req) -> None:
    """Every target's artifact compiled next to the package, then packed with the weights."""
    import shutil
    import tempfile
    from dataclasses import replace

    from ..compile.driver import compile_gguf
    from ..package import build_package

    work = Path(tempfile.mkdtemp(prefix=".ds4-package-", dir=package.resolve().parent))
    try:
        arts = [compile_gguf(model, work / str(i), replace(req, target=t)) for i, t in enumerate(targets)]
        build_package(arts, package)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    typer.echo(f"wrote {package}")


def _check_out_dir(out: Path, model: Path, force: bool) -> None:
    """-o DIR: new, empty, or an artifact of this same GGUF (compiled again in place); another
    model's artifact or a folder of other files is refused unless --force."""
    from ..artifact import MANIFEST, MODEL, same_file

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
