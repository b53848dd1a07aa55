"""Checkpoints that went bad: every change to a file (header, history, meta or rows) is detected,
every malformed header is a CheckpointError (never another exception), files are private, the
store works in a read-only directory and sweeps what killed writers left, and `ds4 run --session`
never overwrites a file that is not its conversation."""

import json
import os
import struct

import numpy as np
import pytest

from conftest import run_ds4
from ds4tvm.runtime.checkpoint import CheckpointError, CheckpointStore, load_state, read, read_header, save_state

pytestmark = pytest.mark.compile

PROMPT = np.random.default_rng(9).integers(3, 500, 40).tolist()


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    from ds4tvm.runtime.engine import Engine

    e = Engine(tiny_artifact)
    e.prefill(PROMPT)
    return e


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("cp") / "a.ds4state"
    save_state(engine, path, meta={"tokens": PROMPT})
    return path


def _split(raw: bytes):
    (n,) = struct.unpack("<Q", raw[8:16])
    return json.loads(raw[16:16 + n]), raw[16 + n:]


def _with_header(raw: bytes, header: dict) -> bytes:
    _, rest = _split(raw)
    h = json.dumps(header).encode()
    return raw[:8] + struct.pack("<Q", len(h)) + h + rest


def test_a_forged_history_token_is_refused(engine, saved, tmp_path):
    """The header is hashed too: the same JSON shape with one committed token changed."""
    raw = saved.read_bytes()
    header, _ = _split(raw)
    header["history"][7] = (header["history"][7] + 1) % 500
    forged = tmp_path / "forged.ds4state"
    forged.write_bytes(_with_header(raw, header))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read(forged, engine)
    header, _ = _split(raw)
    header["meta"] = {"tokens": PROMPT[:-1] + [1]}
    forged.write_bytes(_with_header(raw, header))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read(forged, engine)


def _mutant(raw: bytes, rng) -> bytes:
    """One random change: flipped bits, bytes overwritten, inserted, deleted, a cut, or a header
    field given another JSON value."""
    kind, data = int(rng.integers(6)), bytearray(raw)
    at = int(rng.integers(len(raw)))
    if kind == 0:
        data[at] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        data[at:at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
    elif kind == 2:
        data[at:at] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
    elif kind == 3:
        del data[at:at + int(rng.integers(1, 16))]
    elif kind == 4:
        data = data[:at]
    else:
        header, _ = _split(raw)
        values = [None, True, -1, 0, 2 ** 70, 1.5, "x", [], {}, [1, "a"], {"a": []}, "0" * 64]
        key = list(header)[int(rng.integers(len(header)))]
        header[key] = values[int(rng.integers(len(values)))]
        data = bytearray(_with_header(raw, header))
    if bytes(data) == raw:
        data += b"\0"
    return bytes(data)


@pytest.mark.parametrize("count", [1000])
def test_checkpoint_mutants_are_all_refused_with_a_checkpoint_error(engine, saved, tmp_path, count):
    raw = saved.read_bytes()
    rng = np.random.default_rng(2026)
    path = tmp_path / "m.ds4state"
    before = [t.numpy().copy() for g in engine.states.values() for t in g]
    refused = 0
    for _ in range(count):
        path.write_bytes(_mutant(raw, rng))
        with pytest.raises(CheckpointError) as e:   # anything else (TypeError, KeyError...) fails the test
            load_state(engine, path)
        assert "\n" not in e.value.message
        refused += 1
    assert refused == count
    after = [t.numpy() for g in engine.states.values() for t in g]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_files_are_private(saved):
    assert os.stat(saved).st_mode & 0o777 == 0o600


def test_a_read_only_store_serves_its_checkpoints(engine, saved, tmp_path, monkeypatch):
    """Root ignores directory permissions, so the read-only file system is what the calls say."""
    kv = tmp_path / "kv"
    store = CheckpointStore(engine, directory=kv)
    store.add(engine.snapshot())
    names = sorted(p.name for p in kv.iterdir())

    def refuse(*args, **kw):
        raise OSError(30, "Read-only file system")

    from ds4tvm.runtime import checkpoint

    monkeypatch.setattr(checkpoint.os, "utime", refuse)
    monkeypatch.setattr(checkpoint.os, "open", refuse)
    monkeypatch.setattr(checkpoint.Path, "unlink", refuse)
    again = CheckpointStore(engine, size=1, directory=kv)   # smaller than what it holds: cannot evict
    tokens, where = again.best(PROMPT, 1000)
    assert tokens == PROMPT and again.load(where).history == PROMPT
    again.add(engine.snapshot())   # a warning, no exception
    assert sorted(p.name for p in kv.iterdir()) == names


def test_stale_temporary_files_are_swept(engine, tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    dead = kv / f".x{'0' * 40}.ds4state.{2 ** 22 + 12345}.1.tmp"   # above pid_max's default: no such process
    live = kv / f".y.ds4state.{os.getpid()}.1.tmp"
    for p in (dead, live):
        p.write_bytes(b"half")
    CheckpointStore(engine, directory=kv)
    assert not dead.exists() and live.exists()


def test_read_header_reports_the_format(saved):
    assert read_header(saved)["format"] == 2


def test_session_refuses_a_file_that_is_not_its_conversation(tiny_artifact, tmp_path):
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    before = victim.read_bytes()
    r = run_ds4("run", "-m", tiny_artifact, "--tokens", "5,6,7", "-n", "2", "--temp", "0", "--session", victim)
    assert r.returncode == 2 and victim.read_bytes() == before
    assert r.stderr.count("\n") == 1 and "not a ds4tvm checkpoint" in r.stderr and "--session-overwrite" in r.stderr
    r = run_ds4("run", "-m", tiny_artifact, "--tokens", "5,6,7", "-n", "2", "--temp", "0", "--session", victim,
                "--session-overwrite")
    assert r.returncode == 0, r.stderr
    first = read_header(victim)["meta"]["tokens"]
    assert first[:3] == [5, 6, 7] and len(first) == 5   # the prompt and the 2 tokens generated
    r = run_ds4("run", "-m", tiny_artifact, "--tokens", "8", "-n", "2", "--temp", "0", "--session", victim)
    assert r.returncode == 0, r.stderr
    assert read_header(victim)["meta"]["tokens"][:6] == first + [8]   # the conversation continued


def test_a_store_starts_beside_malformed_files_and_removes_them(engine, saved, tmp_path, capsys):
    """A kv directory holding files with odd headers (the old reader raised TypeError on them, so
    the server did not start): each is one warning and removed; the good one is used."""
    kv = tmp_path / "kv"
    store = CheckpointStore(engine, directory=kv)
    store.add(engine.snapshot())
    good = next(kv.iterdir())
    raw = good.read_bytes()
    header, _ = _split(raw)
    odd = {"history": "x", "states": [{"name": 3}], "pos": None, "meta": [], "fed": {"a": 1}, "format": True}
    for i, (key, value) in enumerate(odd.items()):
        (kv / good.name.replace(good.name[-20:], f"{i:011d}.ds4state")).write_bytes(
            _with_header(raw, {**header, key: value}))
    again = CheckpointStore(engine, directory=kv)
    assert list(kv.iterdir()) == [good] and len(again.entries) == 1
    assert capsys.readouterr().err.count("ds4: warning:") == len(odd)
