"""Continuous batching: several generations share one engine, their decode steps run as one
batched call (Engine.decode_batch: the weights read once for every sequence in it).

Each generation runs the one loop of runtime/speculative.py on its own thread, unchanged, against
a `SequenceEngine`: its own engine sequence behind the engine's interface. Every call that runs
kernels or moves counters becomes an operation queued here, and one scheduler thread, the only
one that touches the engine, runs them in rounds:
  1. it waits until every running generation has an operation queued (each spends only its
     sampling between two steps) or `max_wait` has passed since the first one came;
  2. other operations (commit, snapshots, a drafter's calls) run one by one, except a drafter's
     steps of one function, in one call where the artifact has its batched copies
     (Engine.call_batch); then the speculating generations' verify blocks in one call of up to
     max_batch sequences, the decode steps in it as blocks of one row where they fit
     (Engine.verify_batch; a block waits a round or two while other generations run their
     drafters' calls, so that generations one call apart come to verify together);
  3. the decode steps run in batches of up to the engine's max_batch sequences, the first prompt
     being prefilled bringing its chunk into that call where the artifact has batched prefills
     (Engine.prefill_batch: the weights read once for the chunk and the decodes);
  4. the other prompts being prefilled advance by a chunk each in arrival order; while others
     decode, the round's prefill adds about STALL batched decode steps' time (more when newcomers
     outnumber the running streams: STALL steps per newcomer), given to one prompt after another
     in chunks as large as fit (a small chunk costs more per token), the first prompt to move
     taking all it has left where that is at most FINISH tokens: a running stream never waits for
     a whole long prefill, and a newcomer joins the batch soon.
Requests join and leave between rounds. Which operations share a call never changes a
sequence's numbers (a token's logits do not depend on the rows beside it, bit for bit), so a
generation gives what it gives alone, and its seeded sampling repeats.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..artifact import batch_name
from ..errors import Cancelled, Ds4Error
from .engine import SequenceView, Step

MIN_CHUNK = 8       # a round's first prefill chunk at least, while others decode (doubled up to the compiled chunk)
# decode steps' time a round's prefill may add while others decode: their tokens come about 1 + STALL
# steps apart while a prompt is prefilled (the bound: ITL p99 <= 3x its p50). Small chunks cost
# more per token (the benchmark model, beside 3 decodes: a chunk of 8 added 7.4 ms, of 16 11.5 ms, of
# 64 31.3 ms); in process, 8 clients gave 493 / 569 / 566 tok/s at 1 / 1.5 / 2 (BENCHMARKS.md).
STALL = 1.5
# a prompt's tokens that one round prefills whole beside the decodes when they are all it has left (a
# short prompt, a long one's last chunk): its first token comes rounds sooner, in one chunk (a small
# chunk costs more per token), for one longer round of the others. serve_load, 64-token prompts, 64
# against none, two alternated runs: 4 clients 1.04 / 1.05x the tok/s, 8 clients 1.02 / 0.99x; TTFT
# p99 about half and ITL p99 at 8 clients 1.4-1.6x there, though those percentiles move as much
# between runs (BENCHMARKS.md, seventeenth session).
FINISH = 64
# rounds a verify block may wait for other generations' verify blocks (Scheduler._verifies_now)
VERIFY_WAIT = 2


@dataclass
class _Op:
    seq: object
    kind: str                       # "decode", "prefill", "verify", "call" or "run"
    token: int = 0                  # decode
    tokens: np.ndarray | None = None  # prefill: what is left to prefill; verify: the block
    total: int = 0                  # prefill: its token count
    parts: list = field(default_factory=list)   # prefill: the chunks' steps
    on_chunk: object = None         # prefill: on_chunk(done, total) -> True cancels
    fn: object = None               # run: fn(engine) with seq attached; call: the function's name
    inputs: dict = field(default_factory=dict)   # call: its inputs
    waited: int = 0                 # verify: rounds held for others' blocks
    result: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(self, engine, max_wait: float = 0.02):
        self.engine, self.max_wait = engine, max_wait
        self.prefilled = 0   # prompt tokens prefilled (the decode calls: Engine.decode_calls)
        self._cond = threading.Condition()
        self._queued: list[_Op] = []
        self._prefills: list[_Op] = []     # prompts being prefilled, a chunk per round
        self._members = 0                   # generations running (each has at most one operation queued)
        self._step_s = None                 # recent seconds of a decode call
        self._stream_s = None               # recent seconds of the running streams' call (decode or verify)
        # recent seconds a prefill chunk adds to a round by its token count, apart (False) and
        # sharing a call with decodes (True: what the call took beyond a decode step)
        self._chunk_s: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ds4-scheduler", daemon=True)
        self._thread.start()

    @contextmanager
    def member(self, seq):
        """A SequenceEngine on seq for one generation's thread, counted as running while inside."""
        with self._cond:
            self._members += 1
        try:
            yield SequenceEngine(self, seq)
        finally:
            with self._cond:
                self._members -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, op: _Op):
        """Queues op and waits for its result (raising what it raised)."""
        with self._cond:
            if self._closed:
                raise Ds4Error("the scheduler is closed")
            self._queued.append(op)
            self._cond.notify_all()
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    # ------------------------------------------------------------------ the scheduler thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                first = None
                while not self._closed:
                    waiting = len(self._queued) + len(self._prefills)
                    if waiting and first is None:
                        first = time.monotonic()
                    if waiting and (waiting >= self._members or time.monotonic() - first >= self.max_wait):
                        break
                    self._cond.wait(None if first is None else max(0.0, first + self.max_wait - time.monotonic()))
                if self._closed:
                    for op in self._queued + self._prefills:
                        op.error = Ds4Error("the scheduler is closed")
                        op.done.set()
                    return
                ops, self._queued = self._queued, []
            try:
                self._round(ops)
            except BaseException as e:   # a fault of the scheduler's own: its waiters get it, it serves on
                for op in ops + self._prefills:
                    if not op.done.is_set():
                        op.error = op.error or e
                        op.done.set()
                self._prefills = []
                with self._cond:   # (verify blocks held back for the next round among them)
                    self._queued = [op for op in self._queued if not op.done.is_set()]

    def _round(self, ops: list[_Op]) -> None:
        for op in ops:
            if op.kind == "run":
                self._finish(op, lambda op=op: self._attached(op.seq, op.fn))
        self._calls([op for op in ops if op.kind == "call"])
        verifies = self._verifies_now([op for op in ops if op.kind == "verify"], ops)
        self._prefills += [op for op in ops if op.kind == "prefill"]
        decodes = [op for op in ops if op.kind == "decode"]
        prefills = list(self._prefills)
        budget, moved = self._budget(len(decodes) + len(verifies), len(prefills)), False
        if verifies and decodes and self._decodes_ride_along(len(verifies), len(decodes)):
            self._verify(verifies, decodes)
            decodes = []
        else:
            for i in range(0, len(verifies), self.engine.max_batch):
                self._verify(verifies[i:i + self.engine.max_batch])
        if prefills and batch_name(len(decodes) + 1, "prefill") in self.engine.functions:
            op = prefills.pop(0)
            n = self._chunk(budget, True, first=True, left=len(op.tokens))
            budget -= self._prefill_with_decodes(op, n, decodes)
            moved = True
        else:
            for i in range(0, len(decodes), self.engine.max_batch):
                self._decode(decodes[i:i + self.engine.max_batch])
        for op in prefills:   # in arrival order, while the round's time allows
            n = self._chunk(budget, False, first=not moved, left=len(op.tokens))
            if not n:
                break
            budget -= self._prefill_chunk(op, n)
            moved = True

    def _calls(self, ops: list[_Op]) -> None:
        """The round's calls of named functions (a drafter's step), those of one function in calls of
        up to max_batch sequences (Engine.call_batch: in one call where its batched copy exists); if
        one fails, each alone says what it did."""
        by_name: dict = {}
        for op in ops:
            by_name.setdefault(op.fn, []).append(op)
        for name, same in by_name.items():
            for i in range(0, len(same), self.engine.max_batch):
                group = same[i:i + self.engine.max_batch]
                try:
                    results = self.engine.call_batch(name, [op.seq for op in group], [op.inputs for op in group])
                except BaseException:
                    for op in group:
                        self._finish(op, lambda op=op: self._attached(op.seq, lambda e: e.call(op.fn, **op.inputs)))
                    continue
                for op, result in zip(group, results):
                    op.result = result
                    op.done.set()

    def _attached(self, seq, fn):
        self.engine.attach(seq)
        return fn(self.engine)

    @staticmethod
    def _finish(op: _Op, fn) -> None:
        try:
            op.result = fn()
        except BaseException as e:   # the generation's thread raises it
            op.error = e
        op.done.set()

    def _decode(self, ops: list[_Op]) -> None:
        t0 = time.perf_counter()
        try:
            steps = self.engine.decode_batch([op.seq for op in ops], [op.token for op in ops])
        except BaseException:
            for op in ops:   # alone, each says what it did: one request's full context fails no other
                self._finish(op, lambda op=op: self.engine.decode_batch([op.seq], [op.token])[0])
            return
        took = time.perf_counter() - t0
        self._step_s, self._stream_s = _recent(self._step_s, took), _recent(self._stream_s, took)
        for op, step in zip(ops, steps):
            op.result = step
            op.done.set()

    def _decodes_ride_along(self, verifying: int, decoding: int) -> bool:
        """Whether a round's decode steps join its verify call as one-row blocks: where the artifact
        has that batched verify, and its batched decode is no recorded CUDA graph (whose replay a
        call of symbolic rows would not match); an artifact without batched verifies keeps them apart."""
        fns = self.engine.functions
        decode = fns.get(batch_name(decoding) if decoding > 1 else "decode")
        return batch_name(verifying + decoding, "verify") in fns and not (decode is not None and decode.recorded)

    def _verifies_now(self, verifies: list[_Op], ops: list[_Op]) -> list[_Op]:
        """The verify blocks to run this round: none while another generation ran one of its other
        calls this round (a drafter's, a commit: its own verify may come next), each held for at
        most VERIFY_WAIT rounds. Generations one call apart would otherwise never verify in the
        same round (each round takes one call of each)."""
        if not verifies or not any(op.kind in ("run", "call") for op in ops) or \
                all(op.waited >= VERIFY_WAIT for op in verifies):
            return verifies
        for op in verifies:
            op.waited += 1
        with self._cond:
            self._queued[:0] = verifies
        return []

    def _verify(self, ops: list[_Op], decodes: list[_Op] = ()) -> None:
        """The verify blocks of ops, and the decodes as blocks of one row committed at once (a
        decode gives the logits of a one-row verify, bit for bit), in one call (Engine.verify_batch)."""
        t0, seqs = time.perf_counter(), [op.seq for op in [*ops, *decodes]]
        try:
            steps = self.engine.verify_batch(seqs, [op.tokens for op in ops] + [[d.token] for d in decodes])
        except BaseException:
            for op in ops:   # alone, each says what it did
                self._finish(op, lambda op=op: self._attached(op.seq, lambda e: e.verify(op.tokens)))
            if decodes:
                self._decode(list(decodes))
            return
        self._stream_s = _recent(self._stream_s, time.perf_counter() - t0)
        for op, step in zip(ops, steps):
            op.result = step
            op.done.set()
        for d, step in zip(decodes, steps[len(ops):]):
            self.engine.attach(d.seq)
            self.engine.commit(1)
            d.result = Step("decode", step.logits[0], step.outputs)
            d.done.set()

    def _budget(self, decoding: int, prefilling: int) -> float:
        """Seconds the round's prefill may add: unbounded where no one decodes (prompts waiting only
        for each other: whole chunks make every first token come soonest), else STALL of the running
        streams' steps (a decode call, or a verify call where they speculate), or STALL steps per
        newcomer where newcomers outnumber the running streams."""
        if not decoding:
            return float("inf")
        return 0.0 if self._stream_s is None else STALL * max(1.0, prefilling / decoding) * self._stream_s

    def _chunk(self, budget: float, joined: bool, first: bool, left: int | None = None) -> int:
        """The next prompt's tokens this round (of `left` still to prefill): the largest doubling of
        MIN_CHUNK whose time, measured (a small chunk costs more per token than a large one) or, not
        tried yet, guessed as twice the measured half's (one size beyond what was tried, per round),
        fits the budget; the first prompt to move this round gets MIN_CHUNK at least, or all it has
        left where that is at most FINISH tokens; the others none where MIN_CHUNK does not fit. The
        budget goes to one prompt after another, not split among them: the chunks stay large.
        joined: the chunk shares a call with the decodes (it adds its tokens' time, not a call's)."""
        if budget == float("inf"):
            return self.engine.chunk
        if first and left is not None and left <= min(FINISH, self.engine.chunk):
            return left
        seconds, n = self._chunk_s[joined], MIN_CHUNK
        if not first and seconds.get(n, float("inf")) > budget:
            return 0
        while 2 * n <= self.engine.chunk and seconds.get(2 * n, 2 * seconds.get(n, float("inf"))) <= budget:
            n *= 2
        return n

    def _prefill_with_decodes(self, op: _Op, n: int, decodes: list[_Op]) -> float:
        """op's next chunk and every decode in one call (Engine.prefill_batch); if that fails, each
        alone says what it did. Returns the seconds the chunk added to the decodes' call."""
        t0, part = time.perf_counter(), op.tokens[:n]
        try:
            chunk, steps = self.engine.prefill_batch(op.seq, part, [d.seq for d in decodes], [d.token for d in decodes])
        except BaseException:
            self._decode(decodes)
            return self._prefill_chunk(op, n)
        for d, step in zip(decodes, steps):
            d.result = step
            d.done.set()
        added = max(0.0, time.perf_counter() - t0 - (self._step_s or 0.0))
        if self._step_s is not None:
            self._chunk_s[True][len(part)] = _recent(self._chunk_s[True].get(len(part)), added)
        self._advanced(op, len(part), chunk)
        return added

    def _prefill_chunk(self, op: _Op, n: int) -> float:
        """op's next chunk in a call of its own; returns the seconds it took."""
        t0, part, chunk = time.perf_counter(), op.tokens[:n], None
        try:
            chunk = self._attached(op.seq, lambda e: e.prefill(part))
        except BaseException as e:
            op.error = e
        took = time.perf_counter() - t0
        if op.error is None:
            self._chunk_s[False][len(part)] = _recent(self._chunk_s[False].get(len(part)), took)
        self._advanced(op, len(part), chunk)
        return took

    def _advanced(self, op: _Op, n: int, chunk) -> None:
        """op after the step of its next n tokens (chunk; None where it failed: op.error says why):
        done, cancelled, or on to its next chunk."""
        try:
            if op.error is None:
                op.parts.append(chunk)
                self.prefilled += n
                op.tokens = op.tokens[n:]
                done = op.total - len(op.tokens)
                if op.on_chunk is not None and op.on_chunk(done, op.total):
                    raise Cancelled(f"prefill stopped after {done} of {op.total} tokens")
        except BaseException as e:
            op.error = e
        if op.error is not None or not len(op.tokens):
            self._prefills.remove(op)
            if op.error is None:
                op.result = _joined(op.parts)
            op.done.set()


def _recent(old: float | None, new: float) -> float:
    return new if old is None else 0.8 * old + 0.2 * new


def _joined(parts: list):
    """The steps of a prompt's chunks as Engine.prefill returns them: the last token's logits,
    every row's other outputs."""
    outputs = {k: np.concatenate([p.outputs[k] for p in parts]) for k in parts[0].outputs}
    return Step(parts[0].fn, parts[-1].logits, outputs)


class SequenceEngine(SequenceView):
    """One engine sequence behind the engine's interface, for a generation on its own thread:
    calls that run kernels or move counters are operations of the scheduler; the artifact's
    constants (max_context, n_vocab, manifest, drafters, ...) are the engine's."""

    _PURE = frozenset({"rewindable_of"})   # engine methods that only read: called directly

    def __init__(self, scheduler: Scheduler, seq):
        super().__init__(scheduler.engine, seq)
        self._scheduler = scheduler

    def __getattr__(self, name):
        value = getattr(self._engine, name)
        if callable(value) and name not in self._PURE:
            raise AttributeError(f"SequenceEngine: Engine.{name} is not available to a batched sequence")
        return value

    def _run(self, fn):
        return self._scheduler.submit(_Op(self.seq, "run", fn=fn))

    def decode(self, token: int):
        self._engine._ids([token])   # a bad id is this request's error, before it joins a batch
        return self._scheduler.submit(_Op(self.seq, "decode", token=int(token)))

    def prefill(self, tokens, all_logits: bool = False, on_chunk=None):
        ids = self._engine._ids(tokens)
        if all_logits or not len(ids) or self.seq.pos + len(ids) > self._engine.max_context:
            return self._run(lambda e: e.prefill(ids, all_logits, on_chunk))   # (the last says what is wrong)
        return self._scheduler.submit(_Op(self.seq, "prefill", tokens=ids, total=len(ids), on_chunk=on_chunk))

    def verify(self, tokens):
        self._engine._ids(tokens)   # a bad id is this request's error, before it joins a batch
        return self._scheduler.submit(_Op(self.seq, "verify", tokens=np.asarray(tokens)))

    def commit(self, k: int) -> None:
        self._run(lambda e: e.commit(k))

    def rollback(self) -> None:
        self._run(lambda e: e.rollback())

    def rewind(self, n: int) -> None:
        self._run(lambda e: e.rewind(n))

    def reset(self) -> None:
        self._run(lambda e: e.reset())

    def snapshot(self):
        return self._run(lambda e: e.snapshot())

    def restore(self, cp) -> None:
        self._run(lambda e: e.restore(cp))

    def call(self, fn: str, **inputs):
        if batch_name(2, fn) in self._engine.functions:   # it has batched copies: it may share a call
            return self._scheduler.submit(_Op(self.seq, "call", fn=fn, inputs=inputs))
        return self._run(lambda e: e.call(fn, **inputs))
