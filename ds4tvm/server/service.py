"""The generation service behind `ds4 serve`: one engine, `parallel` worker threads, a FIFO of jobs.

Up to `parallel` generations run at once, each on its own worker thread and engine sequence; the
runtime's scheduler (runtime/scheduler.py) runs their decode steps as batched calls and
interleaves newcomers' prefills in chunks (parallel 1: one generation at a time on the engine
itself). Requests queue in arrival order. The engine's state is kept in `slots` (engine
sequences, each with its committed tokens; at least one per worker): a job goes to the free slot
that can continue the longest prefix of its prompt by itself (ties: the least recently used) and
continues from there, or from the best checkpoint when it holds more (one is taken after every
prompt's prefill and every answer), instead of prefilling from zero (runtime/prefix.py); its result
says how many prompt tokens were reused.
A job reports to its request through a callback (`send`) that the HTTP side turns into SSE events
or one JSON body; a job whose client went away is skipped if still queued, and stopped after its
current token if running.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
import traceback
from collections import Counter, deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np

from ..errors import Cancelled, Ds4Error
from ..runtime.checkpoint import CheckpointStore
from ..runtime.drafters import drafter_tag
from ..runtime.grammar import Grammars
from ..runtime.prefix import resume, reusable
from ..runtime.sampler import SamplingParams
from ..runtime.scheduler import Scheduler
from ..runtime.speculative import generate
from ..runtime.textstream import TextStream

GREEDY = SamplingParams(temperature=0.0)
TOKEN_WINDOW = 10.0   # seconds over which /metrics gives tokens per second


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
    busy: bool = False                   # a job runs on it


@dataclass
class Worker:
    """What one worker thread generates with: its drafter (drafters keep per-generation state) and
    cost model."""
    drafter: object = None
    model: object = None


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
                 tool_syntax=None, slots: int = 2, store: CheckpointStore | None = None, model=None,
                 parallel: int = 1, make_drafter=None):
        """model: the drafter's cost model (runtime/costs.py; None: asked every cycle). tool_syntax: the class of the
        model family's tool-call syntax (families.Family.tool_syntax); None: tool definitions are rendered into the
        prompt, replies are not parsed for calls. slots: sequences kept in memory (at least `parallel`); store:
        where checkpoints go (default: in memory). parallel: generations at once; make_drafter() builds each
        further worker's drafter."""
        self.engine, self.tok, self.exact = engine, tokenizer, exact
        self.grammars = Grammars(tokenizer)
        self.tool_syntax = tool_syntax
        self.parallel = parallel
        self.slots = [Slot(engine.seq)] + [Slot(engine.new_sequence()) for _ in range(max(slots, parallel) - 1)]
        self.store = store if store is not None else CheckpointStore(engine, drafter_tag(drafter))
        self.ctx = min(ctx or engine.max_context, engine.max_context)
        self.scheduler = Scheduler(engine) if parallel > 1 else None
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running = 0                 # jobs generating now (/health, /metrics)
        self._counts = Counter()         # prompt, cached (prompt tokens not prefilled) and generated tokens
        self._outcomes = Counter()       # jobs answered: "ok", "cancelled", "client_error", "server_error"
        self._recent = deque()           # when each token of the last TOKEN_WINDOW seconds was generated
        self._lock = threading.Lock()    # slots, the counts
        self.workers = [Worker(drafter, model)] + [
            Worker(make_drafter() if drafter is not None else None, copy.deepcopy(model)) for _ in range(parallel - 1)]
        self._threads = [threading.Thread(target=self._work, args=(w,), name=f"ds4-generate-{i}", daemon=True)
                         for i, w in enumerate(self.workers)]
        for t in self._threads:
            t.start()

    @property
    def drafter(self):
        return self.workers[0].drafter

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        for _ in self._threads:
            self.jobs.put(None)
        for t in self._threads:
            t.join(timeout=30)
        if self.scheduler is not None:
            self.scheduler.close()

    def _work(self, worker: Worker) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            try:
                outcome, event = "ok", ("done", self.run(job, worker))
            except Cancelled:
                outcome, event = "cancelled", ("error", (499, "the client went away"))
            except Ds4Error as e:
                outcome, event = "client_error", ("error", (400, e.message))
            except Exception as e:  # keep serving: the request gets a 500, the log the trace
                traceback.print_exc()
                outcome, event = "server_error", ("error", (500, f"{type(e).__name__}: {e}"))
            with self._lock:   # counted before the client has its answer: /metrics read after it includes it
                self._outcomes[outcome] += 1
            job.send(*event)

    def counters(self) -> dict:
        """What /metrics reports of the jobs: running, outcomes, prompt, cached and generated tokens,
        and tokens generated per second over the last TOKEN_WINDOW seconds."""
        with self._lock:
            self._forget_old(time.monotonic())
            return {"running": self.running, "outcomes": dict(self._outcomes), "prompt": 0, "cached": 0,
                    "generated": 0, **self._counts,
                    "tok_s": len(self._recent) / TOKEN_WINDOW}

    def _forget_old(self, now: float) -> None:
        while self._recent and self._recent[0] < now - TOKEN_WINDOW:
            self._recent.popleft()

    def _generated(self) -> None:
        with self._lock:
            now = time.monotonic()
            self._counts["generated"] += 1
            self._recent.append(now)
            self._forget_old(now)

    def run(self, job: Job, worker: Worker | None = None) -> Result:
        """Generates for one job on this thread; text pieces go to job.send as they become final."""
        worker = worker or self.workers[0]
        with self._sequence(job.prompt) as (engine, cached):
            return self._generate(job, engine, cached, worker)

    @contextmanager
    def _sequence(self, prompt: list[int]):
        """(the engine a job generates with, prompt tokens it need not prefill): the free slot that can
        continue the longest prefix of prompt, put on it (or on a checkpoint holding more), held while inside."""
        with self._lock:
            free = [s for s in self.slots if not s.busy]
            slot = max(free, key=lambda s: (reusable(self.engine, prompt, s.seq), -s.used))
            slot.busy, slot.used = True, time.monotonic()
            self.running += 1
        try:
            with self.scheduler.member(slot.seq) if self.scheduler is not None else nullcontext(self.engine) as engine:
                if self.scheduler is None:
                    engine.attach(slot.seq)
                cached = resume(engine, prompt, self.store)
                with self._lock:
                    self._counts["prompt"] += len(prompt)
                    self._counts["cached"] += cached
                yield engine, cached
        finally:
            with self._lock:
                slot.busy = False
                self.running -= 1

    def _generate(self, job: Job, engine, cached: int, worker: Worker) -> Result:
        tools = self.tool_syntax() if job.tools and self.tool_syntax is not None else None
        stream = TextStream(self.tok, self.tok.stop_ids, job.stop, tools)

        def on_token(t: int) -> bool:
            self._generated()
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

        t0, after_prompt = time.perf_counter(), []
        try:
            out, stats = generate(engine, job.prompt, job.max_tokens, job.params,
                                  np.random.default_rng(job.seed), drafter=worker.drafter, exact=self.exact,
                                  stop_ids=self.tok.stop_ids, on_token=on_token,
                                  mode=mode if tools is not None else None,
                                  on_prefill=lambda done, total: job.cancelled.is_set(),
                                  model=worker.model,
                                  on_prompt=lambda: after_prompt.append(engine.snapshot()),
                                  constraint=job.constraint, on_choice=None if chosen is None else on_choice)
        finally:  # stored after the answer: writing a file must not delay its first token
            for cp in after_prompt + [engine.snapshot()]:
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
                      stats.as_dict() if worker.drafter is not None else None, time.perf_counter() - t0, cached,
                      chosen)


def build_service(engine, drafter, model, source: str, exact: bool, ctx: int | None, slots: int, cache_bytes: int,
                  cache_dir=None, parallel: int = 1, make_drafter=None) -> Service:
    """The service over an opened engine and its drafter (with the cost model that says when to ask
    it): its tokenizer and chat template, its family's tool-call syntax, and a checkpoint store of
    cache_bytes (on disk in cache_dir, given one); parallel requests at once (make_drafter() gives
    each further one its drafter)."""
    from ..families import family_named, load_attr
    from ..runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=source)
    syntax = family_named(engine.manifest.family).tool_syntax
    try:
        store = CheckpointStore(engine, drafter_tag(drafter), cache_bytes, cache_dir)
    except OSError as e:
        raise Ds4Error(f"--kv-cache-dir {cache_dir}: cannot use it ({e.strerror or e})") from None
    return Service(engine, tok, drafter, model=model, exact=exact, ctx=ctx, tool_syntax=load_attr(syntax) if syntax else None,
                   slots=slots, store=store, parallel=parallel, make_drafter=make_drafter)
