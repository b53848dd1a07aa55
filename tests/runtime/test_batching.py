"""Continuous batching (runtime/scheduler.py, Engine.decode_batch, prefill_batch and verify_batch):
a batched decode gives every sequence the logits a decode of it alone gives, a batched prefill a
chunk the logits its prefill gives, a batched verify each block the logits its verify gives, bit
for bit; generations sharing the engine
through the scheduler, at temperature 0 and seeded, with and without a drafter, give what each
gives alone; one request's error stays its own."""

import threading
import time

import numpy as np
import pytest
from batching import (alone, assert_batched_call_is_call, assert_batched_decode_is_decode,
                      assert_batched_prefill_is_prefill, assert_batched_verify_is_verify, assert_together_is_alone,
                      prompts, together)

from ds4tvm.errors import Ds4Error
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.scheduler import Scheduler
from ds4tvm.runtime.speculative import generate

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    from ds4tvm.runtime.engine import Engine

    return Engine(tiny_artifact)


def test_batched_decode_equals_decode_bit_for_bit(engine):
    assert engine.max_batch == 3 and "decode_batch3" in engine.functions
    assert_batched_decode_is_decode(engine, prompts(engine.n_vocab, (3, 70, 11)))
    assert_batched_decode_is_decode(engine, prompts(engine.n_vocab, (300, 2)))
    assert engine.decode_calls[3] >= 4 and engine.decode_calls[2] >= 4


def test_batched_prefill_equals_prefill_and_decodes_bit_for_bit(engine):
    assert_batched_prefill_is_prefill(engine, prompts(engine.n_vocab, (40, 70, 11)), chunk=32)
    assert_batched_prefill_is_prefill(engine, prompts(engine.n_vocab, (3, 5)), chunk=1)


def test_batched_verify_equals_verify_bit_for_bit(engine):
    """Blocks of one length, and of three, after prompts of different lengths."""
    assert "verify_batch3" in engine.functions and "verify_batch2" in engine.functions
    assert_batched_verify_is_verify(engine, prompts(engine.n_vocab, (40, 70, 11)), prompts(engine.n_vocab, (4, 4, 4), 6))
    assert_batched_verify_is_verify(engine, prompts(engine.n_vocab, (3, 130, 9)), prompts(engine.n_vocab, (1, 6, 3), 7))


def test_batched_verify_checks_its_input(engine):
    """Each bad input is one Ds4Error naming it, before any kernel runs: no sequence moves."""
    seqs = [engine.new_sequence(), engine.new_sequence()]
    with pytest.raises(Ds4Error, match="distinct sequences"):
        engine.verify_batch([seqs[0], seqs[0]], [[1], [2]])
    with pytest.raises(Ds4Error, match="distinct sequences"):
        engine.verify_batch(seqs, [[1]])
    with pytest.raises(Ds4Error, match="outside the vocabulary"):
        engine.verify_batch(seqs, [[1], [2, engine.n_vocab]])
    with pytest.raises(Ds4Error, match=f"verify takes 1..{engine.max_verify} tokens"):
        engine.verify_batch(seqs, [[1], []])
    with pytest.raises(Ds4Error, match=f"verify takes 1..{engine.max_verify} tokens"):
        engine.verify_batch(seqs, [[1], [2] * (engine.max_verify + 1)])
    seqs[1].pos = engine.max_context - 1
    with pytest.raises(Ds4Error, match="exceed the compiled context"):
        engine.verify_batch(seqs, [[1], [2, 3]])
    assert [s.pos for s in seqs] == [0, engine.max_context - 1] and [s.pending for s in seqs] == [0, 0]


def test_verify_blocks_arriving_together_share_a_call(engine):
    """Two generations' verify blocks in one round (both members, the round waiting for both) run
    as one batched verify, each given what its verify alone gives; then each commits its own rows."""
    ps, blocks = prompts(engine.n_vocab, (12, 30)), prompts(engine.n_vocab, (5, 2), 8)
    want = []
    for p, b in zip(ps, blocks):
        engine.attach(engine.new_sequence())
        engine.prefill(p)
        want.append(engine.verify(b).logits)
    scheduler, calls = Scheduler(engine, max_wait=30.0), engine.verify_calls[2]
    seqs, got, barrier = [engine.new_sequence() for _ in ps], [None, None], threading.Barrier(2)

    def one(i):
        with scheduler.member(seqs[i]) as seq_engine:
            seq_engine.prefill(ps[i])
            barrier.wait()   # both prefilled: the next round holds both blocks
            got[i] = seq_engine.verify(blocks[i]).logits
            seq_engine.commit(1)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        scheduler.close()
    assert engine.verify_calls[2] == calls + 1
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert [s.pos for s in seqs] == [13, 31] and [s.pending for s in seqs] == [0, 0]


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


def test_generations_through_the_scheduler_equal_each_alone(engine):
    """Seven generations at once (more than a batch: two calls per round), prompts of 4 to 300
    tokens (prefilled in chunks between the others' steps, or in their decode calls where those
    leave room: prefill_batch), greedy and seeded sampling."""
    jobs = [(p, temp, seed, None) for seed, (p, temp) in
            enumerate(zip(prompts(engine.n_vocab, (4, 300, 9, 33, 120, 6, 17)), [0, 1, 0, 1, 0.7, 0, 1]))]
    calls, prefilled = assert_together_is_alone(engine, jobs)
    assert max(calls) == engine.max_batch and prefilled == 489


def test_a_prompt_arriving_beside_a_decoding_generation_is_prefilled_in_its_calls(engine):
    """A prompt arriving while another generation decodes (200 tokens: longer than the prompt's
    chunks take) is prefilled in that generation's decode calls (prefill_batch2), and its last
    logits are those of a prefill alone, bit for bit."""
    a_prompt, b_prompt = prompts(engine.n_vocab, (4, 300))
    engine.attach(engine.new_sequence())
    want = engine.prefill(b_prompt).logits
    scheduler, beside = Scheduler(engine), engine.prefilled_beside_decodes
    seq_a, seq_b = engine.new_sequence(), engine.new_sequence()

    def decoding():
        with scheduler.member(seq_a) as seq_engine:
            generate(seq_engine, a_prompt, 200, SamplingParams(temperature=0.0), np.random.default_rng(0))

    t = threading.Thread(target=decoding)
    t.start()
    try:
        while seq_a.pos <= len(a_prompt):   # until it decodes
            time.sleep(0.001)
        with scheduler.member(seq_b) as seq_engine:
            got = seq_engine.prefill(b_prompt).logits
        t.join(timeout=300)
    finally:
        scheduler.close()
    assert np.array_equal(got, want)
    assert 0 < engine.prefilled_beside_decodes - beside <= len(b_prompt)


def test_one_request_out_of_context_fails_alone(engine):
    """A generation that runs into the context's end gets its error; the others in its batches finish."""
    long = prompts(engine.n_vocab, (engine.max_context - 3,))[0]
    jobs = [(p, 0, 0, None) for p in prompts(engine.n_vocab, (5, 8))]
    scheduler = Scheduler(engine)
    try:
        seq = engine.new_sequence()
        with scheduler.member(seq) as seq_engine:   # the failing one, beside two that finish
            seq_engine.prefill(long)
            results = []
            t = threading.Thread(target=lambda: results.extend(together(scheduler, jobs)))
            t.start()
            for token in range(3):
                seq_engine.decode(token)
            with pytest.raises(Ds4Error, match="exceed the compiled context"):
                seq_engine.decode(3)
        t.join(timeout=300)
        assert results == [alone(engine, *job) for job in jobs]
    finally:
        scheduler.close()


def test_drafters_speculate_inside_the_batch(demo_pair):
    """DSpark generations (each with its own drafter) beside target-only ones, greedy and sampled:
    every answer equals the same generation alone (greedy ones: target-only decoding's), and the
    drafters' drafts were accepted. Two sequences' proposals in one call (dspark_propose_batch2):
    each one's drafts and confidences as its own call's, bit for bit."""
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.engine import Engine

    engine = Engine(demo_pair[2])
    prompt = demo_pair[3]
    block, noise = engine.drafters["dspark"]["block_size"], engine.drafters["dspark"]["noise_token_id"]

    def proposal(e, step):   # the rings written from the prompt's captures, then a block after its last token
        e.call("dspark_observe", captured=step.outputs["captured"], start=0)
        return {"captured": step.outputs["captured"][-1:], "tokens": [e.history[-1]] + [noise] * (block - 1),
                "start": e.pos - 1}
    assert_batched_call_is_call(engine, "dspark_propose", [prompt, prompt[2:-3]], proposal)
    made = []

    def dspark():
        made.append(DSparkDrafter(engine))
        return made[-1]
    jobs = [(prompt, 0, 0, dspark), (prompt[:-3], 0, 1, None), (prompt[2:], 1, 2, dspark), (prompt, 0.8, 3, None)]
    assert_together_is_alone(engine, jobs)
    assert all(d.counters()["accepted_draft"] > 0 for d in made)


def test_a_fault_in_a_round_reaches_its_waiter_and_the_scheduler_serves_on(engine, monkeypatch):
    real, injected = Scheduler._decode, []

    def faulty(self, ops):
        if not injected:
            injected.append(True)
            raise RuntimeError("injected fault")
        return real(self, ops)

    monkeypatch.setattr(Scheduler, "_decode", faulty)
    scheduler = Scheduler(engine)
    try:
        with scheduler.member(engine.new_sequence()) as seq_engine:
            seq_engine.prefill([1, 2, 3])
            with pytest.raises(RuntimeError, match="injected fault"):
                seq_engine.decode(4)
            assert seq_engine.decode(4).logits.shape == (engine.n_vocab,) and seq_engine.pos == 4
    finally:
        scheduler.close()
