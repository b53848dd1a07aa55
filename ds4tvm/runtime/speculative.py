"""The one speculative decoding loop, for every drafter (runtime/drafters/).

A cycle, with the target's distribution of the next position in hand (`logits`):
  1. choose the next token t from the target's logits, greedy or sampled; a drafter may offer its
     guess for t first (DSpark's draft 0), which is then checked for free;
  2. ask the drafter for drafts after t (an MTP layer reads t's embedding and the target's hidden
     state; DSpark continues its block when its guess was right);
  3. verify [t, *drafts] in one target pass (a plain decode when there is nothing to check): row i
     is the distribution after token i;
  4. accept the longest prefix of the drafts, commit t and it (append-only state: counters only);
  5. the row after the last accepted token gives the next cycle's logits; in exact mode a rejected
     draft is first excluded from it (the residual distribution).
Acceptance: greedy at temperature 0; opportunistic (drafts accepted when they equal the target
argmax, ordinary tokens sampled; biased toward greedy text, as in ds4); exact (the draft is a point
mass, accepted with its probability under the filtered target distribution, else the replacement
is drawn from the renormalised remainder, so the output law is that of plain sampling).

Structured outputs (runtime/grammar.py): with a grammar, every distribution of steps 1 and 4 is
masked first, as the grammar stands after the tokens before it, so a draft the grammar refuses is
never accepted and the law of exact sampling is that of plain sampling under the grammar.

Sampling modes (ds4-spec §6, the server's tool boundary): `mode(out)` may change the sampling
parameters after any emitted token (the server switches to greedy inside tool-call syntax). When
t itself crosses such a boundary its drafts are dropped; when an accepted draft does, the block is
cut back to it (commit of the tokens up to the boundary) and the next token is evaluated under the
new mode from the verifier row after the boundary token. The drafter owns its policy (DSpark's
back-off, MTP's margin skip) and its statistics line; a cost model (runtime/costs.py) says how
many tokens each cycle may propose, and leaves the drafter out where speculating does not pay.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import Ds4Error
from .sampler import SamplingParams, argmax, filtered_probs, sample


class Drafter(Protocol):
    NAME: str   # what it is called in its stats line, the server's start line and /props ("GLM MTP")

    def begin(self, engine, step, stop_ids) -> None:
        """The target has prefilled the prompt (`step`: its Step, with the named extra outputs)
        from position engine.pos - len(step rows); when that is > 0 (prefix reuse, runtime/prefix.py)
        its first row re-evaluates a kept position, whose drafter rows are in place."""

    def guess(self, engine, remaining: int) -> int | None:
        """A guess for the next token, or None; remaining: tokens left to generate."""

    def draft(self, engine, token: int, max_tokens: int) -> list[int]:
        """Up to max_tokens drafts for the positions after `token`, the one just chosen."""

    def observe(self, engine, step, tokens: list[int]) -> None:
        """The target committed `tokens`: the first len(tokens) rows of `step`."""

    def finish(self, engine) -> None:
        """The generation ended: whatever the drafter deferred is written into its states, which
        then hold every committed position (prefix reuse and checkpoints keep them)."""

    def result(self, accepted: int) -> None:
        """How many of this cycle's proposed tokens (guess included) the target accepted."""

    def counters(self) -> dict:
        """The drafter's statistics (`DraftCounters.as_dict()` and its own)."""

    def stats_line(self, tok_s: float) -> str:
        """Its one-line summary for stderr."""


@dataclass
class DraftCounters:
    """Counts every drafter keeps: cycles that proposed, tokens proposed and accepted (a guess
    counts as one), full and partial accepts, misses of the first token, accepted per cycle."""
    cycles: int = 0
    proposed: int = 0
    accepted_draft: int = 0
    full: int = 0
    partial: int = 0
    miss_first: int = 0
    depth: dict = field(default_factory=dict)

    def record(self, proposed: int, accepted: int) -> None:
        self.cycles += 1
        self.proposed += proposed
        self.accepted_draft += accepted
        self.full += accepted == proposed
        self.partial += 0 < accepted < proposed
        self.miss_first += accepted == 0
        self.depth[accepted] = self.depth.get(accepted, 0) + 1

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("cycles", "proposed", "accepted_draft", "full", "partial", "miss_first")}
        d["accept_rate"] = self.accepted_draft / self.proposed if self.proposed else 0.0
        d["avg_accept"] = self.accepted_draft / self.cycles if self.cycles else 0.0
        d["depth"] = {str(k): v for k, v in sorted(self.depth.items())}
        return d


def stats_line(name: str, d: dict, tok_s: float, **extra) -> str:
    """Every drafter's stats line, one format: `ds4: NAME stats` then the common counters of d
    (DraftCounters.as_dict), the drafter's own as key=value, and the decode speed."""
    common = (f"cycles={d['cycles']} proposed={d['proposed']} accepted_draft={d['accepted_draft']} "
              f"accept_rate={100 * d['accept_rate']:.2f}% avg_accept={d['avg_accept']:.3f}")
    own = "".join(f" {k}={v}" for k, v in extra.items())
    return f"ds4: {name} stats {common}{own} t/s={tok_s:.2f}"


@dataclass
class SpecStats:
    """What one generation did: tokens, time, and the drafter's counters (empty without one)."""
    generated: int = 0
    seconds: float = 0.0
    counters: dict = field(default_factory=dict)
    drafter: object = None

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**self.counters, "tok_s": self.tok_s}

    def line(self) -> str:
        if self.drafter is None:
            return f"ds4: generated={self.generated} t/s={self.tok_s:.2f}"
        skipped = self.counters.get("cost_skips", 0)
        return self.drafter.stats_line(self.tok_s) + (f" cost_skips={skipped}" if skipped else "")


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


def _until_stop(tokens: list[int], stop_ids) -> list[int]:
    """Nothing is proposed past an end-of-sequence token."""
    for i, d in enumerate(tokens):
        if d in stop_ids:
            return tokens[:i + 1]
    return tokens


def _choose(logits, guess: int | None, rejected: int | None, params: SamplingParams, exact: bool, rng) -> int:
    """The next token: in exact mode the residual of a draft the target just rejected; else the
    drafter's guess when the target accepts it (checked for free); else a sample (in exact mode,
    from the residual of the refused guess)."""
    if rejected is not None:
        return _residual(logits, rejected, params, rng)
    if guess is not None and _accept(guess, logits, params, exact, rng):
        return guess
    return _residual(logits, guess, params, rng) if guess is not None and exact else sample(logits, params, rng)


def _agreeing(drafts: list[int], rows: np.ndarray, params: SamplingParams, exact: bool, rng, constraint=None) -> int:
    """How many drafts the target accepts, in order: draft i is checked against row i (under a
    grammar, as the grammar masks it after the drafts before it, matched tentatively)."""
    k = 0
    while k < len(drafts) and _accept(drafts[k], _masked(constraint, rows[k]), params, exact, rng):
        if constraint is not None:
            constraint.accept(drafts[k])
        k += 1
    if constraint is not None:
        constraint.rollback(k)   # the accepted drafts are matched again as they are committed
    return k


def _masked(constraint, logits: np.ndarray) -> np.ndarray:
    return logits if constraint is None else constraint.mask(logits)


def generate(engine, prompt: list[int], n_tokens: int, params: SamplingParams, rng: np.random.Generator,
             drafter: Drafter | None = None, exact: bool = False, stop_ids=frozenset(), on_token=None, mode=None,
             on_prefill=None, on_prompt=None, model=None, constraint=None,
             on_choice=None) -> tuple[list[int], SpecStats]:
    """Generates up to n_tokens after `prompt`, of which the engine may hold a prefix already (runtime/prefix.py;
    the rest is prefilled); stops after a token in stop_ids, or when on_token(t) returns True. With a drafter,
    speculates as described above; without one, plain decoding. mode(out) -> SamplingParams, when given, is asked
    for the parameters after every emitted token; on_prefill(done, total) after every prefill chunk (True
    cancels); on_prompt() once the prompt is in the state (and the drafter's), before the first token (the server
    checkpoints there); model: how many tokens to ask the drafter for each cycle, none where speculating does not
    pay (runtime/costs.CostModel; `ds4 run`, `serve`, `bench` and `demo` pass the engine's; without one the
    drafter is asked every cycle). constraint: a grammar (runtime/grammar.Constraint) that masks every
    distribution the loop samples from or checks a draft against, and follows the emitted tokens.
    on_choice(t, row): before on_token, with the target's logits row t was chosen or accepted from (logprobs)."""
    out: list[int] = []
    budget = min(n_tokens, engine.max_context - len(prompt))
    if model is not None and params.temperature > 0:
        model = model.fresh("exact" if exact else "opportunistic")   # the table and this generation: seeds repeat
    step = _prefill(engine, prompt, drafter, stop_ids, on_prefill, on_prompt)
    t0 = time.perf_counter()
    logits, current, rejected = step.logits, params, None

    def emit(t: int, row: np.ndarray) -> bool:
        """Appends t (chosen from the logits row); True when generation must end. Updates the
        sampling mode."""
        nonlocal current
        out.append(t)
        if on_choice is not None:
            on_choice(t, row)
        if constraint is not None:
            constraint.accept(t)
        stop = on_token is not None and on_token(t)
        if mode is not None:
            current = mode(out)
        return bool(stop) or t in stop_ids or len(out) >= budget

    done, skipped = budget <= 0, 0
    while not done:
        exact_now, chosen_under = exact and current.temperature > 0, current
        planned = 0 if drafter is None else engine.max_verify if model is None else model.plan()
        skipped += drafter is not None and planned == 0
        # 1. choose t
        guess = drafter.guess(engine, budget - len(out)) if planned and rejected is None else None
        t, rejected = _choose(_masked(constraint, logits), guess, rejected, current, exact_now, rng), None
        if guess is not None and t != guess:
            drafter.result(0)
        if emit(t, logits):
            break
        # 2. drafts after t, unless a guess was wrong or t crossed a mode boundary
        drafts, kept, k = [], 0, 0
        if planned and guess in (None, t) and current == chosen_under:
            room = min(budget - len(out), engine.max_context - engine.pos - 1, engine.max_verify - 1,
                       planned - (guess is not None))
            drafts = _until_stop(drafter.draft(engine, t, room), stop_ids) if room > 0 else []
        if not drafts and guess != t:
            step = engine.decode(t)
        else:
            # 3-4. verify [t, *drafts], accept the longest agreeing prefix, commit
            step = engine.verify([t, *drafts])
            k = _agreeing(drafts, step.logits, current, exact_now, rng, constraint)
            drafter.result(k + (guess is not None))
            while kept < k and not done:
                done = emit(drafts[kept], step.logits[kept])
                kept += 1
                if current != chosen_under:
                    break  # an accepted draft crossed a mode boundary: keep the block up to it
            engine.commit(1 + kept)
            if exact_now and not done and kept == k < len(drafts) and current == chosen_under:
                rejected = drafts[k]
        if drafter is not None:
            drafter.observe(engine, step, [t, *drafts[:kept]])
            if model is not None:
                model.record(guess is not None, planned, (guess is not None) + len(drafts), (guess == t) + k)
        logits = step.logits[kept] if step.logits.ndim == 2 else step.logits
    if drafter is not None:
        drafter.finish(engine)   # timed: what it defers is work of this generation
    stats = SpecStats(len(out), time.perf_counter() - t0)
    if drafter is not None:
        stats.counters, stats.drafter = {**drafter.counters(), "cost_skips": skipped}, drafter
    return out, stats


def _prefill(engine, prompt: list[int], drafter, stop_ids, on_prefill, on_prompt):
    """The step after the prompt: what the engine does not hold of it prefilled, the drafter begun."""
    held = engine.pos
    if not held < len(prompt) or list(prompt[:held]) != engine.history:
        raise Ds4Error(f"generate: the engine holds {held} tokens that are not a proper prefix of the prompt")
    step = engine.prefill(prompt[held:], on_chunk=on_prefill)
    if drafter is not None:
        drafter.begin(engine, step, stop_ids)
    if on_prompt is not None:
        on_prompt()
    return step


def median_seconds(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def step_seconds(engine, max_k: int, repeats: int = 5) -> tuple[float, dict[int, float]]:
    """Median seconds of one decode step, and the median time of verify(k) relative to it for
    k = 1..max_k, on a short prompt in the engine's sequence (reset first; it holds the prompt
    after). Each call runs once untimed first: the first call of a function pays for its setup."""
    prompt = [i % engine.n_vocab for i in range(1, 9)]
    engine.reset()
    engine.prefill(prompt)

    def one_decode():
        engine.decode(prompt[0])
        engine.rewind(1)  # keep the position: the same row is rewritten each time

    def one_verify(k):
        engine.verify(prompt[:1] * k)
        engine.rollback()

    one_decode()
    base = median_seconds(one_decode, repeats)
    out = {}
    for k in range(1, max_k + 1):
        one_verify(k)
        out[k] = median_seconds(lambda k=k: one_verify(k), repeats) / base if base > 0 else math.nan
    return base, out


def verify_cost(engine, max_k: int = 6, repeats: int = 5) -> dict[int, float]:
    """Median time of verify(k) relative to one decode step, for k = 1..max_k."""
    return step_seconds(engine, max_k, repeats)[1]
