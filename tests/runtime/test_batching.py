"""Continuous batching (runtime/scheduler.py, Engine.decode_batch): a batched decode gives every
sequence the logits a decode of it alone gives, bit for bit; generations sharing the engine
through the scheduler, at temperature 0 and seeded, with and without a drafter, give what each
gives alone; one request's error stays its own."""

import threading

import numpy as np
import pytest

from ds4tvm.errors import Ds4Error
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.scheduler import Scheduler
from ds4tvm.runtime.speculative import generate

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    from ds4tvm.runtime.engine import Engine

    return Engine(tiny_artifact)


def _prompts(n_vocab: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, n_vocab, size=n).tolist() for n in lengths]


def test_batched_decode_equals_decode_bit_for_bit(engine):
    assert engine.max_batch == 3 and "decode_batch3" in engine.functions
    prompts = _prompts(engine.n_vocab, (3, 70, 11))
    alone = []
    for p in prompts:   # each sequence on its own: prefill, then decodes of its own greedy tokens
        seq = engine.new_sequence()
        engine.attach(seq)
        engine.prefill(p)
        rows, t = [], p[-1]
        for _ in range(5):
            step = engine.decode(t)
            rows.append((step.logits, step.outputs["hidden"]))
            t = int(np.argmax(step.logits))
        alone.append(rows)
    seqs = []
    for p in prompts:
        seqs.append(engine.new_sequence())
        engine.attach(seqs[-1])
        engine.prefill(p)
    tokens = [p[-1] for p in prompts]
    for i in range(5):
        n = 3 if i % 2 == 0 else 2   # batches of 3 and of 2 (the third sequence waits a step, then catches up)
        steps = engine.decode_batch(seqs[:n], tokens[:n])
        if n == 2:
            steps.append(engine.decode_batch(seqs[2:], tokens[2:])[0])
        for j, step in enumerate(steps):
            logits, hidden = alone[j][i]
            assert np.array_equal(step.logits, logits) and np.array_equal(step.outputs["hidden"], hidden), (i, j)
        tokens = [int(np.argmax(s.logits)) for s in steps]
    assert [s.pos for s in seqs] == [len(p) + 5 for p in prompts]


def test_batched_decode_checks_its_input(engine):
    seqs = [engine.new_sequence(), engine.new_sequence()]
    with pytest.raises(Ds4Error, match="distinct sequences"):
        engine.decode_batch([seqs[0], seqs[0]], [1, 2])
    with pytest.raises(Ds4Error, match="outside the vocabulary"):
        engine.decode_batch(seqs, [1, engine.n_vocab])
    seqs[1].pos = engine.max_context
    with pytest.raises(Ds4Error, match="exceed the compiled context"):
        engine.decode_batch(seqs, [1, 2])
    assert seqs[0].pos == 0   # nothing ran


def _together(scheduler, jobs: list) -> list:
    """Each job (prompt, temperature, seed, drafter) generated on its own thread through the scheduler."""
    out = [None] * len(jobs)

    def one(i, prompt, temp, seed, drafter):
        try:
            with scheduler.member(scheduler.engine.new_sequence()) as seq_engine:
                out[i] = generate(seq_engine, prompt, 20, SamplingParams(temperature=temp),
                                  np.random.default_rng(seed), drafter=drafter)[0]
        except Ds4Error as e:
            out[i] = e
    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _alone(engine, prompt, temp, seed, drafter):
    engine.attach(engine.new_sequence())
    return generate(engine, prompt, 20, SamplingParams(temperature=temp), np.random.default_rng(seed),
                    drafter=drafter)[0]


def test_generations_through_the_scheduler_equal_each_alone(engine):
    """Seven generations at once (more than a batch: two calls per round), prompts of 4 to 300
    tokens (prefilled in chunks between the others' steps), greedy and seeded sampling."""
    jobs = [(p, temp, seed, None) for seed, (p, temp) in
            enumerate(zip(_prompts(engine.n_vocab, (4, 300, 9, 33, 120, 6, 17)), [0, 1, 0, 1, 0.7, 0, 1]))]
    alone = [_alone(engine, *job) for job in jobs]
    scheduler = Scheduler(engine)
    try:
        assert _together(scheduler, jobs) == alone
        assert max(scheduler.stats.batches) == engine.max_batch and scheduler.stats.prefilled == 489
    finally:
        scheduler.close()


def test_one_request_out_of_context_fails_alone(engine):
    """A generation that runs into the context's end gets its error; the others in its batches finish."""
    long = _prompts(engine.n_vocab, (engine.max_context - 3,))[0]
    jobs = [(p, 0, 0, None) for p in _prompts(engine.n_vocab, (5, 8))]
    scheduler = Scheduler(engine)
    try:
        seq = engine.new_sequence()
        with scheduler.member(seq) as seq_engine:   # the failing one, beside two that finish
            seq_engine.prefill(long)
            results = []
            t = threading.Thread(target=lambda: results.extend(_together(scheduler, jobs)))
            t.start()
            for token in range(3):
                seq_engine.decode(token)
            with pytest.raises(Ds4Error, match="exceed the compiled context"):
                seq_engine.decode(3)
        t.join(timeout=300)
        assert results == [_alone(engine, *job) for job in jobs]
    finally:
        scheduler.close()


def test_drafters_speculate_inside_the_batch(demo_pair):
    """DSpark generations (each with its own drafter) beside target-only ones: every answer equals
    target-only decoding alone (the identity property), and the drafters' verifies ran."""
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.engine import Engine

    engine = Engine(demo_pair[2])
    prompt = demo_pair[3]
    prompts = [prompt, prompt[:-3], prompt[2:], prompt]
    drafters = [DSparkDrafter(engine), None, DSparkDrafter(engine), None]
    jobs = [(p, 0, 0, d) for p, d in zip(prompts, drafters)]
    alone = [_alone(engine, p, 0, 0, None) for p in prompts]
    scheduler = Scheduler(engine)
    try:
        assert _together(scheduler, jobs) == alone
        assert drafters[0].counters()["accepted_draft"] > 0
    finally:
        scheduler.close()
