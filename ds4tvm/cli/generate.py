"""`ds4 run` (one prompt, a session, or a chat on standard input), `logits`, `bench` and `demo`."""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ..errors import Ds4Error

if TYPE_CHECKING:
    from ..runtime.session import Session
from .common import (
    CtxOpt, DSparkConfidenceOpt, DSparkOpt, DSparkStrictOpt, DraftOnnxOpt, ExactOpt, MtpDraftOpt, MtpMarginOpt, MtpOpt,
    MtpTimingOpt, QualityOpt, TargetOpt, ThreadsOpt, bounds_for, check_target, echo_json, gguf_family,
    model_or_embedded, sampling_params, spec_options, speculative_engine, set_threads, app, parse_ids)


# ---------------------------------------------------------------------------- demo
@app.command()
def demo(out_dir: Optional[Path] = typer.Option(None, "--dir", help="where the embedded model's artifact is "
                                                 "compiled (default: the ds4tvm cache)")):
    """Complete a Python prompt with the embedded code model, target-only and with DSpark."""
    from ..demo import run_demo

    run_demo(out_dir)


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
    set_threads(threads)
    import time

    sampling_params(None, temp, top_p, top_k, min_p)   # bad values fail before anything loads
    seed = secrets.randbits(32) if seed is None else seed
    prompt = _prompt_text(prompt, prompt_file)
    if interactive and (tokens is not None or raw or session is not None or as_json or json_schema is not None):
        raise Ds4Error("-i/--interactive: a chat on standard input; --tokens, --raw, --session, --json and "
                       "--json-schema do not apply")
    if not interactive and (prompt is None) == (tokens is None):
        raise Ds4Error("give exactly one of -p/--prompt, -f/--file and --tokens")
    if n_predict < -1:
        raise Ds4Error(f"-n {n_predict}: expected a count >= 0, or -1 (until the end of the text or the context)")
    options = spec_options(mtp, mtp_draft, mtp_margin, mtp_timing, dspark, dspark_confidence, dspark_strict,
                            quality, exact_sampling, draft_onnx)
    model = model_or_embedded(model, progress=not as_json)
    engine, drafter, cost_model = speculative_engine(model, options, target, ctx, progress=not as_json)
    params = sampling_params(engine, temp, top_p, top_k, min_p)
    if interactive:
        return _chat(engine, drafter, cost_model, model, params, seed, n_predict, exact_sampling, prompt)
    from ..runtime.session import Session

    conversation = Session(session, engine, drafter, session_overwrite) if session is not None else None
    ids, tok = _prompt_ids(engine, model, prompt, tokens, raw, conversation)
    constraint = _json_constraint(json_schema, tok)
    cached = conversation.resume(ids) if conversation is not None else 0
    if n_predict == -1:
        n_predict = max(0, engine.max_context - len(ids))
    from ..runtime.textstream import TextStream

    stream, at_prompt = TextStream(tok, tok.stop_ids), []
    t0 = time.perf_counter()
    out, stats = _generate_streaming(engine, drafter, cost_model, ids, n_predict, params, seed, exact_sampling,
                                     constraint, stream, as_json, at_prompt if conversation is not None else None)
    prefill_s = max(time.perf_counter() - t0 - stats.seconds, 1e-9)
    rest = stream.finish()
    if conversation is not None:
        conversation.save(tok, ids, out, stream.content(), at_prompt)
    if as_json:
        echo_json({"tokens": out, "text": stream.content(), "seed": seed, "n_prompt": len(ids), "n_cached": cached,
                   "n_generated": len(out), "prefill_tok_s": round((len(ids) - cached) / prefill_s, 2),
                   "decode_tok_s": round(len(out) / stats.seconds if stats.seconds > 0 else 0.0, 2),
                   **({"spec": stats.as_dict()} if drafter is not None else {})})
        return
    sys.stdout.write(rest + "\n")
    _report(len(ids), cached, prefill_s, len(out), stats, drafter is not None, verify_depth)


def _generate_streaming(engine, drafter, cost_model, ids, n_predict: int, params, seed: int, exact: bool, constraint, stream,
                        quiet: bool, at_prompt: list | None):
    """generate()'s (tokens, stats), each piece of text written to standard output as it is decoded
    (not when quiet), with a prefill bar for long prompts; at_prompt, given, gets the snapshot
    taken after the prompt."""
    import numpy as np

    from ..runtime.speculative import generate

    def on_token(t):
        piece = stream.push(t)
        if piece and not quiet:
            sys.stdout.write(piece)
            sys.stdout.flush()

    with _prefill_progress(len(ids), engine.chunk, enabled=not quiet) as on_prefill:
        return generate(engine, ids, n_predict, params, np.random.default_rng(seed), drafter=drafter, exact=exact,
                        stop_ids=stream.tok.stop_ids, on_token=on_token, on_prefill=on_prefill,
                        model=cost_model, constraint=constraint,
                        on_prompt=None if at_prompt is None else lambda: at_prompt.append(engine.snapshot()))


def _report(n_prompt: int, cached: int, prefill_s: float, n_out: int, stats, speculative: bool,
            verify_depth: bool) -> None:
    tps = n_out / stats.seconds if stats.seconds > 0 else 0.0
    reused = f" ({cached} continued from --session)" if cached else ""
    print(f"ds4: prompt {n_prompt} tokens{reused}, {(n_prompt - cached) / prefill_s:.1f} tok/s; generated "
          f"{n_out} tokens, {tps:.1f} tok/s", file=sys.stderr)
    if speculative:
        print(stats.line(), file=sys.stderr)
        if verify_depth:
            print("ds4: verify depth " + " ".join(f"{k}:{v}" for k, v in stats.counters["depth"].items()),
                  file=sys.stderr)


def _json_constraint(schema: str | None, tok):
    """The grammar of --json-schema (runtime/grammar.py), or None."""
    if schema is None:
        return None
    from ..runtime.grammar import Grammars

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


def _chat(engine, drafter, cost_model, model: Path, params, seed: int, n_predict: int, exact: bool, first: str | None) -> None:
    """`ds4 run -i`: a conversation on standard input, one user turn per line. Each turn is rendered
    with the chat template after the ones before and continues the state they left (only the new
    tokens are prefilled); a turn that does not fit the compiled context ends the chat."""
    import numpy as np

    from ..runtime.chat import chat_prompt_ids
    from ..runtime.checkpoint import CheckpointStore
    from ..runtime.drafters import drafter_tag
    from ..runtime.prefix import resume
    from ..runtime.speculative import generate
    from ..runtime.textstream import TextStream
    from ..runtime.tokenizer import Tokenizer

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
                          exact=exact, stop_ids=tok.stop_ids, on_token=on_token, model=cost_model,
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


def _prompt_ids(engine, model, prompt, tokens, raw, session: "Session | None" = None):
    from ..runtime.chat import chat_prompt_ids
    from ..runtime.tokenizer import Tokenizer

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

    from ..runtime.loader import open_engine

    if mode not in ("prefill", "decode", "verify"):
        raise Ds4Error(f"--mode {mode!r}: expected prefill, decode or verify")
    ids = parse_ids(tokens, "--tokens")
    if not ids:
        raise Ds4Error("--tokens: no token ids given")
    family = gguf_family(model)
    target = check_target(model, family, target)
    engine = open_engine(model, target=target, bounds=bounds_for(family, ctx), progress=False, lean=True)
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
          concurrency: int = typer.Option(1, "--concurrency", help="also run N greedy generations at once "
                                          "(their decode steps batched; with a drafter, their verify blocks "
                                          "too) against one alone"),
          ctx: Optional[int] = CtxOpt, target: str = TargetOpt,
          as_json: bool = typer.Option(False, "--json"),
          plot_file: Optional[Path] = typer.Option(None, "--plot", help="write a PNG of verify cost vs k"),
          threads: Optional[int] = ThreadsOpt):
    """Prefill / decode speed, verify cost per k, and speculative speed with acceptance (with a
    drafter's flags: --dspark, --mtp-draft N, --draft-onnx)."""
    set_threads(threads)
    from ..runtime import bench as b
    for flag, v, lo in (("--prompt-len", prompt_len, 1), ("--gen", gen, 1), ("--verify-k", verify_k, 1),
                        ("--repeats", repeats, 1), ("--concurrency", concurrency, 1)):
        if v < lo:
            raise Ds4Error(f"{flag} {v}: expected a value >= {lo}")
    if verify_k > 16:
        raise Ds4Error(f"--verify-k {verify_k}: expected 1..16")
    options = spec_options(mtp, mtp_draft, mtp_margin, False, dspark, dspark_confidence, False, False, False,
                            draft_onnx)
    engine, drafter, _ = speculative_engine(model, options, target, ctx, progress=not as_json, batch=concurrency)
    if prompt_len + 16 >= engine.max_context:
        raise Ds4Error(f"--prompt-len {prompt_len} leaves no room in the compiled context of {engine.max_context}")
    factory = None
    if drafter is not None:
        from ..runtime.drafters import choose_drafter

        factory = lambda e: choose_drafter(e, options, model)  # noqa: E731  a fresh drafter per run
    from ..runtime.tokenizer import Tokenizer

    stops = Tokenizer.from_metadata(engine.tokenizer_data, source=str(model)).stop_ids
    r = b.bench(engine, prompt_len, gen, verify_k, repeats, factory, stops)
    if concurrency > 1:
        r["concurrency"] = b.concurrency(engine, concurrency, prompt_len, gen, repeats, stops, factory)
    if plot_file is not None:
        b.plot(r, plot_file)
    if as_json:
        echo_json(r)
    else:
        typer.echo(b.table(r))
