"""The speculative loop: identity, rollback, exactness of exact sampling, opportunistic bias, the
tool boundary, for drafters that guess the next token (DSpark's way) and drafters that draft after
the chosen token (MTP's way); and the DSpark scheduler's back-off rules."""

import numpy as np
import pytest
from fakes import ScriptedDrafter, TableEngine

from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.drafters.dspark import Scheduler
from ds4tvm.runtime.speculative import generate

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engines(tiny_artifact):
    from ds4tvm.runtime.engine import Engine

    return Engine(tiny_artifact), Engine(tiny_artifact)


PROMPT = [7, 8, 9, 10, 11]


def _plain(engine, n):
    engine.reset()
    return generate(engine, PROMPT, n, GREEDY, np.random.default_rng(0))[0]


@pytest.mark.compile
@pytest.mark.parametrize("mode", ["guess", "after"])
@pytest.mark.parametrize("block", [1, 2, 3, 5])
def test_identity_agreeing_drafter_accepts_everything(engines, block, mode):
    spec_engine, plain_engine = engines
    want = _plain(plain_engine, 200)
    spec_engine.reset()
    got, stats = generate(spec_engine, PROMPT, 200, GREEDY, np.random.default_rng(0),
                          drafter=ScriptedDrafter(want, block_size=block, mode=mode), stop_ids=frozenset())
    assert got == want
    c = stats.counters
    if mode == "after" and block == 1:   # nothing to draft after the chosen token: plain decoding
        assert c["proposed"] == 0
        return
    assert c["proposed"] > 0 and c["accepted_draft"] == c["proposed"] and c["miss_first"] == 0
    assert c["partial"] == 0 and c["full"] == sum(c["depth"].values())


@pytest.mark.compile
@pytest.mark.parametrize("mode,wrong_at", [("guess", 0), ("guess", 1), ("guess", 2), ("guess", 4),
                                           ("after", 0), ("after", 2)])
def test_rollback_disagreeing_drafter_equals_target_only(engines, mode, wrong_at):
    spec_engine, plain_engine = engines
    want = _plain(plain_engine, 60)
    spec_engine.reset()
    got, stats = generate(spec_engine, PROMPT, 60, GREEDY, np.random.default_rng(0),
                          drafter=ScriptedDrafter(want, block_size=5, wrong_at=wrong_at, mode=mode))
    assert got == want
    c = stats.counters
    if wrong_at == 0:
        assert c["miss_first"] > 0 and c["accepted_draft"] == 0
    else:
        assert c["partial"] > 0 and c["accepted_draft"] < c["proposed"]
    # The state after speculation equals the state reached without it: the next row is the same.
    assert spec_engine.pos == plain_engine.pos and spec_engine.history == plain_engine.history
    nxt = want[-1]
    np.testing.assert_array_equal(spec_engine.decode(nxt).logits, plain_engine.decode(nxt).logits)


def _law(params, runs, drafter_factory, exact, seed0):
    counts = {}
    for s in range(runs):
        eng = TableEngine(vocab=6, seed=3)
        out, _ = generate(eng, [1, 2], 2, params, np.random.default_rng(seed0 + s),
                          drafter=drafter_factory() if drafter_factory else None, exact=exact)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    return counts


def _exact_law(params):
    """The target's law of the two tokens, its filters applied by transformers' warpers (an
    implementation independent of ds4tvm's sampler)."""
    from hf_models import hf_sampling_probs

    eng = TableEngine(vocab=6, seed=3)
    p1 = hf_sampling_probs(eng.prefill([1, 2]).logits, params)
    law = {}
    for a in range(6):
        p2 = hf_sampling_probs(eng.table[2, a], params)
        for b in range(6):
            if p1[a] * p2[b] > 0:
                law[(a, b)] = p1[a] * p2[b]
    return law


@pytest.mark.parametrize("mode", ["guess", "after"])
@pytest.mark.parametrize("params", [SamplingParams(0.7, top_p=0.9, min_p=0.0),
                                    pytest.param(SamplingParams(0.7, min_p=0.1), marks=pytest.mark.slow)],
                         ids=["temp0.7-top_p0.9", "temp0.7-min_p0.1"])
def test_exact_sampling_keeps_the_law_of_plain_sampling(params, mode):
    from scipy.stats import chisquare

    runs = 10000   # per law (20000 before; halved for the default run's time)
    law = _exact_law(params)
    # Drafts that are sometimes right and sometimes wrong: a fixed scripted pair.
    spec = _law(params, runs, lambda: ScriptedDrafter([3, 1, 4, 1, 5], block_size=2, vocab=6, mode=mode,
                                                      tail_min_tokens=0), True, 1)
    plain = _law(params, runs, None, False, 10 ** 6)
    keys = sorted(law)
    assert set(spec) <= set(keys) and set(plain) <= set(keys)
    expected = np.array([law[k] for k in keys]) * runs
    for counts in (spec, plain):
        observed = np.array([counts.get(k, 0) for k in keys])
        p = chisquare(observed, expected * observed.sum() / expected.sum()).pvalue
        assert p > 0.01, (p, params)


def test_opportunistic_mode_is_biased_toward_greedy():
    """Opportunistic acceptance (the default at temp > 0) takes drafts equal to the argmax, so an
    argmax-proposing drafter makes greedy tokens more frequent than plain sampling does."""
    params = SamplingParams(1.0, min_p=0.0)
    eng = TableEngine(vocab=6, seed=3)
    greedy_first = int(np.argmax(eng.prefill([1, 2]).logits))
    runs = 4000
    spec = _law(params, runs, lambda: ScriptedDrafter([greedy_first] * 5, block_size=1, vocab=6, tail_min_tokens=0),
                False, 7)
    plain = _law(params, runs, None, False, 7)
    f_spec = sum(v for k, v in spec.items() if k[0] == greedy_first) / runs
    f_plain = sum(v for k, v in plain.items() if k[0] == greedy_first) / runs
    assert f_spec == 1.0 and f_plain < 0.9


def test_scheduler_backoff_rules():
    s = Scheduler()
    assert not s.should_propose(9) and s.should_propose(10)            # never in the last 10 tokens
    s.record(None, first_confidence=0.9)                               # empty proposal: skip 3
    assert [s.should_propose(100) for _ in range(4)] == [False, False, False, True]
    cold = Scheduler()
    cold.record(None, first_confidence=0.4)                            # nothing ever accepted, c0 <= 0.5: 7
    assert sum(not cold.should_propose(100) for _ in range(10)) == 7
    short = Scheduler()
    short.record(2)                                                    # accepted, never more than 2 at once
    short.record(None, first_confidence=0.9)                           # empty: skip 4
    assert sum(not short.should_propose(100) for _ in range(10)) == 4
    slow = Scheduler()
    for a in (1, 1, 2, 1):                                             # mean 1.25 < 1.5 over a window of 4
        slow.record(a)
    assert sum(not slow.should_propose(100) for _ in range(10)) == 2
    fine = Scheduler()
    for a in (3, 2, 2, 1):                                             # mean 2.0: no back-off
        fine.record(a)
    assert fine.should_propose(100)
    empty = Scheduler(no_draft_skip=0)
    for a in (None, 5, None, 5):                                       # half the attempts empty: 4
        empty.record(a, 0.9)
    assert sum(not empty.should_propose(100) for _ in range(10)) == 4
    off = Scheduler(enabled=False)
    off.record(None, 0.1)
    assert off.should_propose(100)


def _costs(propose: float, per_row: float, rows: int = 8):
    from ds4tvm.runtime.costs import SpecCosts

    return SpecCosts(decode_s=0.001, verify={w: 1 + per_row * (w - 1) for w in range(1, rows + 1)}, propose=propose)


def test_cost_model_rates_each_length_from_costs_and_per_position_acceptance():
    """Tokens per unit of cost, written out for one case: p_i = (accepted_i + 1) / (offered_i + 1)
    (optimistic by one); without a guess, L drafts give 1 + p0 + p0 p1 + ... tokens for propose +
    verify(L + 1); with a guess (position 0), a right one costs the verify of the guess and the
    rest, a wrong one a decode."""
    from ds4tvm.runtime.costs import CostModel

    m = CostModel(_costs(0.5, 0.2, 4), max_tokens=4, offered=[10, 6, 0, 0], accepted=[6, 3, 0, 0])
    p0, p1, p2 = 7 / 11, 4 / 7, 1.0
    assert m.tokens_per_cost(0) == 1.0
    assert m.tokens_per_cost(1) == pytest.approx((1 + p0) / (0.5 + 1.2))
    assert m.tokens_per_cost(2) == pytest.approx((1 + p0 + p0 * p1) / (0.5 + 1.4))
    assert m.tokens_per_cost(3) == pytest.approx((1 + p0 + p0 * p1 + p0 * p1 * p2) / (0.5 + 1.6))
    assert m.tokens_per_cost(4) == 0.0   # t and four drafts do not fit a verify of 4 rows
    m.guesses = True
    assert m.tokens_per_cost(3) == pytest.approx((1 + p0 * p1 + p0 * p1 * p2) / (0.5 + p0 * 1.4 + (1 - p0)))
    m.record(True, 3, 3, 2)    # the guess and the first draft accepted, the second not
    assert (m.offered[:3], m.accepted[:3]) == ([11, 7, 1], [7, 4, 0])
    m.record(True, 4, 2, 2)    # the drafter proposed 2 of 4: position 2 counts as not taken
    assert (m.offered, m.accepted) == ([12, 8, 2, 0], [8, 5, 0, 0])
    m.record(False, 2, 2, 2)   # all the plan allowed was accepted: nothing is known of position 2
    assert (m.offered, m.accepted) == ([13, 9, 2, 0], [9, 6, 0, 0])


def test_cost_model_stops_asking_where_proposals_do_not_pay_and_probes_at_a_bounded_cost():
    from ds4tvm.runtime.costs import OVERHEAD, CostModel

    cheap = CostModel(_costs(0.1, 0.05), max_tokens=8)
    assert cheap.plan() > 0                          # a drafter not seen yet is tried
    for _ in range(50):
        cheap.record(False, 7, 7, 7)                 # every draft accepted: the longest proposal
    assert cheap.plan() == 7
    wrong = CostModel(_costs(0.1, 0.05), max_tokens=8)
    for _ in range(200):
        wrong.record(False, 1, 1, 0)                 # the first draft never accepted: no length pays
    assert wrong.best_length() == 0
    dear = CostModel(_costs(3.0, 0.3), max_tokens=8)
    dear.record(False, 8, 8, 0)                      # one proposal, refused
    assert dear.best_length() == 0                   # then an expensive drafter is not asked
    probes = []
    for step in range(20000):
        n = dear.plan()
        if n:
            probes.append(step)
            dear.record(False, n, n, 0)              # never accepted
    first = probes[0]
    assert first >= (3.0 + 0.3 - 1) / OVERHEAD      # the first probe waits as the later ones do
    assert [b - a for a, b in zip(probes, probes[1:4])] == [2 * first + 1, 4 * first + 1, 8 * first + 1]
    assert len(probes) < 10 and dear.skips == 20000 - len(probes)


def test_loop_with_a_cost_model_keeps_target_only_output_and_seeded_sampling():
    """An agreeing drafter with a cost table that says it pays is asked every cycle; with one that
    says it does not, it is left out (the output unchanged at T=0); at T=1 two seeded runs give the
    same tokens (the model decides from costs and counts, not the clock)."""
    from ds4tvm.runtime.costs import CostModel

    eng = TableEngine(vocab=6, seed=3, max_context=128)
    eng.reset()
    want, _ = generate(eng, [1, 2], 80, GREEDY, np.random.default_rng(0))
    for costs, asked in ((_costs(0.1, 0.05), True), (_costs(4.0, 0.5), False)):
        eng.reset()
        model = CostModel(costs, eng.max_verify)
        got, stats = generate(eng, [1, 2], 80, GREEDY, np.random.default_rng(0), drafter=ScriptedDrafter(want),
                              model=model)
        assert got == want
        assert (stats.counters["cost_skips"] == 0) if asked else (stats.counters["cost_skips"] > 70)
        assert ("cost_skips=" in stats.line()) != asked
    hot = SamplingParams(temperature=1.0)
    shared = CostModel(_costs(0.6, 0.2), eng.max_verify)   # as a server keeps one over its requests
    runs = []
    for prompt in ([1, 2], [3, 4], [1, 2]):
        eng.reset()
        out, _ = generate(eng, prompt, 40, hot, np.random.default_rng(5), drafter=ScriptedDrafter(want),
                          model=shared)
        runs.append(out)
        for _ in range(30):                          # what the model saw before changes nothing at T=1
            shared.record(False, 7, 7, 0)
    assert runs[0] == runs[2] != runs[1]


def test_costs_are_measured_once_and_kept(monkeypatch, tmp_path):
    """measure() on the engine's sequence (reset after), then read back from the cache while the
    artifact and the machine are the same."""
    from ds4tvm.runtime import costs

    monkeypatch.setenv("DS4TVM_CACHE", str(tmp_path))
    eng = TableEngine(vocab=6, seed=3, max_context=128)
    eng.identity = "ab" * 32
    want = [i % 6 for i in range(60)]
    measured = costs.measure(eng, lambda: ScriptedDrafter(want), 4)
    assert eng.pos == 0 and measured.decode_s > 0 and set(measured.verify) == {1, 2, 3, 4, 5}
    assert set(measured.seen) == set(costs.MODES)
    calls = []
    real = costs.measure
    monkeypatch.setattr(costs, "measure", lambda *a: calls.append(1) or real(*a))
    first = costs.costs_for(eng, "Scripted", lambda: ScriptedDrafter(want), 4)
    again = costs.costs_for(eng, "Scripted", lambda: ScriptedDrafter(want), 4)
    assert calls == [1] and again == first


class ArgmaxDrafter(ScriptedDrafter):
    """Guesses the table's most likely next token and drafts its most likely successor."""

    def __init__(self, engine):
        super().__init__([], block_size=2, vocab=engine.n_vocab, tail_min_tokens=0)

    def guess(self, engine, remaining):
        seq = engine.tokens[:engine.pos]
        t = int(np.argmax(engine._row(seq)))
        self.block = [t, int(np.argmax(engine._row(seq + [t])))]
        return t


def test_calibration_counts_the_acceptance_of_each_mode_and_sampled_generations_start_from_it():
    """measure() counts what the drafter's proposals got in each sampled mode (a drafter that
    always proposes what the target's row favours most is accepted more often in opportunistic
    mode, where a draft must be the argmax, than in exact mode, where the sample must be it). A
    sampled generation (a fresh model per generation) starts from its mode's counts, weighed as at
    most PRIOR_CYCLES cycles: where the calibration saw nothing accepted, a dear drafter is not
    probed at the first cycle of every generation, as it was when each started from nothing; the
    shared greedy model starts from nothing seen."""
    from ds4tvm.runtime import costs
    from ds4tvm.runtime.costs import CostModel

    eng = TableEngine(vocab=6, seed=3, max_context=128)
    seen = costs.measure(eng, lambda: ArgmaxDrafter(eng), 4).seen
    (offered, accepted), (x_offered, x_accepted) = seen["opportunistic"], seen["exact"]
    assert accepted[0] == offered[0] >= 10 and 0 < x_accepted[0] < x_offered[0]

    refused = [[30.0, 0, 0, 0, 0, 0, 0, 0], [0.0] * 8]
    table = _costs(1.5, 0.3)
    assert CostModel(table, 8).fresh("opportunistic").plan() > 0      # nothing seen: probed at once
    table.seen = {m: refused for m in costs.MODES}
    m = CostModel(table, 8).fresh("opportunistic")
    assert m.offered[0] == costs.PRIOR_CYCLES and m.plan() == 0
    assert CostModel(table, 8).plan() > 0
    eng.reset()
    hot = SamplingParams(temperature=1.0)
    _, stats = generate(eng, [1, 2], 40, hot, np.random.default_rng(1), drafter=ArgmaxDrafter(eng),
                        model=CostModel(table, eng.max_verify))
    assert stats.counters["cost_skips"] == 40 and stats.counters["cycles"] == 0
    table.seen = {m: [[30.0] * 8, [30.0] * 8] for m in costs.MODES}   # always accepted
    assert CostModel(table, 8).fresh("exact").plan() == 7


def test_drafter_owns_its_stats():
    eng = TableEngine(vocab=6, seed=3)
    out, stats = generate(eng, [1, 2], 40, GREEDY, np.random.default_rng(0),
                          drafter=ScriptedDrafter([], empty=True, vocab=6))
    # asked while 40..10 tokens remain (silent in the last 10)
    assert len(out) == 40 and stats.counters["no_draft"] == 31 and stats.counters["proposed"] == 0
    assert stats.line().startswith("ds4: scripted stats proposed=0 t/s=")


def _boundary_engine():
    """Next-token law set by the last token: 0 -> mostly 2, 2 -> mostly 5, 5 -> 1 (argmax, 0.5)
    or 2 (0.45). Token 5 is the mode boundary (think: the token that opens a tool-call block)."""
    eng = TableEngine(vocab=6, max_context=64, max_verify=8)
    by_last = {0: [.05, .05, .6, .1, .1, .1], 2: [.05, .2, .05, .05, .05, .6],
               5: [.0125, .5, .45, .0125, .0125, .0125]}
    for b in range(6):
        eng.table[:, b] = np.log(by_last.get(b, [.1, .3, .2, .1, .1, .2]))
    return eng


def test_tool_boundary_rewinds_the_block_and_resamples_the_boundary_token_greedily():
    """Exact sampling accepts a block [2, 5, 2, ...]; token 5 switches to greedy mode, so the 2
    after it (not the argmax of its row) must not stand: the block is cut after 5, and the token
    there is evaluated again under greedy sampling (-> 1), as the server does at a tool call."""
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    script = [2, 5] * 16
    prompt = [0, 0]

    def mode(out):
        return GREEDY if 5 in out else params

    crossed_without_mode, rewound = 0, 0
    for seed in range(40):
        control, _ = generate(_boundary_engine(), prompt, 12, params, np.random.default_rng(seed),
                              drafter=ScriptedDrafter(script, block_size=5, tail_min_tokens=0), exact=True)
        if 5 in control:
            crossed_without_mode += control[control.index(5) + 1:][:1] == [2]
        engine, drafter = _boundary_engine(), ScriptedDrafter(script, block_size=5, tail_min_tokens=0)
        kept = []
        commit = engine.commit
        engine.commit = lambda k: (kept.append(k), commit(k))
        out, stats = generate(engine, prompt, 12, params, np.random.default_rng(seed), drafter=drafter,
                              exact=True, mode=mode)
        # accepted drafts that were not committed: a block was cut back at the boundary
        rewound += stats.counters["accepted_draft"] > sum(kept)
        if 5 not in out:
            continue
        b = out.index(5)
        seq = prompt + out
        for i in range(len(prompt) + b + 1, len(seq)):   # greedy from the boundary on
            assert seq[i] == int(np.argmax(engine.table[seq[i - 2], seq[i - 1]])), (seed, out)
        # the engine and the drafter hold exactly the emitted tokens (the rest was rolled back)
        n = engine.pos - len(prompt)
        assert engine.tokens[:engine.pos] == seq[:engine.pos] and len(out) - 1 <= n <= len(out)
        assert drafter.observed == out[:len(drafter.observed)] and len(out) - 1 <= len(drafter.observed)
    # without the mode, exact sampling keeps a non-greedy 2 after the boundary in many runs; with
    # it, accepted blocks were cut back at the boundary in many runs
    print(f"non-greedy after the boundary without the mode: {crossed_without_mode}/40, rewound: {rewound}/40")
    assert crossed_without_mode >= 5 and rewound >= 5


@pytest.mark.compile
def test_prefill_reports_chunks_and_can_be_cancelled(engines):
    from ds4tvm.errors import Cancelled

    engine = engines[0]
    engine.reset()
    seen = []
    generate(engine, list(range(20, 320)), 1, GREEDY, np.random.default_rng(0),
             on_prefill=lambda done, total: seen.append((done, total)))
    assert seen == [(engine.chunk, 300), (300, 300)]
    engine.reset()
    with pytest.raises(Cancelled):
        generate(engine, list(range(20, 320)), 1, GREEDY, np.random.default_rng(0),
                 on_prefill=lambda done, total: True)
    assert engine.pos == engine.chunk   # stopped after the first chunk
