"""`ds4 serve`: the flags of the HTTP server; the service and its routes are server/'s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import Ds4Error
from .common import (
    DSparkConfidenceOpt, DSparkOpt, DSparkStrictOpt, DraftOnnxOpt, ExactOpt, MtpDraftOpt, MtpMarginOpt, MtpOpt,
    MtpTimingOpt, QualityOpt, TargetOpt, ThreadsOpt, model_or_embedded, sampling_params, spec_options,
    speculative_engine, set_threads, app)


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
          parallel: int = typer.Option(4, "--parallel", "-np", help="requests generated at once, their decode "
                                                                   "steps batched in one call (a GGUF compiled on first "
                                                                   "use gets batched functions of up to this many)"),
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
    set_threads(threads)
    sampling_params(None, temp, top_p, top_k, min_p)
    cache_bytes = _check_flags(port, ctx, keepalive, slots, log_format, kv_cache_size, kv_cache_dir, api_key)
    if not 1 <= parallel <= 64:
        raise Ds4Error(f"--parallel {parallel}: expected 1..64")
    _check_listen(host, port)
    options = spec_options(mtp, mtp_draft, mtp_margin, mtp_timing, dspark, dspark_confidence, dspark_strict,
                           quality, exact_sampling, draft_onnx)
    model = model_or_embedded(model, progress=True)
    engine, drafter, cost_model = speculative_engine(model, options, target, ctx, progress=True, batch=parallel)
    import uvicorn

    from ..server.api import Defaults
    from ..server.app import create_app
    from ..server.service import build_service

    from ..runtime.drafters import choose_drafter

    service = build_service(engine, drafter, cost_model, str(model), exact_sampling, ctx, slots, cache_bytes,
                            kv_cache_dir, parallel, lambda: choose_drafter(engine, options, model))
    served = alias or engine.gguf.get("general.name", "str", default=None) or \
        (model.name if model.is_dir() else model.stem)
    p = sampling_params(engine, temp, top_p, top_k, min_p)
    application = create_app(service, served, Defaults(p.temperature, p.top_p, p.top_k, p.min_p), keepalive=keepalive,
                             api_key=api_key, log_format=None if log_format == "none" else log_format,
                             cors_origins=tuple(cors_origins))
    if api_key is None and not _loopback(host):
        print(f"ds4 serve: warning: listening on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr, flush=True)
    batched = (f"decode batched up to {min(parallel, engine.max_batch)}" if engine.max_batch > 1 and parallel > 1
               else "decode steps one by one: compiled without batched functions (ds4-compile --max-batch)"
               if parallel > 1 else "one at a time")
    print(f"ds4 serve: {served} on http://{host}:{port}/v1 (context {service.ctx}, "
          f"{drafter.NAME + ' speculative' if drafter is not None else 'target-only'} decoding; "
          f"{parallel} requests at once, {batched})", file=sys.stderr, flush=True)
    uvicorn.run(application, host=host, port=port, log_level="warning")


def _check_flags(port: int, ctx, keepalive: float, slots: int, log_format: str, kv_cache_size: str, kv_cache_dir,
                 api_key) -> int:
    """The server's flags checked before the (possibly long) model load; the checkpoint budget in bytes."""
    from ..runtime.checkpoint import parse_size

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
    cache_bytes = parse_size(kv_cache_size)
    if kv_cache_dir is not None and kv_cache_dir.exists() and not kv_cache_dir.is_dir():
        raise Ds4Error(f"--kv-cache-dir {kv_cache_dir}: not a directory")
    if api_key is not None and not api_key.strip():
        raise Ds4Error("--api-key: the key is empty")
    return cache_bytes


def _check_listen(host: str, port: int) -> None:
    """Fails before the model load, not after it, when the address cannot be listened on."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as e:
            raise Ds4Error(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
