"""Whether speculation pays here, decided from costs and counts rather than the clock.

What a cycle costs is measured once per artifact, drafter and machine (`measure`: a few calls at
load, kept in the cache beside the kernels, measured again when the artifact, ds4tvm or the thread
count changes): a verify of w rows and the drafter's calls of a proposal (its guess, drafts, and
the observation of the rows it verified), in units of a plain decode step; and what the drafter
costs in a plain step (it still observes the committed row); and a short generation of the pair in
each sampled acceptance mode (opportunistic, exact) gives the acceptance a sampled generation
starts from (`SpecCosts.seen`). The loop then asks, every cycle, how many tokens to propose
(`CostModel.plan`): the length whose expected tokens per unit of cost is highest, from the
acceptance seen so far at each position of a proposal, or none when no length beats a plain step.
The decision follows from the cost table and the tokens alone (a sampled generation's from the
table and its own tokens: `fresh`), so it acts at every temperature and a seeded run gives the
same text every time, whatever ran before it; starting from the calibration's acceptance rather
than from nothing spares each sampled generation a probe of a drafter the pair has already shown
not to pay (5-6% of a 96-token run of the demo pair). Greedy generations share one model, which
starts from nothing seen: the calibration's dummy prompt says little about real text, and their
own evidence carries over. A drafter the model turned off is asked again after a number of plain
steps that doubles while asking keeps not paying, so a drafter that starts agreeing is found
again, at a cost that fades.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import __version__

OVERHEAD = 0.01   # of the time, what probing a drafter that does not pay may cost
CALIBRATION_TOKENS = 24
# The calibration's cycles count as at most this many observed cycles: they come from a dummy
# prompt, so a generation's own proposals (or probes) outweigh them after a few cycles.
PRIOR_CYCLES = 8
MODES = ("opportunistic", "exact")   # the sampled acceptance modes the calibration measures


@dataclass
class SpecCosts:
    """Costs in units of one plain decode step (decode_s seconds): verify[w] of w rows, propose
    (the drafter's calls in a cycle that proposes), observe (the drafter's calls in a plain step);
    seen[mode] = [offered, accepted]: the calibration's counts per position (as CostModel keeps
    them) in each sampled acceptance mode (MODES)."""
    decode_s: float
    verify: dict[int, float]
    propose: float
    observe: float = 0.0
    seen: dict = field(default_factory=dict)

    def verify_of(self, rows: int) -> float:
        return self.verify.get(rows, max(self.verify.values()) if self.verify else float(rows))


@dataclass
class CostModel:
    """plan() -> how many tokens the next proposal may hold (0: decode without asking); record()
    after each cycle. Position i of a proposal (its guess first, for a drafter that guesses), once
    every position before it was accepted, is proposed and accepted with probability p_i (a
    drafter may propose fewer tokens than it may: DSpark cuts its block at low confidence),
    estimated from the counts (`p`)."""
    costs: SpecCosts
    max_tokens: int
    offered: list = field(default_factory=list)    # cycles that accepted every position before i
    accepted: list = field(default_factory=list)
    mode: str | None = None       # a sampled one (MODES): its counts start from costs.seen[mode]
    guesses: bool = False
    plain_steps: int = 0          # taken since the drafter was last asked
    wait: int = -1                # plain steps before asking again (-1: while proposing pays)
    max_wait: int = 4096
    skips: int = 0
    forced: bool = False          # ask every cycle for as much as fits, still counting what is accepted
    # best_length() as of the last proposal recorded: plain steps change no count, and recomputing it
    # at every one (a few hundred Python operations) cost 3-4% of a 0.8 ms decode step (ds4 demo)
    _best: int | None = None

    def __post_init__(self):
        if not self.offered:
            self.offered, self.accepted = self._prior()

    def _prior(self) -> tuple[list, list]:
        """The calibration's counts in this mode, weighed as at most PRIOR_CYCLES cycles."""
        offered, accepted = self.costs.seen.get(self.mode, ([], []))
        scale = min(1.0, PRIOR_CYCLES / offered[0]) if offered and offered[0] else 0.0
        pad = [0.0] * self.max_tokens
        return ([scale * x for x in offered[:self.max_tokens]] + pad)[:self.max_tokens], \
               ([scale * x for x in accepted[:self.max_tokens]] + pad)[:self.max_tokens]

    def fresh(self, mode: str) -> "CostModel":
        """The same costs, and the calibration's acceptance in `mode` as all it has seen: a sampled
        generation plans from the table and its own tokens only, so that a seeded one gives the
        same text whatever came before it (a server's other requests)."""
        return CostModel(self.costs, self.max_tokens, mode=mode)

    def p(self, i: int) -> float:
        """Position i's acceptance, optimistic by one: as if the next proposal reaching it were
        accepted. A drafter nobody has seen yet is tried; each refusal lowers the estimate until
        proposing stops paying (one or two proposals for a drafter that never agrees)."""
        return (self.accepted[i] + 1) / (self.offered[i] + 1)

    def tokens_per_cost(self, length: int) -> float:
        """Expected tokens per unit of cost of a cycle proposing `length` tokens (0: a plain step)."""
        c = self.costs
        if length == 0:
            return 1 / (1 + c.observe)
        if not self.guesses and length >= self.max_tokens:   # t and the drafts fill one verify
            return 0.0
        chain, gained = 1.0, 0.0
        for i in range(length):
            chain *= self.p(i)
            if i > 0 or not self.guesses:   # a right guess is the token the step chooses anyway
                gained += chain
        if self.guesses:   # a wrong guess costs a decode; a right one the verify of the guess and the rest
            cost = c.propose + self.p(0) * c.verify_of(length) + (1 - self.p(0)) * 1.0
        else:
            cost = c.propose + c.verify_of(length + 1)
        return (1 + gained) / cost

    def best_length(self) -> int:
        rates = [self.tokens_per_cost(n) for n in range(self.max_tokens + 1)]
        return max(range(len(rates)), key=lambda n: (rates[n], -n))

    def explain(self, name: str) -> str:
        """One line: whether speculating pays here, and why (the costs and the acceptance so far)."""
        best = max(range(1, self.max_tokens + 1), key=self.tokens_per_cost)
        gain = self.tokens_per_cost(best) / self.tokens_per_cost(0)
        rows = best if self.guesses else best + 1
        c = self.costs
        return (f"speculation {'pays' if gain > 1 else 'does not pay'} here: {name}'s calls for a proposal cost "
                f"{c.propose:.2f} decode steps and a verify of {rows} rows {c.verify_of(rows):.2f}; at the "
                f"acceptance seen so far ({', '.join(f'{self.p(i):.2f}' for i in range(best))} by position) a "
                f"proposal of {best} gives {gain:.2f}x the tokens per second of plain steps")

    def plan(self) -> int:
        if self.forced:
            return self.max_tokens
        if self._best is None:
            self._best = self.best_length()
        best = self._best
        if best > 0:
            self.wait, self.plain_steps = -1, 0
            return best
        if self.wait < 0:   # proposing stopped paying: the first probe waits as the later ones do
            self._schedule_probe()
        if self.plain_steps < self.wait:
            self.plain_steps += 1
            self.skips += 1
            return 0
        # a probe, the length worth the most; the next one after enough plain steps that probing
        # costs at most OVERHEAD of the time, twice as many each time it does not pay
        self._schedule_probe()
        self.plain_steps = 0
        return max(range(1, self.max_tokens + 1), key=self.tokens_per_cost)

    def _schedule_probe(self) -> None:
        probe = max(range(1, self.max_tokens + 1), key=self.tokens_per_cost)
        extra = self.costs.propose + self.costs.verify_of(probe + (not self.guesses)) - 1
        self.wait = min(self.max_wait, max(2 * self.wait, math.ceil(max(extra, 0) / OVERHEAD)))

    def record(self, guessed: bool, planned: int, proposed: int, accepted: int) -> None:
        """A cycle that could propose `planned` tokens proposed `proposed` (its guess included), of
        which the first `accepted` were taken; planned 0: a plain step."""
        if planned == 0:
            return
        self._best = None
        self.guesses = self.guesses or guessed
        for i in range(min(planned, self.max_tokens, accepted + 1)):
            self.offered[i] += 1
            self.accepted[i] += i < accepted


class _Timed:
    """A drafter whose calls are timed: the seconds of the cycle so far (calibration only)."""

    def __init__(self, drafter):
        self.drafter, self.seconds = drafter, 0.0

    def __getattr__(self, name):
        attr = getattr(self.drafter, name)
        if name not in ("guess", "draft", "observe", "begin"):
            return attr

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


class _Calibration:
    """The loop's model while costs are measured: every other cycle proposes as much as it can; the
    drafter's seconds are kept per kind of cycle."""

    def __init__(self, timed: _Timed, max_tokens: int):
        self.timed, self.max_tokens, self.cycle = timed, max_tokens, 0
        self.asked: list[float] = []
        self.plain: list[float] = []

    def plan(self) -> int:
        self.timed.seconds = 0.0
        self.cycle += 1
        return self.max_tokens if self.cycle % 2 else 0

    def record(self, guessed: bool, planned: int, proposed: int, accepted: int) -> None:
        if not self.cycle % 2:
            self.plain.append(self.timed.seconds)
        elif proposed:   # the drafter's own back-off may have declined: not a proposal's cost
            self.asked.append(self.timed.seconds)


class _Counting(CostModel):
    """The calibration's model in the sampled modes: forced, counting what is accepted, and the
    same instance for a sampled generation (no `fresh` copy)."""

    def fresh(self, mode: str) -> "CostModel":
        return self


def measure(engine, make_drafter, max_tokens: int) -> SpecCosts:
    """The cost table, from calls on a short prompt of the engine's current sequence (reset
    before and after): decodes and verifies timed directly, then a greedy generation in which every
    other cycle proposes, the drafter's calls timed, then one generation in each sampled mode with
    every cycle proposing, for its acceptance. make_drafter() builds drafters for this (their
    counters change)."""
    import numpy as np

    from .sampler import SamplingParams
    from .speculative import generate, step_seconds

    decode_s, ratios = step_seconds(engine, min(engine.max_verify, max_tokens + 1))
    prompt = [i % engine.n_vocab for i in range(1, 9)]
    engine.reset()
    timed = _Timed(make_drafter())
    cal = _Calibration(timed, max_tokens)
    generate(engine, prompt, CALIBRATION_TOKENS, SamplingParams(temperature=0.0), np.random.default_rng(0),
             drafter=timed, model=cal)
    seen = {}
    for mode in MODES:
        engine.reset()
        counts = _Counting(SpecCosts(0.0, {}, 0.0), max_tokens, forced=True)
        generate(engine, prompt, CALIBRATION_TOKENS, SamplingParams(temperature=1.0), np.random.default_rng(0),
                 drafter=make_drafter(), model=counts, exact=mode == "exact")
        seen[mode] = [counts.offered, counts.accepted]
    engine.reset()
    asked = statistics.mean(cal.asked) if cal.asked else 0.0
    plain = statistics.mean(cal.plain) if cal.plain else 0.0
    return SpecCosts(decode_s, ratios, asked / decode_s, plain / decode_s, seen)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|threads={os.environ.get('TVM_NUM_THREADS', '')}|{__version__}"


def _path(engine, name: str) -> Path:
    from ..cache import kernel_cache

    return kernel_cache().parent / "costs" / f"{engine.identity[:16]}-{name.replace(' ', '_')}.json"


def costs_for(engine, drafter_name: str, make_drafter, max_tokens: int) -> SpecCosts:
    """The cost table of this artifact, drafter and machine: read from the cache, or measured
    (with a drafter make_drafter() builds for it) and kept there."""
    path, machine = _path(engine, drafter_name), _machine()
    try:
        data = json.loads(path.read_text())
        if data.get("machine") == machine and data.get("max_tokens") == max_tokens:
            c = data["costs"]
            seen = {m: c["seen"][m] for m in MODES}
            return SpecCosts(c["decode_s"], {int(k): v for k, v in c["verify"].items()}, c["propose"],
                             c["observe"], seen)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure(engine, make_drafter, max_tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"machine": machine, "max_tokens": max_tokens, "costs": asdict(costs)}))
        os.replace(tmp, path)
    except OSError:
        pass
    return costs


_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # engine -> {drafter name: CostModel}


def model_for(engine, drafter, make_drafter) -> CostModel | None:
    """The engine's cost model for this drafter, kept over its generations (what they accepted
    carries over); None without a drafter, or with DS4_SPEC_COST_MODEL=0 (the drafter asked every
    cycle, its own back-off alone). Measuring the costs resets the engine's sequence: call it at
    load, before a prompt is in the state."""
    if drafter is None or os.environ.get("DS4_SPEC_COST_MODEL", "1") in ("0", "off", "false"):
        return None
    models = _MODELS.setdefault(engine, {})
    if drafter.NAME not in models:
        models[drafter.NAME] = CostModel(costs_for(engine, drafter.NAME, make_drafter, engine.max_verify),
                                         engine.max_verify)
    return models[drafter.NAME]
