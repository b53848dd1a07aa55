"""DSpark drafter (ds4 behaviour): rings fed with every committed position, the 3-stage block
over [main row, anchor, noise...], then per step the Markov head (row lookup in w1, rank->vocab
bias through w2, argmax with ties to the lower id) and the confidence gate sigma(c_i) >= theta
with an early stop. The compiled `dspark_propose` computes every row's draft and confidence in
one call (families/dspark/model.py); the cut is made here.

In the loop's terms the block's first token is a guess for the token the target chooses next
(checked for free against the target's logits); when it is right the rest of the block is the
drafts after it. The count-based back-off of ds4 (`Scheduler`, DS4_DSPARK_*) decides when to
propose at all (and the loop's cost model, runtime/costs.py).

Plain decode steps feed the rings through ds4's direct path in batches: their rows are kept on the
host and written in one call before the next proposal (or every FLUSH_ROWS rows, or when the
generation ends), so that a run of plain steps costs what target-only decoding costs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from ...errors import Ds4Error
from ..speculative import DraftCounters, stats_line

DEFAULT_THETA = 0.7
EXACT_DEFAULT_THETA = 0.8
FLUSH_ROWS = 64   # direct-path rows kept before a write (fewer than the ring's 128)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass
class Scheduler:
    """ds4's count-based DSpark back-off (ds4-spec §3); defaults overridable by DS4_DSPARK_*."""

    enabled: bool = True
    window: int = 4
    skip: int = 2
    slow_skip: int = 4
    min_avg_milli: int = 1500
    no_draft_skip: int = 3
    short_accept_no_draft_skip: int = 4
    cold_low_confidence_skip: int = 7
    cold_low_confidence_milli: int = 500
    tail_min_tokens: int = 10
    pending_skip: int = 0
    ever_accepted: int = 0          # drafts accepted so far
    max_accepted: int = 0           # most drafts accepted in one cycle
    attempts: list = field(default_factory=list)   # accepted counts (-1: empty proposal) of this window

    @classmethod
    def from_env(cls) -> "Scheduler":
        s = cls()
        s.enabled = os.environ.get("DS4_DSPARK_SCHEDULER", "1") not in ("0", "off", "false")
        for f in ("window", "skip", "slow_skip", "min_avg_milli", "no_draft_skip", "short_accept_no_draft_skip",
                  "cold_low_confidence_skip", "cold_low_confidence_milli", "tail_min_tokens"):
            setattr(s, f, _env_int(f"DS4_DSPARK_{f.upper()}", getattr(s, f)))
        return s

    def should_propose(self, remaining: int) -> bool:
        if remaining < self.tail_min_tokens:
            return False
        if self.enabled and self.pending_skip > 0:
            self.pending_skip -= 1
            return False
        return True

    def record(self, accepted: int | None, first_confidence: float | None = None) -> None:
        """accepted: drafts accepted in a cycle, or None for an empty proposal."""
        if accepted is None:
            skip = self.no_draft_skip
            if self.ever_accepted and self.max_accepted <= 2:
                skip = max(skip, self.short_accept_no_draft_skip)
            if not self.ever_accepted and first_confidence is not None and \
                    first_confidence <= self.cold_low_confidence_milli / 1000:
                skip = max(skip, self.cold_low_confidence_skip)
            self._skip_at_least(skip)
        else:
            self.ever_accepted += accepted
            self.max_accepted = max(self.max_accepted, accepted)
        self.attempts.append(-1 if accepted is None else accepted)
        if len(self.attempts) >= self.window:
            counts = [max(a, 0) for a in self.attempts]
            if sum(a < 0 for a in self.attempts) * 2 >= len(self.attempts):
                self._skip_at_least(self.slow_skip)
            elif 1000 * sum(counts) / len(counts) < self.min_avg_milli:
                self._skip_at_least(self.skip)
            self.attempts.clear()

    def _skip_at_least(self, n: int) -> None:
        if self.enabled:
            self.pending_skip = max(self.pending_skip, n)


class DSparkDrafter:
    NAME = "DSpark"
    def __init__(self, engine, theta: float = DEFAULT_THETA, max_block: int | None = None,
                 scheduler: Scheduler | None = None):
        d = engine.drafters.get("dspark")
        if d is None:
            raise Ds4Error(f"{engine.dir}: this artifact has no DSpark drafter; compile it with --mtp SUPPORT.gguf")
        if not 0 <= theta <= 1:
            raise Ds4Error(f"--dspark-confidence {theta}: expected a value in [0, 1]")
        self.block_size, self.noise, self.theta = d["block_size"], d["noise_token_id"], theta
        self.proposals = min(self.block_size, max_block or self.block_size)  # a verify cap
        self.scheduler = scheduler or Scheduler.from_env()
        self.direct_rows, self.direct_start = [], 0      # plain steps' rows not yet in the rings
        self.anchor_row, self.block, self.stop_ids = None, [], frozenset()
        self.stats, self.no_draft, self.scheduler_skips = DraftCounters(), 0, 0

    # ------------------------------------------------------------------ the loop's calls
    def begin(self, engine, step, stop_ids):
        self.stop_ids = stop_ids
        captured = step.outputs["captured"]
        self.direct_rows = []
        self._write_rings(engine, captured, engine.pos - len(captured), direct=False)

    def guess(self, engine, remaining):
        self.block = []
        if not self.scheduler.should_propose(remaining):
            self.scheduler_skips += remaining >= self.scheduler.tail_min_tokens
            return None
        self._flush(engine)
        room = min(self.block_size, engine.max_verify, remaining, engine.max_context - engine.pos)
        block, first = self._propose(engine, engine.history[-1], room)
        for i, d in enumerate(block):  # nothing is proposed past an end-of-sequence token
            if d in self.stop_ids:
                block = block[:i + 1]
                break
        if not block:
            self.no_draft += 1
            self.scheduler.record(None, first)
            return None
        self.block = block
        return block[0]

    def draft(self, engine, token, max_tokens):
        return self.block[1:1 + max_tokens] if self.block and token == self.block[0] else []

    def result(self, accepted):
        self.stats.record(len(self.block), accepted)
        self.scheduler.record(accepted)
        self.block = []

    def observe(self, engine, step, tokens):
        captured, start = step.outputs["captured"][:len(tokens)], engine.pos - len(tokens)
        if step.fn == "decode":  # misses, skips: ds4's cheaper direct path, written in batches
            if not self.direct_rows:
                self.direct_start = start
            self.direct_rows.append(captured)
            self.anchor_row = captured[-1]
            if len(self.direct_rows) >= FLUSH_ROWS:
                self._flush(engine)
        else:
            self._flush(engine)
            self._write_rings(engine, captured, start, direct=False)

    def finish(self, engine):
        self._flush(engine)

    def counters(self):
        d = self.stats.as_dict()
        d["cycles"] += self.no_draft
        d["avg_accept"] = self.stats.accepted_draft / d["cycles"] if d["cycles"] else 0.0
        return {**d, "first_tokens": d["cycles"], "no_draft": self.no_draft, "scheduler_skips": self.scheduler_skips}

    def stats_line(self, tok_s):
        d = self.counters()
        return stats_line(self.NAME, d, tok_s, **{k: d[k] for k in ("first_tokens", "full", "partial", "miss_first",
                                                                      "no_draft", "scheduler_skips")})

    # ------------------------------------------------------------------ the drafter itself
    def _write_rings(self, engine, captured, start, direct):
        engine.call("dspark_observe_direct" if direct else "dspark_observe", captured=captured, start=start)
        self.anchor_row = captured[-1]

    def _flush(self, engine):
        if self.direct_rows:
            rows, self.direct_rows = np.concatenate(self.direct_rows), []
            self._write_rings(engine, rows, self.direct_start, direct=True)

    def _propose(self, engine, anchor, max_tokens):
        """The block after the committed anchor token, cut at the first row whose confidence is
        below theta; and sigma(c_0) (the scheduler's cold-start rule reads it)."""
        out = engine.call("dspark_propose", captured=self.anchor_row[None],
                          tokens=[anchor] + [self.noise] * (self.block_size - 1), start=engine.pos - 1)
        tokens, first = [], None
        for i in range(min(self.proposals, max_tokens)):
            if self.theta > 0:
                c = float(out["confidence"][i])
                sig = 1.0 / (1.0 + math.exp(-c)) if c > -700 else 0.0
                first = sig if i == 0 else first
                if sig < self.theta:
                    break
            tokens.append(int(out["drafts"][i]))
        return tokens, first


def default_theta(engine, exact: bool) -> float:
    """θ when --dspark-confidence is not given: the support file's calibrated value (raised to 0.8
    under exact sampling, as ds4 raises its default), else ds4's defaults."""
    calibrated = engine.drafters["dspark"].get("confidence_threshold") if "dspark" in engine.drafters else None
    if calibrated is None:
        return EXACT_DEFAULT_THETA if exact else DEFAULT_THETA
    return max(calibrated, EXACT_DEFAULT_THETA) if exact else calibrated


def from_options(engine, options):
    """--dspark, --dspark-confidence θ (θ defaults to the support file's calibrated value, else 0.7,
    or 0.8 with exact sampling), --dspark-strict (the drafter is built and checked, decoding stays
    target-only)."""
    theta = options.dspark_confidence
    if theta is None:
        theta = default_theta(engine, options.exact_sampling)
    drafter = DSparkDrafter(engine, theta)
    return None if options.dspark_strict else drafter
