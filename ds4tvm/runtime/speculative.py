"""The one speculative decoding loop, for every drafter (DSpark; the MTP drafters later).

A cycle, after the target has committed an anchor token and holds the distribution of the next
position (`logits`):
  1. the scheduler decides whether to propose; the drafter proposes up to `block` tokens;
  2. draft 0 is checked against `logits` (free: the target already computed them);
  3. the remaining drafts are verified in one batched target pass, row i giving the distribution
     after draft i; the accepted run is committed, the rest rolled back (counters only);
  4. the next cycle starts from the last accepted row; a rejected draft in exact mode first draws
     its replacement from the residual distribution.
Acceptance: greedy at temperature 0; opportunistic (drafts accepted when they equal the target
argmax, ordinary tokens sampled; biased toward greedy text, as in ds4); exact (the draft is a point
mass, accepted with its probability under the filtered target distribution, else the replacement
is drawn from the renormalised remainder, so the output law is that of plain sampling).

Sampling modes (ds4-spec §6, the server's tool boundary): `mode(out)` may change the sampling
parameters after any emitted token (the server switches to greedy inside tool-call syntax). When
an accepted block crosses such a boundary, the block is cut back to the boundary (the state rewinds
to the block start plus the tokens before the boundary: with append-only state that is commit(j))
and the boundary token is evaluated again under the new mode from the verifier row before it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .sampler import SamplingParams, argmax, filtered_probs, sample


@dataclass
class Proposal:
    tokens: list[int]
    first_confidence: float | None = None   # sigma(c_0), for the scheduler's cold start rule


class Drafter(Protocol):
    block_size: int

    def begin(self, engine, prompt: list[int]) -> None:
        """The target has prefilled `prompt`; the drafter reads what it needs from the engine."""

    def observe(self, engine, tokens: list[int], speculative: bool) -> None:
        """The target committed `tokens` (the last len(tokens) positions); speculative is False for
        plain decode steps (ds4 maintains the drafter rings through a cheaper path then)."""

    def draft(self, engine, anchor: int, max_tokens: int) -> Proposal:
        """Up to max_tokens proposals for the positions after the committed anchor token."""


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


@dataclass
class SpecStats:
    cycles: int = 0            # cycles that proposed (or tried to); each has one first token
    proposed: int = 0
    accepted_draft: int = 0
    full: int = 0
    partial: int = 0
    miss_first: int = 0
    no_draft: int = 0
    scheduler_skips: int = 0
    generated: int = 0
    seconds: float = 0.0
    depth: dict = field(default_factory=dict)   # accepted drafts per cycle -> count

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("cycles", "proposed", "accepted_draft", "full", "partial", "miss_first",
                                           "no_draft", "scheduler_skips")}
        d["first_tokens"] = self.cycles
        d["accept_rate"] = self.accepted_draft / self.proposed if self.proposed else 0.0
        d["avg_accept"] = self.accepted_draft / self.cycles if self.cycles else 0.0
        d["tok_s"] = self.generated / self.seconds if self.seconds > 0 else 0.0
        d["depth"] = {str(k): v for k, v in sorted(self.depth.items())}
        return d

    def line(self) -> str:
        d = self.as_dict()
        return (f"ds4: DSpark stats cycles={d['cycles']} first_tokens={d['first_tokens']} proposed={d['proposed']} "
                f"accepted_draft={d['accepted_draft']} accept_rate={100 * d['accept_rate']:.2f}% "
                f"avg_accept={d['avg_accept']:.3f} full={d['full']} partial={d['partial']} "
                f"miss_first={d['miss_first']} no_draft={d['no_draft']} scheduler_skips={d['scheduler_skips']} "
                f"t/s={d['tok_s']:.2f}")


def _accept(draft: int, logits: np.ndarray, params: SamplingParams, exact: bool, rng) -> bool:
    if not exact:  # greedy and opportunistic: the draft must be the target's argmax
        return draft == argmax(logits)
    return rng.random() < filtered_probs(logits, params)[draft]


def _residual(logits: np.ndarray, draft: int, params: SamplingParams, rng) -> int:
    p = filtered_probs(logits, params)
    p[draft] = 0.0
    total = p.sum()
    if total <= 0:  # the draft held all the mass; it cannot have been rejected, but stay safe
        return draft
    return int(rng.choice(p.size, p=p / total))


def generate(engine, prompt: list[int], n_tokens: int, params: SamplingParams, rng: np.random.Generator,
             drafter: Drafter | None = None, exact: bool = False, stop_ids=frozenset(),
             scheduler: Scheduler | None = None, on_token=None, mode=None,
             on_prefill=None) -> tuple[list[int], SpecStats]:
    """Generates up to n_tokens after `prompt`; stops after a token in stop_ids, or when on_token(t)
    returns True. With a drafter, speculates as described above; without one, plain decoding.
    mode(out) -> SamplingParams, when given, is asked for the parameters after every emitted token;
    on_prefill(done, total) after every prefill chunk (True cancels)."""
    stats, sched = SpecStats(), scheduler or Scheduler.from_env()
    out: list[int] = []
    budget = min(n_tokens, engine.max_context - len(prompt))
    logits = engine.prefill(prompt) if on_prefill is None else engine.prefill(prompt, on_chunk=on_prefill)
    if drafter is not None:
        drafter.begin(engine, prompt)
    t0 = time.perf_counter()
    current = params

    def emit(t: int) -> bool:
        """Appends t; True when generation must end. Updates the sampling mode."""
        nonlocal current
        out.append(t)
        stop = on_token is not None and on_token(t)
        if mode is not None:
            current = mode(out)
        return bool(stop) or t in stop_ids or len(out) >= budget

    done = budget <= 0
    while not done:
        remaining = budget - len(out)
        room = min(remaining, engine.max_context - engine.pos)
        exact_now = exact and current.temperature > 0
        proposal = None
        if drafter is not None:
            if sched.should_propose(remaining):
                stats.cycles += 1
                proposal = drafter.draft(engine, out[-1] if out else prompt[-1],
                                         min(drafter.block_size, engine.max_verify, room))
            elif remaining >= sched.tail_min_tokens:
                stats.scheduler_skips += 1
        drafts = proposal.tokens if proposal is not None else []
        for i, d in enumerate(drafts):  # nothing is proposed past an end-of-sequence token
            if d in stop_ids:
                drafts = drafts[:i + 1]
                break
        if proposal is not None and not drafts:
            stats.no_draft += 1
            sched.record(None, proposal.first_confidence)
        if drafts and _accept(drafts[0], logits, current, exact_now, rng):
            stats.proposed += len(drafts)
            rows = engine.verify(drafts)
            k = 1
            while k < len(drafts) and _accept(drafts[k], rows[k - 1], current, exact_now, rng):
                k += 1
            stats.accepted_draft += k
            stats.depth[k] = stats.depth.get(k, 0) + 1
            stats.full += k == len(drafts)
            stats.partial += k < len(drafts)
            sched.record(k)
            block_params, kept = current, 0
            while kept < k and not done:
                done = emit(drafts[kept])
                kept += 1
                if current != block_params:
                    break  # the block crossed a mode boundary: keep it up to here
            engine.commit(kept)
            if drafter is not None:
                drafter.observe(engine, drafts[:kept], speculative=True)
            logits = rows[kept - 1]
            if done or kept == len(drafts) or current != block_params or not exact_now:
                continue
            token = _residual(logits, drafts[kept], current, rng)   # exact: the rejected draft's residual
        elif drafts:
            stats.proposed += len(drafts)
            stats.miss_first += 1
            stats.depth[0] = stats.depth.get(0, 0) + 1
            sched.record(0)
            token = _residual(logits, drafts[0], current, rng) if exact_now else sample(logits, current, rng)
        else:
            token = sample(logits, current, rng)
        if emit(token):
            break
        logits = engine.decode(token)
        if drafter is not None:
            drafter.observe(engine, [token], speculative=False)
    stats.generated = len(out)
    stats.seconds = time.perf_counter() - t0
    return out, stats


def median_seconds(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def verify_cost(engine, max_k: int = 6, repeats: int = 5) -> dict[int, float]:
    """Median time of verify(k) relative to one decode step, for k = 1..max_k."""
    def timed(fn):
        return median_seconds(fn, repeats)

    engine.reset()
    engine.prefill([1, 2, 3, 4])

    def one_decode():
        engine.decode(5)
        engine.rewind(1)  # keep the position: the same row is rewritten each time

    base = timed(one_decode)
    out = {}
    for k in range(1, max_k + 1):
        def one_verify(k=k):
            engine.verify([5] * k)
            engine.rollback()
        out[k] = timed(one_verify) / base if base > 0 else math.nan
    return out
