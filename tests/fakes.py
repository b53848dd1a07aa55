"""Test doubles for the speculative loop: a numpy target with the Engine interface whose next-token
logits depend on the last two tokens, and a drafter that proposes a scripted continuation."""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from ds4tvm.runtime.checkpoint import Checkpoint
from ds4tvm.runtime.engine import Sequence, Step
from ds4tvm.runtime.speculative import DraftCounters


@dataclass
class FakeSequence(Sequence):
    n_prompt: int = 0


def _field(name):
    return property(lambda self: getattr(self.seq, name), lambda self, value: setattr(self.seq, name, value))


class Sequences:
    """The Engine's sequence API (attach, rewind, snapshot, restore, history) for test doubles whose
    whole state is their token list and counters."""
    identity = "test-double"
    tokens, pos, n_prompt = _field("history"), _field("pos"), _field("n_prompt")

    def new_sequence(self) -> FakeSequence:
        return FakeSequence({})

    def attach(self, seq) -> None:
        self.seq, self.pending = seq, 0

    @property
    def history(self) -> list[int]:
        return self.tokens[:self.pos]

    @property
    def rewindable(self) -> int:
        return self.rewindable_of(self.seq)

    def rewindable_of(self, seq) -> int:
        return min(seq.pos, self.max_verify)

    def rewind(self, n: int) -> None:
        assert 0 <= n <= self.rewindable
        self.pos -= n
        self.tokens = self.tokens[:self.pos]

    def snapshot(self) -> Checkpoint:
        return Checkpoint(self.pos, list(self.history), [])

    def restore(self, cp: Checkpoint) -> None:
        self.tokens, self.pos, self.pending = list(cp.history), cp.pos, 0


class TableEngine(Sequences):
    """logits(next | ..., a, b) = table[a, b]: small, exact, and cheap enough for 20k runs."""

    def __init__(self, vocab: int = 6, seed: int = 0, max_context: int = 64, max_verify: int = 8, sharp: float = 1.0):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((vocab, vocab, vocab)) * sharp
        self.max_context, self.max_verify, self.n_vocab = max_context, max_verify, vocab
        self.attach(self.new_sequence())
        self._pending_tokens: list[int] = []

    def _row(self, seq):
        return self.table[seq[-2] if len(seq) > 1 else 0, seq[-1]].copy()

    def reset(self):
        self.tokens, self.pos, self.pending = [], 0, 0

    def prefill(self, ids, on_chunk=None):
        self.tokens = self.tokens[:self.pos] + list(ids)
        self.pos = len(self.tokens)
        return Step("prefill", self._row(self.tokens))

    def decode(self, token):
        self.tokens = self.tokens[:self.pos] + [token]
        self.pos += 1
        return Step("decode", self._row(self.tokens))

    def verify(self, drafts):
        base = self.tokens[:self.pos]
        self._pending_tokens = list(drafts)
        self.pending = len(drafts)
        return Step("verify", np.stack([self._row(base + list(drafts[:i + 1])) for i in range(len(drafts))]))

    def commit(self, k):
        assert 0 <= k <= self.pending
        self.tokens = self.tokens[:self.pos] + self._pending_tokens[:k]
        self.pos += k
        self.pending = 0

    def rollback(self):
        self.pending = 0


class ScriptedDrafter:
    """Proposes the continuation a test wants: script[i], i = tokens committed after the prompt,
    optionally wrong at block index `wrong_at` (replaced by another token). In "guess" mode (as
    DSpark) script[i] is offered as a guess for the next token and script[i + 1:] are the drafts
    after it when it was right; in "after" mode (as MTP) nothing is guessed and the drafts after
    the chosen token are script[i + 1:]. Like ds4's drafters it stays silent in the last
    tail_min_tokens tokens."""

    NAME = "scripted"

    def __init__(self, script: list[int], block_size: int = 5, wrong_at: int | None = None, vocab: int = 512,
                 empty: bool = False, mode: str = "guess", tail_min_tokens: int = 10):
        self.script, self.block_size, self.wrong_at, self.vocab, self.empty = script, block_size, wrong_at, vocab, empty
        self.mode, self.tail_min_tokens = mode, tail_min_tokens
        self.observed: list[int] = []
        self.block: list[int] = []
        self.stats, self.no_draft, self.remaining = DraftCounters(), 0, 0

    def _block(self, start: int, n: int) -> list[int]:
        toks = list(self.script[start:start + n])
        if self.wrong_at is not None and self.wrong_at < len(toks):
            toks[self.wrong_at] = (toks[self.wrong_at] + 1) % self.vocab
        return toks

    def begin(self, engine, step, stop_ids):
        self.observed = []

    def guess(self, engine, remaining):
        self.block, self.remaining = [], remaining
        if self.mode != "guess" or remaining < self.tail_min_tokens:
            return None
        if self.empty:
            self.no_draft += 1
            return None
        self.block = self._block(len(self.observed), min(self.block_size, remaining, engine.max_verify))
        return self.block[0] if self.block else None

    def draft(self, engine, token, max_tokens):
        if self.mode == "guess":
            return self.block[1:1 + max_tokens] if self.block and token == self.block[0] else []
        if self.remaining < self.tail_min_tokens:
            return []
        self.block = self._block(len(self.observed) + 1, min(self.block_size - 1, max_tokens))
        return self.block

    def result(self, accepted):
        self.stats.record(len(self.block), accepted)
        self.block = []

    def observe(self, engine, step, tokens):
        self.observed += list(tokens)

    def finish(self, engine):
        pass

    def counters(self):
        return {**self.stats.as_dict(), "no_draft": self.no_draft}

    def stats_line(self, tok_s):
        return f"ds4: scripted stats proposed={self.stats.proposed} t/s={tok_s:.2f}"


class ScriptEngine(Sequences):
    """A target whose greedy continuation of any prompt is `script`, then `end` forever: lets the
    server tests make a model 'write' a tool call. Logits put a margin of `margin` on the scripted
    token; the state is just the committed length."""

    def __init__(self, script: list[int], vocab: int, end: int, max_context: int = 512, max_verify: int = 8,
                 margin: float = 8.0):
        self.script, self.vocab, self.end, self.margin = list(script), vocab, end, margin
        self.max_context, self.max_verify = max_context, max_verify
        self.drafters = {}
        self.attach(self.new_sequence())

    def _row(self, generated: int) -> np.ndarray:
        row = np.zeros(self.vocab, np.float32)
        row[self.script[generated] if generated < len(self.script) else self.end] = self.margin
        return row

    def reset(self):
        self.tokens, self.pos, self.n_prompt, self.pending = [], 0, 0, 0

    def prefill(self, ids, on_chunk=None):
        self.tokens = self.tokens[:self.pos] + list(ids)
        self.n_prompt = self.pos = len(self.tokens)
        return Step("prefill", self._row(0))

    def decode(self, token):
        self.tokens = self.tokens[:self.pos] + [token]
        self.pos += 1
        return Step("decode", self._row(self.pos - self.n_prompt))

    def verify(self, drafts):
        self.pending, self._pending_tokens = len(drafts), list(drafts)
        return Step("verify", np.stack([self._row(self.pos - self.n_prompt + i + 1) for i in range(len(drafts))]))

    def commit(self, k):
        assert 0 <= k <= self.pending
        self.tokens = self.tokens[:self.pos] + self._pending_tokens[:k]
        self.pos += k
        self.pending = 0

    def rollback(self):
        self.pending = 0
