"""How the scheduler sizes a round's prefill (runtime/scheduler.py), from the chunk costs it has
measured: a prompt waiting only for others gets whole chunks; beside running decodes the round adds
about STALL decode steps' time, given to one prompt after another in the largest chunks that fit
(a small chunk costs more per token), and the first prompt waiting always moves (a short rest of
it whole); and when a round's decode steps join its verify call."""

import pytest

from ds4tvm.runtime.scheduler import FINISH, MIN_CHUNK, STALL, Scheduler


class _Engine:
    """What the policy reads of an engine."""
    chunk = 256
    max_batch = 4
    functions: dict = {}


@pytest.fixture
def scheduler():
    s = Scheduler(_Engine())
    yield s
    s.close()


def test_prompts_waiting_only_for_each_other_get_whole_chunks(scheduler):
    assert scheduler._chunk(scheduler._budget(0, 3), False, first=True) == 256
    assert scheduler._chunk(scheduler._budget(0, 3), False, first=False) == 256


def test_beside_decodes_the_budget_goes_to_one_prompt_after_another(scheduler):
    scheduler._step_s = scheduler._stream_s = 0.010
    scheduler._chunk_s = {False: {8: 0.010, 16: 0.012, 32: 0.016, 64: 0.030}, True: {8: 0.004, 16: 0.007}}
    assert scheduler._budget(decoding=3, prefilling=2) == pytest.approx(STALL * 0.010)
    # the first prompt: the largest measured size that fits
    assert scheduler._chunk(0.020, False, first=True) == 32
    assert scheduler._chunk(0.015, False, first=True) == 16
    assert scheduler._chunk(0.031, False, first=True) == 64
    # the next prompt runs only where its smallest chunk fits what is left (20 ms - 16 ms: none)
    assert scheduler._chunk(0.020 - 0.016, False, first=False) == 0
    assert scheduler._chunk(0.011, False, first=False) == MIN_CHUNK
    # a joined chunk is sized by what a chunk adds to the decodes' call; an untried size is guessed
    # as twice the measured half's time (32 tokens: 14 ms), one size beyond what was tried
    assert scheduler._chunk(0.015, True, first=True) == 32
    assert scheduler._chunk(0.013, True, first=True) == 16
    assert scheduler._chunk(1.0, True, first=True) == 32


def test_the_first_prompt_waiting_always_moves(scheduler):
    scheduler._step_s = scheduler._stream_s = 0.010
    assert scheduler._chunk(0.0, False, first=True) == MIN_CHUNK
    assert scheduler._chunk(-1.0, True, first=True) == MIN_CHUNK
    assert scheduler._chunk(0.0, False, first=False) == 0   # nothing measured yet: it waits
    assert scheduler._budget(1, 1) == pytest.approx(STALL * 0.010)


def test_the_first_prompt_moving_takes_a_short_rest_whole(scheduler):
    """A prompt with at most FINISH tokens left is prefilled whole by the round's first chunk, beside
    the decodes, whatever the budget; a longer rest, or a later prompt of the round, gets the
    budget's chunks."""
    scheduler._step_s = scheduler._stream_s = 0.010
    scheduler._chunk_s = {False: {8: 0.010, 16: 0.012}, True: {8: 0.004, 16: 0.007}}
    assert scheduler._chunk(0.0, True, first=True, left=FINISH) == FINISH
    assert scheduler._chunk(0.0, False, first=True, left=5) == 5
    assert scheduler._chunk(0.0, True, first=True, left=FINISH + 1) == MIN_CHUNK
    assert scheduler._chunk(0.013, True, first=True, left=FINISH + 1) == 16
    assert scheduler._chunk(0.0, False, first=False, left=5) == 0


def test_newcomers_outnumbering_the_streams_get_a_budget_each(scheduler):
    scheduler._step_s = scheduler._stream_s = 0.010
    assert scheduler._budget(decoding=1, prefilling=4) == pytest.approx(4 * STALL * 0.010)
    assert scheduler._budget(decoding=4, prefilling=1) == pytest.approx(STALL * 0.010)


def test_before_any_step_is_timed_a_prompt_beside_decodes_gets_the_smallest_chunk(scheduler):
    assert scheduler._budget(2, 1) == 0.0
    assert scheduler._chunk(scheduler._budget(2, 1), True, first=True) == MIN_CHUNK


def test_decodes_join_a_verify_call_only_where_a_batched_verify_takes_them(scheduler):
    """A round's decode steps ride in its verify call where the artifact has the batched verify of
    them all, and not where its batched decode is a recorded CUDA graph or it has no batched verify
    (an artifact compiled before them: the decodes keep their batched decode)."""
    from ds4tvm.artifact import FunctionSpec

    def spec(name, recorded=False):
        return FunctionSpec(name, (), ("logits",), "model", recorded=recorded)

    scheduler.engine.functions = {f: spec(f) for f in ("decode", "decode_batch2", "verify_batch3", "verify_batch4")}
    assert scheduler._decodes_ride_along(verifying=1, decoding=2)
    assert scheduler._decodes_ride_along(verifying=3, decoding=1)
    assert not scheduler._decodes_ride_along(verifying=3, decoding=2)   # no verify_batch5
    scheduler.engine.functions["decode_batch2"] = spec("decode_batch2", recorded=True)
    assert not scheduler._decodes_ride_along(verifying=1, decoding=2)
    scheduler.engine.functions = {f: spec(f) for f in ("decode", "decode_batch2")}
    assert not scheduler._decodes_ride_along(verifying=1, decoding=1)


def test_a_rounds_calls_of_one_function_share_calls_and_a_failed_call_fails_alone(scheduler):
    """A round's calls of one named function (a drafter's steps) go to Engine.call_batch in groups
    of up to max_batch sequences, each function's apart; where a batched call fails, each runs
    alone and only the one at fault gets the error."""
    from ds4tvm.errors import Ds4Error
    from ds4tvm.runtime.scheduler import _Op

    class Engine(_Engine):
        max_batch = 2
        batches: list = []

        def call_batch(self, fn, seqs, inputs):
            self.batches.append((fn, list(seqs)))
            if any(x.get("bad") for x in inputs):
                raise Ds4Error("a bad row")
            return [{"out": x["v"] * 10} for x in inputs]

        def attach(self, seq):
            self.seq = seq

        def call(self, fn, **inputs):
            if inputs.get("bad"):
                raise Ds4Error(f"{self.seq}: bad")
            return {"out": inputs["v"] * 10}

    scheduler.engine = Engine()
    calls = (("a", "step", 1), ("b", "observe", 2), ("c", "step", 3), ("d", "step", 4), ("e", "step", 5))
    ops = [_Op(s, "call", fn=fn, inputs={"v": v, "bad": s == "e"}) for s, fn, v in calls]
    scheduler._round(ops)
    assert scheduler.engine.batches == [("step", ["a", "c"]), ("step", ["d", "e"]), ("observe", ["b"])]
    assert [op.result for op in ops[:4]] == [{"out": 10}, {"out": 20}, {"out": 30}, {"out": 40}]
    assert isinstance(ops[4].error, Ds4Error) and "e: bad" in str(ops[4].error)
    assert all(op.done.is_set() for op in ops)
