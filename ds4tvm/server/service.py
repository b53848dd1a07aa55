"""The generation service behind `ds4 serve`: one engine, one worker thread, a FIFO of jobs.

One generation runs at a time; requests queue in arrival order. The engine's state is kept in
`slots` (engine sequences, each with its committed tokens): a job goes to the slot that can
continue the longest prefix of its prompt by itself (ties: the least recently used) and continues
from there, or from the best checkpoint when it holds more (one is taken after every prompt's
prefill and every answer), instead of prefilling from zero (runtime/prefix.py); its result says how
many prompt tokens were reused.
A job reports to its request through a callback (`send`) that the HTTP side turns into SSE events
or one JSON body; a job whose client went away is skipped if still queued, and stopped after its
current token if running.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from ..errors import Cancelled, Ds4Error
from ..runtime.checkpoint import CheckpointStore
from ..runtime.drafters import drafter_tag
from ..runtime.grammar import Grammars
from ..runtime.prefix import resume, reusable
from ..runtime.sampler import SamplingParams
from ..runtime.speculative import generate
from ..runtime.textstream import TextStream

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: bool = False                  # tool definitions were given: parse calls, greedy inside them
    constraint: object = None            # a grammar the output follows (runtime/grammar.Constraint)
    logprobs: int | None = None          # report log-probabilities, with this many top alternatives
    send: object = None                  # send(kind, payload): kind is "text", "done" or "error"
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Result:
    content: str
    tool_calls: list[dict]
    finish_reason: str                   # "stop", "length" or "tool_calls"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: dict | None = None
    seconds: float = 0.0
    cached_tokens: int = 0               # prompt tokens continued from a slot or checkpoint, not prefilled
    logprobs: list | None = None         # per generated token: (id, logprob, [(id, logprob) of the top ones])


@dataclass
class Slot:
    seq: object                          # an engine sequence (Engine.new_sequence)
    used: float = 0.0                    # when a job last ran on it (monotonic clock)


def token_logprobs(t: int, row: np.ndarray, top: int) -> tuple:
    """(t, its log-probability, the top alternatives) under the model's distribution: the raw
    logits row, before temperature, filters and grammar (what vLLM reports by default)."""
    x = row.reshape(-1).astype(np.float64)
    lp = x - x.max()
    lp -= np.log(np.exp(lp).sum())
    # the top ones as a stable sort of the whole row gives them (ties: lower ids), sorting only the
    # candidates at or above the top-th value: a full sort cost ~10 ms per token at 150k tokens
    k = min(top, lp.size)
    cut = np.partition(lp, -k)[-k] if k else np.inf
    candidates = np.flatnonzero(lp >= cut)
    best = candidates[np.argsort(-lp[candidates], kind="stable")][:top]
    return t, float(lp[t]), [(int(i), float(lp[i])) for i in best]


class Service:
    def __init__(self, engine, tokenizer, drafter=None, exact: bool = False, ctx: int | None = None,
                 tool_syntax=None, slots: int = 2, store: CheckpointStore | None = None, model=None):
        """model: the drafter's cost model (runtime/costs.py; None: asked every cycle). tool_syntax: the class of the model family's tool-call syntax (families.Family.tool_syntax);
        None: tool definitions are rendered into the prompt, replies are not parsed for calls.
        slots: sequences kept in memory; store: where checkpoints go (default: in memory)."""
        self.engine, self.tok, self.drafter, self.exact, self.model = engine, tokenizer, drafter, exact, model
        self.grammars = Grammars(tokenizer)
        self.tool_syntax = tool_syntax
        self.slots = [Slot(engine.seq)] + [Slot(engine.new_sequence()) for _ in range(slots - 1)]
        self.store = store if store is not None else CheckpointStore(engine, drafter_tag(drafter))
        self.ctx = min(ctx or engine.max_context, engine.max_context)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.busy = threading.Lock()   # held while a job runs (tests and /health read it)
        self._thread = threading.Thread(target=self._work, name="ds4-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            with self.busy:
                try:
                    job.send("done", self.run(job))
                except Cancelled:
                    job.send("error", (499, "the client went away"))
                except Ds4Error as e:
                    job.send("error", (400, e.message))
                except Exception as e:  # keep serving: the request gets a 500, the log the trace
                    traceback.print_exc()
                    job.send("error", (500, f"{type(e).__name__}: {e}"))

    def run(self, job: Job) -> Result:
        """Generates for one job on this thread; text pieces go to job.send as they become final."""
        tools = self.tool_syntax() if job.tools and self.tool_syntax is not None else None
        stream = TextStream(self.tok, self.tok.stop_ids, job.stop, tools)

        def on_token(t: int) -> bool:
            piece = stream.push(t)
            if piece:
                job.send("text", piece)
            # a closed tool-call block ends the turn: the client runs the tools
            return stream.stopped or job.cancelled.is_set() or (tools is not None and tools.closed_block(stream.text))

        def mode(out):  # structured (greedy) decoding inside a tool-call block
            return GREEDY if stream.in_tool_call else job.params

        chosen = [] if job.logprobs is not None else None

        def on_choice(t: int, row: np.ndarray) -> None:
            chosen.append(token_logprobs(t, row, job.logprobs))

        t0 = time.perf_counter()
        cached, after_prompt = self._resume(job.prompt), []
        try:
            out, stats = generate(self.engine, job.prompt, job.max_tokens, job.params,
                                  np.random.default_rng(job.seed), drafter=self.drafter, exact=self.exact,
                                  stop_ids=self.tok.stop_ids, on_token=on_token,
                                  mode=mode if tools is not None else None,
                                  on_prefill=lambda done, total: job.cancelled.is_set(),
                                  model=self.model,
                                  on_prompt=lambda: after_prompt.append(self.engine.snapshot()),
                                  constraint=job.constraint, on_choice=None if chosen is None else on_choice)
        finally:  # stored after the answer: writing a file must not delay its first token
            for cp in after_prompt + [self.engine.snapshot()]:
                self.store.add(cp)
        rest = stream.finish()
        if rest:
            job.send("text", rest)
        calls = stream.tool_calls()
        if calls:
            reason = "tool_calls"
        elif stream.stopped:
            reason = "stop"
        else:
            reason = "length"
        return Result(stream.content(), calls, reason, stream.stop_string, len(job.prompt), len(out),
                      stats.as_dict() if self.drafter is not None else None, time.perf_counter() - t0, cached, chosen)

    def _resume(self, prompt: list[int]) -> int:
        """Attaches the slot that can continue the longest prefix of prompt by itself (ties: the least
        recently used, so a new conversation takes the oldest slot) and puts it on the longest prefix
        it or a checkpoint holds; the tokens that need no prefill."""
        slot = max(self.slots, key=lambda s: (reusable(self.engine, prompt, s.seq), -s.used))
        slot.used = time.monotonic()
        self.engine.attach(slot.seq)
        return resume(self.engine, prompt, self.store)



def build_service(engine, drafter, model, source: str, exact: bool, ctx: int | None, slots: int, cache_bytes: int,
                  cache_dir=None) -> Service:
    """The service over an opened engine and its drafter (with the cost model that says when to ask
    it): its tokenizer and chat template, its family's tool-call syntax, and a checkpoint store of
    cache_bytes (on disk in cache_dir, given one)."""
    from ..families import family_named, load_attr
    from ..runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=source)
    syntax = family_named(engine.manifest.family).tool_syntax
    try:
        store = CheckpointStore(engine, drafter_tag(drafter), cache_bytes, cache_dir)
    except OSError as e:
        raise Ds4Error(f"--kv-cache-dir {cache_dir}: cannot use it ({e.strerror or e})") from None
    return Service(engine, tok, drafter, model=model, exact=exact, ctx=ctx, tool_syntax=load_attr(syntax) if syntax else None,
                   slots=slots, store=store)
