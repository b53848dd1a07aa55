"""Prefix reuse and checkpoints on the real engine (a tiny DeepSeek-V4 with every layer kind):
a sequence continued from a kept prefix, a rewind to the limit the rings allow, or a checkpoint
gives bitwise the logits of a cold prefill; checkpoint files round-trip, and every damaged, foreign
or stale one is refused before a state tensor is touched; the store keeps within its size."""

import json
import struct

import numpy as np
import pytest

from ds4tvm.runtime.checkpoint import CheckpointError, CheckpointStore, load_state, read, save_state, write
from ds4tvm.runtime.prefix import resume

pytestmark = pytest.mark.compile

RNG = np.random.default_rng(5)
PROMPT = RNG.integers(3, 500, 400).tolist()


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    from ds4tvm.runtime.engine import Engine

    return Engine(tiny_artifact)


@pytest.fixture(scope="module")
def cold(engine):
    """Every row's logits of the prompt, prefilled from zero."""
    engine.reset()
    return engine.prefill(PROMPT, all_logits=True).logits


def _states(engine):
    return [t.numpy().copy() for group in engine.states.values() for t in group]


def test_rewind_to_the_rings_limit_then_decoding_again_gives_the_same_rows(engine):
    """The limit is what the rings really keep: re-decoding after rewind(rewindable) reproduces the
    first pass bitwise, and one position more is refused."""
    engine.reset()
    engine.prefill(PROMPT[:300])
    first = [engine.decode(t).logits for t in PROMPT[300:330]]
    n = engine.rewindable
    assert 0 < n <= engine.max_verify + 1
    engine.rewind(n)
    again = [engine.decode(t).logits for t in PROMPT[330 - n:330]]
    for a, b in zip(first[-n:], again):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(Exception, match="can be rewound"):
        engine.rewind(engine.rewindable + 1)


def test_resume_within_the_rewind_gives_the_cold_logits(engine, cold):
    engine.reset()
    engine.prefill(PROMPT[:200])
    for t in PROMPT[200:203]:
        engine.decode(t)
    for t in (1, 2):               # the kept sequence diverges from the prompt after 203 tokens
        engine.decode(t)
    held = resume(engine, PROMPT)
    assert held == 202 and engine.history == PROMPT[:202]
    np.testing.assert_array_equal(engine.prefill(PROMPT[held:], all_logits=True).logits, cold[held:])


def test_resume_from_a_checkpoint_when_the_divergence_is_beyond_the_rewind(engine, cold):
    store = CheckpointStore(engine)
    engine.reset()
    engine.prefill(PROMPT[:250])
    store.add(engine.snapshot())
    engine.prefill([1] * 60)         # far past the rewind limit
    held = resume(engine, PROMPT, store)
    assert held == 249
    np.testing.assert_array_equal(engine.prefill(PROMPT[held:], all_logits=True).logits, cold[held:])
    engine.reset()
    engine.prefill([9] * 50)
    assert resume(engine, PROMPT, CheckpointStore(engine)) == 0 and engine.pos == 0   # nothing to use


def test_checkpoint_file_round_trip_and_refusals(engine, cold, tmp_path):
    engine.reset()
    engine.prefill(PROMPT[:123])
    path = save_state(engine, tmp_path / "a.ds4state", meta={"note": "kept"})
    want = _states(engine)
    engine.reset()
    engine.prefill([4] * 10)
    before = (_states(engine), list(engine.history))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16:16 + n])

    def variant(name, data):
        p = tmp_path / name
        p.write_bytes(data)
        return p

    def with_header(**change):
        h = json.dumps({**header, **change}).encode()
        return struct.pack("<Q", len(h)) + h

    flipped = bytearray(raw)
    flipped[-5] ^= 0x40
    cases = {
        "checksum mismatch": variant("flip", bytes(flipped)),
        "truncated": variant("cut", raw[:len(raw) - 100]),
        "another artifact": variant("other", raw[:8] + with_header(artifact="0" * 64) + raw[16 + n:]),
        "written by ds4tvm 0.0.1": variant("old", raw[:8] + with_header(ds4tvm="0.0.1") + raw[16 + n:]),
        "not a ds4tvm checkpoint": variant("junk", b"hello" * 10),
        "header is not JSON": variant("head", raw[:16] + b"x" + raw[17:]),
        "do not fit": variant("pos", raw[:8] + with_header(pos=5) + raw[16 + n:]),
    }
    for reason, p in cases.items():
        with pytest.raises(CheckpointError, match=reason) as e:
            load_state(engine, p)
        assert str(p) in e.value.message and "\n" not in e.value.message
        after = (_states(engine), list(engine.history))
        assert after[1] == before[1] and all(np.array_equal(a, b) for a, b in zip(after[0], before[0]))
    with pytest.raises(CheckpointError, match="made with"):
        load_state(engine, path, tag="dspark")
    assert load_state(engine, path) == {"note": "kept"}
    assert engine.pos == 123 and engine.history == PROMPT[:123]
    assert all(np.array_equal(a, b) for a, b in zip(_states(engine), want))
    np.testing.assert_array_equal(engine.prefill(PROMPT[123:], all_logits=True).logits, cold[123:])


def test_a_checkpoint_keeps_only_the_table_rows_of_its_positions(engine):
    engine.reset()
    engine.prefill(PROMPT[:8])
    small = engine.snapshot()
    engine.prefill(PROMPT[8:400])
    large = engine.snapshot()
    tables = [i for i, s in enumerate(engine.state_specs) if s.stride]
    assert tables and small.nbytes < large.nbytes
    for i in tables:
        s = engine.state_specs[i]
        assert small.arrays[i].shape[0] == -(-8 // s.stride) and large.arrays[i].shape[0] == -(-400 // s.stride)


def test_store_evicts_least_recently_used_within_its_size(engine, tmp_path):
    engine.reset()
    cps = []
    for n in (50, 60, 70):
        engine.prefill(PROMPT[engine.pos:n])
        cps.append(engine.snapshot())
    size = cps[1].nbytes + cps[2].nbytes
    memory = CheckpointStore(engine, size=size)
    for cp in cps:
        memory.add(cp)
    assert [len(t) for t, _ in memory.entries.values()] == [60, 70]
    assert memory.best(PROMPT, 1000)[0] == PROMPT[:70] and memory.best(PROMPT, 65)[0] == PROMPT[:60]
    assert memory.best([1, 2, 3], 1000) is None
    disk = tmp_path / "kv"
    file_size = write(tmp_path / "probe.ds4state", cps[2], engine).stat().st_size
    store = CheckpointStore(engine, size=2 * file_size + 10, directory=disk)
    for cp in cps:
        store.add(cp)
        assert sum(p.stat().st_size for p in disk.iterdir()) <= 2 * file_size + 10
    assert len(list(disk.iterdir())) == 2
    again = CheckpointStore(engine, size=2 * file_size + 10, directory=disk)   # a restarted process
    tokens, where = again.best(PROMPT, 1000)
    assert tokens == PROMPT[:70] and again.load(where).history == PROMPT[:70]
    assert read(where, engine).pos == 70
