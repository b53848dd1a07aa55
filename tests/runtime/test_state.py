"""Snapshot state for recurrent layers (nn/state.py) through the family-blind engine: a toy model
with a causal conv over a position ring and a delta-rule recurrence (a few channels) over
recurrent snapshot slots, plus a host input (rows of a bigram table chosen from the engine's token
history, as Qwen's n-gram embeddings are read), compiled with TVM and driven by its manifest
alone. A verify of k rows then commit(j) must leave what j single decodes leave; reset starts a
new sequence from nothing; rollback drops a rejected block."""

import json
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest
from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from ds4tvm.nn.state import gather_context, recurrent_read, recurrent_write, ring_write
from ds4tvm.artifact import SCHEMA_VERSION

pytestmark = pytest.mark.compile
MAX_VERIFY = 4


D, V = 4, 16
BETA = 0.5

def _scan_func():
    @T.prim_func(s_tir=True)
    def delta_scan(s0: T.handle, uh: T.handle, yh: T.handle, ah: T.handle):
        n = T.int64()
        S0 = T.match_buffer(s0, (1, D * D), "float32")
        U = T.match_buffer(uh, (n, D), "float32")
        Y = T.match_buffer(yh, (n, D), "float32")
        A = T.match_buffer(ah, (n, D * D), "float32")
        with T.sblock("root"):
            k = T.alloc_buffer((D,), "float32")
            sk = T.alloc_buffer((D,), "float32")
            norm = T.alloc_buffer((1,), "float32")
            for t in T.serial(n):
                with T.sblock("row"):
                    norm[0] = T.float32(1e-6)
                    for j in range(D):
                        norm[0] = norm[0] + U[t, j] * U[t, j]
                    for j in range(D):
                        k[j] = U[t, j] / T.sqrt(norm[0])
                    for i in range(D):
                        sk[i] = T.float32(0)
                        for j in range(D):
                            sk[i] = sk[i] + T.if_then_else(t == 0, S0[0, i * D + j],
                                                           A[T.max(t - 1, 0), i * D + j]) * k[j]
                    for i, j in T.grid(D, D):
                        A[t, i * D + j] = T.if_then_else(t == 0, S0[0, i * D + j], A[T.max(t - 1, 0), i * D + j]) \
                            + T.float32(BETA) * (U[t, i] - sk[i]) * k[j]
                    for i in range(D):
                        Y[t, i] = T.float32(0)
                        for j in range(D):
                            Y[t, i] = Y[t, i] + A[t, i * D + j] * U[t, j]
    return delta_scan

# token features; the delta rule reads k = u/|u|, v = q = u
TABLE = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)

class Toy(nn.Module):
    def __init__(self, max_verify):
        self.mv = max_verify
    def _forward(self, ids, start, bigram, states):
        ring, slots = states
        x = op.take(nn.Tensor.from_const(TABLE), ids, axis=0)
        ctx = gather_context(ring, x, start, 1, name="conv_ctx")
        u = op.tensor_expr_op(lambda c: te.compute((c.shape[0] - 1, D), lambda t, d: c[t + 1, d] + 0.5 * c[t, d],
                                                   name="conv"), "conv", [ctx])
        s0 = recurrent_read(slots, start)
        n = ids.shape[0]
        outs = [nn.Tensor.placeholder((n, D), "float32"), nn.Tensor.placeholder((n, D * D), "float32")]
        y, after = op.tensor_ir_op(_scan_func(), "delta_scan", [s0, u], outs)
        ring = ring_write(ring, x, start, name="conv_write")
        slots = recurrent_write(slots, after, start)
        return y + bigram, (ring, slots)
    prefill = decode = verify = _forward
    def spec(self):
        st = [nn.spec.Tensor([1 + self.mv, D], "float32"), nn.spec.Tensor([1 + self.mv, D * D], "float32")]
        mode = {"param_mode": "plain", "effect_mode": "none"}
        return {f: {"ids": nn.spec.Tensor([r], "int32"), "start": int, "bigram": nn.spec.Tensor([r, D], "float32"),
                    "states": st, "$": mode} for f, r in (("prefill", "n"), ("decode", 1), ("verify", "k"))}



BIGRAMS = np.random.default_rng(1).standard_normal((V * V, D)).astype(np.float32)


def bigram_rows(engine, inputs) -> np.ndarray:
    """The host input: the row of (previous token, token) for each token of the call, the previous
    one of the first coming from the committed history (0 at the start)."""
    ids = [int(t) for t in inputs["ids"]]
    prev = [engine.history[inputs["start"] - 1] if inputs["start"] else 0] + ids[:-1]
    return BIGRAMS[np.array(prev) * V + np.array(ids)]


def _reference(ids: list[int]) -> np.ndarray:
    """The toy's outputs for a whole sequence, in numpy."""
    x = TABLE[ids].astype(np.float64)
    u = x + 0.5 * np.vstack([np.zeros((1, D)), x[:-1]])
    S, out = np.zeros((D, D)), []
    for row in u:
        k = row / np.sqrt(row @ row + 1e-6)
        S = S + BETA * np.outer(row - S @ k, k)
        out.append(S @ row)
    return np.array(out) + BIGRAMS[np.array([0] + ids[:-1]) * V + np.array(ids)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    import tvm

    from ds4tvm.artifact import Bounds, FunctionSpec, Manifest, StateSpec, file_identity, file_sha256
    from ds4tvm.compile.driver import _compile_module
    from ds4tvm.compile.targets import resolve
    from ds4tvm.gguf.writer import write_gguf

    d = tmp_path_factory.mktemp("toy")
    m = Toy(MAX_VERIFY)
    mod, _ = m.export_tvm(spec=m.spec())
    spec = resolve("llvm")
    _compile_module(mod, spec).export_library(str(d / spec.library))
    (d / "tokenizer.json").write_text("{}")
    weights = write_gguf(d / "toy.gguf", "toy", {}, [])
    R = MAX_VERIFY + 1
    states = [StateSpec("conv_ring", (R, D), ring=R, rewind=R - 1),
              StateSpec("delta_slots", (R, D * D), ring=R, rewind=R - 1)]
    inputs = (("ids", "tokens"), ("start", "position"), ("bigram", "host"))
    Manifest(family="toy", architecture="toy", target=spec.tvm, target_name=spec.name,
             weights={"model": file_identity(weights)},
             bounds=asdict(Bounds(64, MAX_VERIFY, 8)), kv_rounding=False,
             functions=[FunctionSpec(f, inputs, ("logits",), "model").to_json()
                        for f in ("prefill", "decode", "verify")],
             params=[], states=[s.to_json() for s in states], library=spec.library, n_vocab=V,
             tvm_version=tvm.__version__,
             hashes={name: file_sha256(d / name) for name in (spec.library, "tokenizer.json")}).write(d)
    return d


@pytest.fixture()
def engines(artifact, monkeypatch):
    from ds4tvm.families import REGISTRY, Family
    from ds4tvm.runtime.engine import Engine

    toy = Family(name="toy", architecture="toy", role="target", config_from_gguf=lambda f: SimpleNamespace(n_vocab=V),
                 tensor_specs=lambda cfg: [], host_inputs={"bigram": "test_state:bigram_rows"})
    monkeypatch.setitem(REGISTRY, "toy", toy)
    return Engine(artifact), Engine(artifact)


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]   # longer than one prefill chunk (8)
BLOCK = [8, 9, 7, 9]


def test_the_toy_matches_its_numpy_reference(engines):
    e = engines[0]
    got = np.concatenate([e.prefill(PROMPT[:8]).logits[None]] +
                         [e.decode(t).logits[None] for t in PROMPT[8:]])
    want = _reference(PROMPT)
    np.testing.assert_allclose(got, want[[7, 8, 9, 10]], atol=1e-5)


@pytest.mark.parametrize("j", range(len(BLOCK) + 1))
def test_verify_then_commit_j_equals_j_decodes(engines, j):
    spec, plain = engines
    spec.prefill(PROMPT)
    plain.prefill(PROMPT)
    rows = spec.verify(BLOCK).logits
    spec.commit(j)
    for i, t in enumerate(BLOCK[:j]):
        np.testing.assert_array_equal(rows[i], plain.decode(t).logits)
    slot = spec.pos % (MAX_VERIFY + 1)
    np.testing.assert_array_equal(spec.states["model"][1].numpy()[slot], plain.states["model"][1].numpy()[slot])
    for t in (2, 7, 1, 8, 2, 8):   # and the sequences go on alike, past a wrap of the rings
        np.testing.assert_array_equal(spec.decode(t).logits, plain.decode(t).logits)
    assert spec.history == plain.history == PROMPT + BLOCK[:j] + [2, 7, 1, 8, 2, 8]


def test_rollback_after_a_rejected_block(engines):
    spec, plain = engines
    spec.prefill(PROMPT)
    plain.prefill(PROMPT)
    spec.verify(BLOCK)
    spec.rollback()
    spec.verify(BLOCK[:2])
    spec.commit(1)   # one accepted, the second rejected
    plain.decode(BLOCK[0])
    for t in (6, 6, 0):
        np.testing.assert_array_equal(spec.decode(t).logits, plain.decode(t).logits)


def test_reset_leaves_nothing_of_the_previous_sequence(engines):
    used, fresh = engines
    used.prefill(PROMPT)
    used.verify(BLOCK)
    used.commit(3)
    used.reset()
    assert used.pos == 0 and used.history == []
    assert all(not t.numpy().any() for t in used.states["model"])
    np.testing.assert_array_equal(used.prefill([5, 4, 3]).logits, fresh.prefill([5, 4, 3]).logits)


def test_an_artifact_of_the_previous_schema_is_refused_with_the_recompile_line(artifact, tmp_path):
    import shutil

    from conftest import run_ds4

    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["schema_version"] = 2
    (old / "manifest.json").write_text(json.dumps(manifest))
    r = run_ds4("run", "-m", old, "--tokens", "1,2", "-n", "1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"schema 2 is not {SCHEMA_VERSION}; recompile" in lines[0], r.stderr
