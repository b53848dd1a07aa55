"""Command line: `ds4` (inspect, tokenize, detokenize, convert, demo, run, serve, ...) and `ds4-compile`,
one module per command group (files, generate, serve, compiler; what they share in common).

TVM is never imported at module level: `ds4 --help` and the GGUF tools stay fast and work with a
runtime-only TVM install.
"""

from __future__ import annotations

import sys

import typer

from ..errors import Ds4Error
from ..runtime.loader import without_torch
from . import compiler, files, generate, serve  # noqa: F401 - each registers its commands
from .common import app, compile_app

__all__ = ["app", "compile_app", "main", "compile_main"]


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
    without_torch()
    # `ds4 -m MODEL -p PROMPT` (no subcommand) is `ds4 run`, as in the reference engine's command lines.
    if len(sys.argv) > 1 and sys.argv[1].startswith("-") and sys.argv[1] not in ("--help", "-h", "--version"):
        sys.argv.insert(1, "run")
    sys.argv[1:] = _bare_flags(sys.argv[1:])
    _run(app, "ds4")


def compile_main() -> None:
    without_torch()
    _run(compile_app, "ds4-compile")
