"""Checks of continuous batching every family's tests share (tests/runtime/test_batching.py has the
engine-level ones): a batched decode against decodes alone, a batched prefill against a prefill
and decodes alone and a batched verify against verifies alone, bit for bit, and generations
through the scheduler against each generated alone."""

import threading
from collections import Counter

import numpy as np

from ds4tvm.errors import Ds4Error
from ds4tvm.runtime.sampler import SamplingParams
from ds4tvm.runtime.speculative import generate

N_TOKENS = 20


def prompts(n_vocab: int, lengths, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=n).tolist() for n in lengths]


def assert_batched_decode_is_decode(engine, prompt_list: list[list[int]], steps: int = 4) -> None:
    """Each prompt's greedy continuation decoded alone and as one batch of them all: equal logits
    and named outputs, bit for bit."""
    alone = []
    for p in prompt_list:
        engine.attach(engine.new_sequence())
        engine.prefill(p)
        rows, t = [], p[-1]
        for _ in range(steps):
            step = engine.decode(t)
            rows.append(step)
            t = int(np.argmax(step.logits))
        alone.append(rows)
    seqs = []
    for p in prompt_list:
        seqs.append(engine.new_sequence())
        engine.attach(seqs[-1])
        engine.prefill(p)
    tokens = [p[-1] for p in prompt_list]
    for i in range(steps):
        got = engine.decode_batch(seqs, tokens)
        for j, step in enumerate(got):
            want = alone[j][i]
            assert np.array_equal(step.logits, want.logits), (i, j)
            assert step.outputs.keys() == want.outputs.keys()
            assert all(np.array_equal(step.outputs[k], want.outputs[k]) for k in want.outputs), (i, j)
        tokens = [int(np.argmax(s.logits)) for s in got]


def together(scheduler, jobs: list) -> list:
    """Each job (prompt, temperature, seed, drafter factory or None) generated on its own thread
    through the scheduler, all at once: the tokens of each (or the Ds4Error it raised)."""
    out = [None] * len(jobs)

    def one(i, prompt, temp, seed, make_drafter):
        try:
            with scheduler.member(scheduler.engine.new_sequence()) as seq_engine:
                out[i] = generate(seq_engine, prompt, N_TOKENS, SamplingParams(temperature=temp),
                                  np.random.default_rng(seed), drafter=make_drafter and make_drafter())[0]
        except Ds4Error as e:
            out[i] = e
    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def alone(engine, prompt, temp, seed, make_drafter=None) -> list[int]:
    """The job generated on the engine itself, in a new sequence."""
    engine.attach(engine.new_sequence())
    return generate(engine, prompt, N_TOKENS, SamplingParams(temperature=temp), np.random.default_rng(seed),
                    drafter=make_drafter and make_drafter())[0]


def assert_together_is_alone(engine, jobs: list) -> tuple[Counter, int]:
    """Generations through a scheduler equal each job alone, and, at temperature 0, target-only
    decoding (the identity property); (the decode calls they made, by sequences in each: from
    Engine.decode_calls; the prompt tokens the scheduler prefilled)."""
    from ds4tvm.runtime.scheduler import Scheduler

    want = [alone(engine, *job) for job in jobs]
    for (prompt, temp, seed, make_drafter), w in zip(jobs, want):
        if temp == 0 and make_drafter is not None:
            assert w == alone(engine, prompt, 0, seed)
    scheduler, before = Scheduler(engine), Counter(engine.decode_calls)
    try:
        got = together(scheduler, jobs)
        assert got == want
        return engine.decode_calls - before, scheduler.prefilled
    finally:
        scheduler.close()


def assert_batched_prefill_is_prefill(engine, prompt_list: list[list[int]], chunk: int = 5) -> None:
    """The first prompt's last `chunk` tokens prefilled in one call with a decode of each other
    prompt's last token (Engine.prefill_batch), against that prefill and those decodes alone:
    equal logits and named outputs, bit for bit."""
    from ds4tvm.artifact import batch_name

    assert batch_name(len(prompt_list), "prefill") in engine.functions
    first, rest = prompt_list[0], prompt_list[1:]
    assert len(first) > chunk and all(len(p) > 1 for p in rest)

    def fresh(tokens):
        engine.attach(engine.new_sequence())
        engine.prefill(tokens)
        return engine.seq

    fresh(first[:-chunk])
    want = [engine.prefill(first[-chunk:])]
    for p in rest:
        fresh(p[:-1])
        want.append(engine.decode(p[-1]))
    seqs = [fresh(first[:-chunk])] + [fresh(p[:-1]) for p in rest]
    got_chunk, got = engine.prefill_batch(seqs[0], first[-chunk:], seqs[1:], [p[-1] for p in rest])
    for i, (step, w) in enumerate(zip([got_chunk, *got], want)):
        assert np.array_equal(step.logits, w.logits), i
        assert step.outputs.keys() == w.outputs.keys()
        assert all(np.array_equal(step.outputs[k], w.outputs[k]) for k in w.outputs), (i, step.outputs.keys())
    assert [s.pos for s in seqs] == [len(p) for p in prompt_list]
    assert [s.history for s in seqs] == prompt_list


def assert_batched_verify_is_verify(engine, prompt_list: list[list[int]], blocks: list[list[int]]) -> None:
    """A verify block after each prompt, alone and all in one call (Engine.verify_batch; blocks of
    any lengths): equal logits and named outputs, bit for bit, the same rows pending; then each
    sequence commits all but its block's last row (a rejected row) and decodes that row's token:
    equal logits again."""
    from ds4tvm.artifact import batch_name

    assert batch_name(len(prompt_list), "verify") in engine.functions

    def fresh(tokens):
        engine.attach(engine.new_sequence())
        engine.prefill(tokens)
        return engine.seq

    want = []
    for p, b in zip(prompt_list, blocks):
        fresh(p)
        verified = engine.verify(b)
        engine.commit(len(b) - 1)
        want.append((verified, engine.decode(b[-1])))
        if len(b) == 1:   # a block of one row is a decode (the scheduler runs decodes so beside blocks)
            assert np.array_equal(verified.logits[0], want[-1][1].logits)
    seqs, calls = [fresh(p) for p in prompt_list], engine.verify_calls[len(prompt_list)]
    got = engine.verify_batch(seqs, blocks)
    assert engine.verify_calls[len(prompt_list)] == calls + 1
    for i, (step, (w, _)) in enumerate(zip(got, want)):
        assert np.array_equal(step.logits, w.logits), i
        assert step.outputs.keys() == w.outputs.keys()
        assert all(np.array_equal(step.outputs[k], w.outputs[k]) for k in w.outputs), (i, step.outputs.keys())
        assert seqs[i].pending == len(blocks[i]) and seqs[i].pending_tokens == list(blocks[i])
    for i, (seq, b) in enumerate(zip(seqs, blocks)):
        engine.attach(seq)
        engine.commit(len(b) - 1)
        assert np.array_equal(engine.decode(b[-1]).logits, want[i][1].logits), i


def assert_batched_call_is_call(engine, fn: str, prompt_list: list[list[int]], inputs_of) -> None:
    """A one-row function (a drafter's step) after each prompt, alone and all in one call of its
    batched copy (Engine.call_batch): equal outputs and equal state tensors of its group after it,
    bit for bit. inputs_of(engine, step) gives its inputs after the prompt's prefill step."""
    from ds4tvm.artifact import batch_name

    assert batch_name(len(prompt_list), fn) in engine.functions
    group = engine.functions[fn].states

    def fresh(tokens):
        engine.attach(engine.new_sequence())
        return engine.seq, inputs_of(engine, engine.prefill(tokens))

    def states(seq):
        return [t.numpy() for t in seq.states[group]]

    want = []
    for p in prompt_list:
        seq, inputs = fresh(p)
        want.append((engine.call(fn, **inputs), states(seq)))
    seqs, inputs = zip(*[fresh(p) for p in prompt_list])
    calls = engine.batched_calls[(fn, len(seqs))]
    got = engine.call_batch(fn, list(seqs), list(inputs))
    assert engine.batched_calls[(fn, len(seqs))] == calls + 1   # one call of them all
    for i, (out, (w, w_states)) in enumerate(zip(got, want)):
        assert out.keys() == w.keys()
        assert all(np.array_equal(out[k], w[k]) for k in w), (i, fn)
        assert all(np.array_equal(a, b) for a, b in zip(states(seqs[i]), w_states)), (i, fn)
