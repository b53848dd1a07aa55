"""The runtime engine: loads an artifact, binds the weight planes of its GGUF files once, owns the
state tensors its manifest describes (StateSpec), the committed length and token history, and
exposes prefill / decode / verify / commit / rollback, plus `call` for any other compiled function
(FunctionSpec) - the drafters' functions. It knows no family: the manifest says everything.

State is indexed by position (DESIGN.md): a verify writes rows (or recurrent slots) for positions
past the committed length, commit(k) keeps the first k of them and rollback() drops them, both by
moving counters only. A `Sequence` is what one sequence owns (the state tensors, the committed
length and tokens, the rows a verify left pending); the engine works on one at a time (`attach`),
so a server can keep several, and `snapshot` / `restore` copy one in memory (runtime/checkpoint.py's
`save_state` / `load_state` on disk); `decode_batch` decodes a token of each of several sequences in
one call where the artifact has batched functions, and `prefill_batch` a prompt's chunk beside
them (runtime/scheduler.py gathers them).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..artifact import MANIFEST, MODEL, FunctionSpec, Manifest, batch_name, read_json_object, width_variant
from ..devices import device_for
from ..errors import Cancelled, Ds4Error
from ..families import check_weight_files
from ..gguf import open_gguf
from ..gguf.quant import ALIGN, derived_plane, to_planes
from . import threads
from .checkpoint import Checkpoint
from .residency import Residency

SMALL_MODEL_BYTES = 64 << 20   # weight files below this run on one CPU thread unless told otherwise


@dataclass
class Sequence:
    """One sequence's state: its state tensors by group, committed length and committed tokens, the
    groups that functions have written since it was reset (a drafter's states count only then),
    and the verified rows not yet committed (pending: their count)."""
    states: dict
    pos: int = 0
    history: list = field(default_factory=list)
    fed: set = field(default_factory=set)
    pending: int = 0
    pending_tokens: list = field(default_factory=list)


@dataclass
class Step:
    """One target call: the logits ([V] for the last row, or [k, V]) and the function's other
    named outputs (e.g. captured hidden states, per-row hidden states), one row per token."""
    fn: str
    logits: np.ndarray
    outputs: dict = field(default_factory=dict)


class SequenceView:
    """The engine as seen for one sequence, attached or not: that sequence's committed length,
    tokens, pending rows and states, the engine's files and constants (a host input's provider in
    a batched call; runtime/scheduler.SequenceEngine)."""

    def __init__(self, engine, seq: Sequence):
        self._engine, self.seq = engine, seq

    @property
    def pos(self) -> int:
        return self.seq.pos

    @property
    def history(self) -> list:
        return self.seq.history

    @property
    def pending(self) -> int:
        return self.seq.pending

    @property
    def states(self) -> dict:
        return self.seq.states

    @property
    def rewindable(self) -> int:
        return self._engine.rewindable_of(self.seq)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class Engine:
    def __init__(self, artifact_dir: str | Path, weights: dict[str, str | Path] | None = None):
        """weights: role -> path, for weight files that are not where the artifact was compiled
        (a package's copies, or `-m MODEL.gguf` beside a cached artifact)."""
        import tvm
        import tvm_ffi
        from tvm.runtime.vm import VirtualMachine

        self._tvm, self._Shape = tvm, tvm_ffi.Shape
        self.dir = Path(artifact_dir)
        self.manifest = m = Manifest.read(self.dir)
        m.check_runtime(self.dir)
        m.check_files(self.dir)
        paths = m.weight_paths(self.dir, weights)
        self.files = {role: open_gguf(p) for role, p in paths.items()}
        check_weight_files(self.files, m.n_vocab)
        self.gguf = self.files[MODEL]
        self.drafters = m.drafters
        self.functions = m.function_specs()
        self.dev = device_for(m, self.dir)
        # TVM's CPU pool reads TVM_NUM_THREADS when it starts (at the first parallel kernel); left
        # unset it used one thread on this 2-core machine. Default: every core this process may use
        # (within its cgroup's CPU quota), except for a small model, whose kernels are too short to
        # pay for waking a second thread: the 17 MB demo model decoded in 0.9-1.2 ms on one thread
        # against 2.1-2.4 ms on two (and prefilled no slower); the 160 MB benchmark model decodes
        # alike on both, prefills faster on two.
        small = sum(os.path.getsize(p) for p in paths.values()) < SMALL_MODEL_BYTES
        os.environ.setdefault("TVM_NUM_THREADS", "1" if small else str(threads.default_threads()))
        # Workers spin between kernels; beside a busy process the pool shrinks to one thread
        # (runtime/threads.py; TVM_THREAD_POOL_SPIN_COUNT=0 in the environment turns spinning off).
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", threads.SPIN_COUNT)
        on_cpu = self.dev.dlpack_device_type() == 1
        self._adapt_threads = threads.adapt if on_cpu else (lambda: None)
        # a CPU call's outputs are read where the VM wrote them (copying a decode's logits into a fresh
        # array cost 3% of its step); a device's come back to the host
        self._host_array = np.from_dlpack if on_cpu else (lambda t: t.numpy())
        lib = tvm.runtime.load_module(str(self.dir / m.library))
        self.vm = VirtualMachine(lib, self.dev)
        self.params = self._bind_params()
        self._params_of = {name: self.params if f.params is None else self.params[f.params[0]:f.params[1]]
                           for name, f in self.functions.items()}   # each function's weight arguments
        for g in self.files.values():
            g.release_pages()
        self.state_specs = m.state_specs()
        self._rewind_limits: dict[str, int] = {}
        for s in self.state_specs:
            if s.rewindable is not None:
                self._rewind_limits[s.group] = min(s.rewindable, self._rewind_limits.get(s.group, s.rewindable))
        self.identity = hashlib.sha256((self.dir / MANIFEST).read_bytes()).hexdigest()
        # (function, input) -> the tensor a recorded function takes every call; its state tensors:
        # runtime/residency.py
        self._recorded: dict = {} if any(f.recorded for f in self.functions.values()) else None
        self._residency = Residency(self._empty_like) if self._recorded is not None else None
        self.seq = self.new_sequence()
        self.host_inputs = self._host_inputs()
        b = m.bounds
        self.max_context, self.max_verify, self.chunk = b["max_context"], b["max_verify"], b["prefill_chunk"]
        self.n_vocab = m.n_vocab
        # the most sequences one call decodes (its batched functions: FunctionSpec.sequences)
        self.max_batch = max(f.sequences for f in self.functions.values())
        self.decode_calls: Counter = Counter()   # sequences per decode call -> calls (ds4 serve's /metrics)
        self.verify_calls: Counter = Counter()   # sequences per verify call -> calls (/metrics)
        self.batched_calls: Counter = Counter()  # (function, sequences per call) -> calls by call_batch (/metrics)
        self.prefilled_beside_decodes = 0        # prompt tokens prefilled in a call with decodes (prefill_batch)
        self.tokenizer_data = read_json_object(self.dir / m.tokenizer, "tokenizer data")

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> Sequence:
        """A new sequence with its own zeroed state tensors (memory: the manifest's states once more)."""
        states: dict[str, list] = {}
        for s in self.state_specs:
            t = self._tvm.runtime.empty(s.shape, s.dtype, self.dev)
            t.copyfrom(np.zeros(s.shape, s.dtype))
            states.setdefault(s.group, []).append(t)
        return Sequence(states)

    def attach(self, seq: Sequence) -> None:
        """Works on seq from now on; the sequence worked on before keeps its state. (With recorded
        functions a call first gives the sequence the tensors the function recorded:
        runtime/residency.py.)"""
        self.seq = seq

    def _empty_like(self, t):
        return self._tvm.runtime.empty(t.shape, t.dtype, self.dev)

    @property
    def states(self) -> dict:
        return self.seq.states

    @property
    def pos(self) -> int:
        return self.seq.pos

    @pos.setter
    def pos(self, value: int) -> None:
        self.seq.pos = value

    @property
    def pending(self) -> int:
        """Rows of the last verify not yet committed or rolled back."""
        return self.seq.pending

    @pending.setter
    def pending(self, value: int) -> None:
        self.seq.pending = value

    @property
    def history(self) -> list[int]:
        """The committed tokens."""
        return self.seq.history

    @history.setter
    def history(self, value: list[int]) -> None:
        self.seq.history = value

    def _tensors(self):
        """(StateSpec, tensor) in the manifest's order."""
        groups = {g: iter(tensors) for g, tensors in self.states.items()}
        for s in self.state_specs:
            yield s, next(groups[s.group])

    def snapshot(self) -> Checkpoint:
        """A copy of the attached sequence at its committed length."""
        arrays = [t.numpy()[:s.rows_for(self.pos)].copy() for s, t in self._tensors()]
        return Checkpoint(self.pos, list(self.history), arrays, set(self.seq.fed))

    def restore(self, cp: Checkpoint) -> None:
        """Makes the attached sequence what cp copied (rows cp does not hold are dead: zeroed)."""
        pairs = list(self._tensors())
        if len(cp.arrays) != len(pairs) or any(a.dtype != np.dtype(s.dtype) or a.shape[1:] != s.shape[1:]
                                               or a.shape[0] > s.shape[0] for (s, _), a in zip(pairs, cp.arrays)):
            raise Ds4Error(f"{self.dir}: the checkpoint's state tensors are not this artifact's")
        for (s, t), a in zip(pairs, cp.arrays):
            full = np.zeros(s.shape, s.dtype)
            full[:a.shape[0]] = a
            t.copyfrom(full)
        self.pos, self.history, self.pending = cp.pos, list(cp.history), 0
        self.seq.fed = set(cp.fed)

    def _bind_params(self) -> list:
        params = self.manifest.params
        # a tensor's planes are dropped after its last field is bound: where that field is derived
        # (interleaved), the row-major planes would otherwise stay beside it for the whole load
        last = {(role, tensor): i for i, (_, tensor, _, role) in enumerate(params)}
        planes, out = {}, []
        for i, (_, tensor, field_, role) in enumerate(params):
            t = self.files[role].tensors.get(tensor) if role in self.files else None
            if t is None:
                raise Ds4Error(f"{self.dir}: its manifest binds {tensor} of the {role} file, which has no such tensor")
            if field_ is None:
                out.append(self._to_device(np.ascontiguousarray(t.data)))
                continue
            if (role, tensor) not in planes:
                planes[role, tensor] = to_planes(t.data, t.ggml_type, tuple(reversed(t.shape)))
            out.append(self._to_device(derived_plane(planes[role, tensor], field_)))
            if last[role, tensor] == i:
                del planes[role, tensor]
        return out

    def _host_inputs(self) -> dict:
        kinds = {name for f in self.functions.values() for name, kind in f.inputs if kind == "host"}
        if not kinds:
            return {}
        from ..families import family_named, load_attr

        providers = family_named(self.manifest.family).host_inputs
        return {name: load_attr(providers[name]) for name in kinds}

    def _to_device(self, a: np.ndarray):
        """A weight as a TVM tensor: on the CPU, planes made at load (writable, contiguous, 64-byte
        aligned) are shared with TVM, not copied; views of the read-only mmap are copied."""
        if (self.dev.dlpack_device_type() == 1 and a.flags.writeable and a.flags.c_contiguous
                and a.ctypes.data % ALIGN == 0):
            import tvm_ffi

            return tvm_ffi.from_dlpack(a)
        return self._tvm.runtime.tensor(np.ascontiguousarray(a), self.dev)

    # ------------------------------------------------------------------ checks
    def _ids(self, tokens) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.n_vocab)]
        if bad.size:
            raise Ds4Error(f"token id {int(bad[0])} is outside the vocabulary of {self.n_vocab}")
        return ids.astype(np.int32)

    def _room(self, n: int, seq: Sequence | None = None) -> None:
        """Refuses n more tokens in seq (the attached sequence by default) beyond the compiled context."""
        pos = (seq or self.seq).pos
        if pos + n > self.max_context:
            raise Ds4Error(f"{pos + n} tokens exceed the compiled context of {self.max_context} "
                           f"(ds4-compile --max-context)")

    @staticmethod
    def _committed(seq: Sequence, tokens: np.ndarray) -> None:
        """seq after a call that appended and committed tokens (a batched call's rows of it)."""
        seq.pos += len(tokens)
        seq.history += tokens.tolist()
        seq.pending = 0

    # ------------------------------------------------------------------ calls
    def _argument(self, kind: str, value):
        if kind == "position":
            return self._Shape([int(value)])
        if kind in ("positions", "counts"):
            return tuple(self._Shape([int(v)]) for v in value)
        return self._tvm.runtime.tensor(self._array(kind, value), self.dev)

    def _array(self, kind: str, value) -> np.ndarray:
        if kind in ("position", "positions", "counts"):
            return np.array([int(v) for v in np.atleast_1d(value)], np.int64)
        if kind == "tokens":
            return self._ids(value)
        return np.ascontiguousarray(value, np.int32 if kind == "int32" else np.float32)

    def _recorded_argument(self, fn: str, name: str, kind: str, value):
        """The tensor a recorded function always takes for this input, holding value."""
        a = self._array(kind, value)
        t = self._recorded.get((fn, name))
        if t is None:
            t = self._recorded[(fn, name)] = self._tvm.runtime.empty(a.shape, a.dtype, self.dev)
        t.copyfrom(a)
        return t

    def call(self, fn: str, seqs: list | None = None, **inputs) -> dict[str, np.ndarray]:
        """Runs compiled function fn with its FunctionSpec's inputs by name (a "start" position
        defaults to the committed length; a host input is computed by its family's provider from
        the call's other inputs and the engine, e.g. its token history) and returns its named
        outputs. A batched function (FunctionSpec.sequences) takes the state tensors of seqs, one
        sequence per row."""
        spec: FunctionSpec = self.functions.get(fn)
        if spec is None:
            raise Ds4Error(f"{self.dir}: has no function {fn!r}; it has {', '.join(sorted(self.functions))}")
        width = len(inputs.get(spec.inputs[0][0], ())) if spec.widths else 0
        if width in spec.widths:   # its copy recorded at this many rows
            fn = width_variant(fn, width)
            spec = self.functions[fn]
        args = []
        for name, kind in spec.inputs:
            if kind == "host":
                value = self._host_value(spec, name, inputs, seqs)
            else:
                value = inputs.get(name, self.pos if kind == "position" else None)
            if value is None:
                raise Ds4Error(f"{fn}: input {name!r} ({kind}) is missing")
            args.append(self._recorded_argument(fn, name, kind, value) if spec.recorded else self._argument(kind, value))
        if spec.sequences > 1:   # a recorded function takes each state tensor as its own argument
            for row, s in enumerate(seqs if spec.recorded else ()):
                self._residency.hold(s, spec.states, row)
            states = tuple(s.states[spec.states] for s in seqs)
            args += [t for one in states for t in one] if spec.recorded else [states]
            for s in seqs:
                s.fed.add(spec.states)
        elif spec.states is not None:
            if spec.recorded:
                self._residency.hold(self.seq, spec.states, "one")
            states = self.states[spec.states]
            args += states if spec.recorded else [states]
            self.seq.fed.add(spec.states)
        self._adapt_threads()
        result = self.vm[fn](*args, *self._params_of[fn])
        result = [result] if hasattr(result, "numpy") else list(result)
        return {name: self._host_array(result[i]) for i, name in enumerate(spec.outputs)}

    def _host_value(self, spec: FunctionSpec, name: str, inputs: dict, seqs) -> np.ndarray:
        """A host input from its family's provider: in a batched call, each sequence's row from
        that sequence's history."""
        provider = self.host_inputs[name]
        if spec.sequences == 1:
            return provider(self, inputs)
        ids = np.asarray(inputs["ids"]).reshape(-1)
        first = len(ids) - (len(seqs) - 1) if spec.chunked else 1   # a batched prefill's chunk, then a row each
        counts = inputs["counts"] if spec.blocks else [first] + [1] * (len(seqs) - 1)   # or a verify's blocks
        bounds = np.cumsum([0, *counts])
        return np.concatenate([provider(SequenceView(self, seq), {"ids": ids[a:b], "start": seq.pos})
                               for seq, a, b in zip(seqs, bounds, bounds[1:])])

    def _step(self, fn: str, ids: np.ndarray, last_row: bool = False) -> Step:
        out = self.call(fn, ids=ids, start=self.pos)
        logits = out.pop("logits")
        return Step(fn, logits[-1] if last_row else logits, out)

    # ------------------------------------------------------------------ API
    def reset(self) -> None:
        """A new sequence in the attached one's tensors: no committed tokens, every state tensor
        zeroed (a recurrent state must not carry over; position-indexed rows would be dead anyway)."""
        for tensors in self.states.values():
            for t in tensors:
                t.copyfrom(np.zeros(t.shape, t.dtype))
        self.pos = self.pending = 0
        self.history = []
        self.seq.fed = set()

    def prefill(self, tokens, all_logits: bool = False, on_chunk=None) -> Step:
        """Appends and commits the tokens in chunks; the last token's logits [V] (or every row), and
        every row's other outputs. on_chunk(done, total) is called after each chunk; returning True
        cancels the prefill."""
        ids = self._ids(tokens)
        self._room(len(ids))
        self.pending = 0
        parts = []
        for i in range(0, len(ids), self.chunk):
            part = ids[i:i + self.chunk]
            parts.append(self._step("prefill_all" if all_logits else "prefill", part))
            self.pos += len(part)
            self.history += part.tolist()
            if on_chunk is not None and on_chunk(i + len(part), len(ids)):
                raise Cancelled(f"prefill stopped after {i + len(part)} of {len(ids)} tokens")
        outputs = {k: np.concatenate([p.outputs[k] for p in parts]) for k in parts[0].outputs}
        logits = np.concatenate([p.logits for p in parts]) if all_logits else parts[-1].logits[-1]
        return Step(parts[0].fn, logits, outputs)

    def decode(self, token: int) -> Step:
        ids = self._ids([token])
        self._room(1)
        self.pending = 0
        step = self._step("decode", ids, last_row=True)
        self.decode_calls[1] += 1
        self.pos += 1
        self.history.append(int(token))
        return step

    def decode_batch(self, seqs: list[Sequence], tokens) -> list[Step]:
        """decode(tokens[i]) in each seqs[i], distinct sequences, in one call of the batched
        function of that many sequences where the artifact has one (else one decode each, in
        turn); each step's logits are those decode gives, bit for bit. The attached sequence stays
        attached."""
        fn = batch_name(len(seqs))
        if len(seqs) == 1 or fn not in self.functions:
            return self._in_turn(seqs, tokens, self.decode)
        ids = self._ids(tokens)
        if len(ids) != len(seqs) or len({id(s) for s in seqs}) != len(seqs):
            raise Ds4Error(f"decode_batch: {len(seqs)} distinct sequences and a token for each are expected")
        for s in seqs:
            self._room(1, s)
        order = list(range(len(seqs)))
        if self.functions[fn].recorded:   # rows where the sequences hold their recorded tensors
            order = self._residency.arranged(seqs, self.functions[fn].states)
        out = self.call(fn, [seqs[i] for i in order], ids=ids[order], starts=[seqs[i].pos for i in order])
        self.decode_calls[len(seqs)] += 1
        steps: list = [None] * len(seqs)
        for row, i in enumerate(order):
            steps[i] = Step("decode", out["logits"][row], {k: v[row:row + 1] for k, v in out.items() if k != "logits"})
            self._committed(seqs[i], ids[i:i + 1])
        return steps

    def _in_turn(self, seqs: list[Sequence], inputs, step) -> list[Step]:
        """step(inputs[i]) with seqs[i] attached, one after another; the attached sequence stays attached."""
        attached, steps = self.seq, []
        for seq, x in zip(seqs, inputs):
            self.attach(seq)
            steps.append(step(x))
        self.attach(attached)
        return steps

    def prefill_batch(self, seq: Sequence, tokens, seqs: list[Sequence], next_tokens) -> tuple[Step, list[Step]]:
        """prefill(tokens) of seq, a chunk of at most the compiled chunk's tokens, and decode_batch(seqs,
        next_tokens), in one call of the batched prefill of 1 + len(seqs) sequences where the
        artifact has one (the weights read once for both; else one after the other): each step as
        prefill and decode give it, bit for bit. The attached sequence stays attached."""
        fn, ids, nxt = batch_name(1 + len(seqs), "prefill"), self._ids(tokens), self._ids(next_tokens)
        if not seqs or fn not in self.functions:
            attached = self.seq
            self.attach(seq)
            try:
                chunk = self.prefill(ids)
            finally:
                self.attach(attached)
            return chunk, self.decode_batch(seqs, nxt) if seqs else []
        if len(nxt) != len(seqs) or len({id(s) for s in [seq, *seqs]}) != 1 + len(seqs) or not 0 < len(ids) <= self.chunk:
            raise Ds4Error(f"prefill_batch: a chunk of 1..{self.chunk} tokens and a token for each of "
                           f"{len(seqs)} other distinct sequences are expected")
        self._room(len(ids), seq)
        for s in seqs:
            self._room(1, s)
        out = self.call(fn, [seq, *seqs], ids=np.concatenate([ids, nxt]), starts=[s.pos for s in [seq, *seqs]])
        self.decode_calls[len(seqs)] += 1
        self.prefilled_beside_decodes += len(ids)
        n, rows = len(ids), len(seqs) + 1

        def of_row(i: int) -> dict:   # the other outputs of logits row i: per logits row, or per token
            return {k: v[i:i + 1] if v.shape[0] == rows else (v[:n] if i == 0 else v[n + i - 1:n + i])
                    for k, v in out.items() if k != "logits"}

        steps = [Step("prefill" if i == 0 else "decode", out["logits"][i], of_row(i)) for i in range(rows)]
        self._committed(seq, ids)
        for i, s in enumerate(seqs):
            self._committed(s, nxt[i:i + 1])
        return steps[0], steps[1:]

    def verify(self, tokens) -> Step:
        """Runs k <= max_verify tokens after the committed ones without committing them; the
        logits of every row [k, V]. Follow with commit(j) for the accepted prefix, or rollback()."""
        ids = self._ids(tokens)
        if not 1 <= len(ids) <= self.max_verify:
            raise Ds4Error(f"verify takes 1..{self.max_verify} tokens, got {len(ids)}")
        self._room(len(ids))
        step = self._step("verify", ids)
        self.verify_calls[1] += 1
        self.pending, self.seq.pending_tokens = len(ids), ids.tolist()
        return step

    def verify_batch(self, seqs: list[Sequence], blocks) -> list[Step]:
        """verify(blocks[i]) in each seqs[i], distinct sequences, in one call of the batched verify
        of that many sequences where the artifact has one (else one verify each, in turn): each
        step's logits [k_i, V] as verify gives them, bit for bit, each sequence left with its k_i
        rows pending. The attached sequence stays attached."""
        fn = batch_name(len(seqs), "verify")
        ids = [self._ids(b) for b in blocks]
        if len(ids) != len(seqs) or len({id(s) for s in seqs}) != len(seqs):
            raise Ds4Error(f"verify_batch: {len(seqs)} distinct sequences and a block for each are expected")
        if len(seqs) == 1 or fn not in self.functions:
            return self._in_turn(seqs, ids, self.verify)
        if not all(1 <= len(b) <= self.max_verify for b in ids):
            raise Ds4Error(f"verify takes 1..{self.max_verify} tokens, got blocks of {[len(b) for b in ids]}")
        for s, b in zip(seqs, ids):
            self._room(len(b), s)
        counts = [len(b) for b in ids]
        bounds = np.cumsum([0, *counts])
        out = self.call(fn, seqs, ids=np.concatenate(ids), starts=[s.pos for s in seqs], counts=counts,
                        offsets=bounds[:-1])
        self.verify_calls[len(seqs)] += 1
        steps = []
        for seq, b, lo, hi in zip(seqs, ids, bounds, bounds[1:]):
            steps.append(Step("verify", out["logits"][lo:hi], {n: v[lo:hi] for n, v in out.items() if n != "logits"}))
            seq.pending, seq.pending_tokens = len(b), b.tolist()
        return steps

    def call_batch(self, fn: str, seqs: list[Sequence], inputs: list[dict]) -> list[dict]:
        """call(fn, **inputs[i]) in each seqs[i], distinct sequences, in one call of fn's batched copy
        of that many sequences where the artifact has one (else one call each, in turn): each input
        the same rows for every sequence (fn's fixed ones: a drafter's step), each sequence's outputs
        as its own call gives them, bit for bit. The attached sequence stays attached."""
        name = batch_name(len(seqs), fn)
        if len(inputs) != len(seqs) or len({id(s) for s in seqs}) != len(seqs):
            raise Ds4Error(f"call_batch: {len(seqs)} distinct sequences and the inputs of each are expected")
        if len(seqs) == 1 or name not in self.functions:
            self.batched_calls[(fn, 1)] += len(seqs)
            return self._in_turn(seqs, inputs, lambda x: self.call(fn, **x))
        joined: dict = {}
        for arg, kind in self.functions[fn].inputs:
            if kind == "position":
                joined["starts"] = [x.get(arg, s.pos) for x, s in zip(inputs, seqs)]
                continue
            if any(x.get(arg) is None for x in inputs):
                raise Ds4Error(f"{fn}: input {arg!r} ({kind}) is missing")
            rows = [self._array(kind, x[arg]) for x in inputs]
            if len({len(r) for r in rows}) != 1:
                raise Ds4Error(f"call_batch: {fn} takes as many rows of {arg!r} for each sequence, "
                               f"got {[len(r) for r in rows]}")
            joined[arg] = np.concatenate(rows)
        out = self.call(name, seqs, **joined)
        self.batched_calls[(fn, len(seqs))] += 1
        each = {k: len(v) // len(seqs) for k, v in out.items()}   # every output: the same rows per sequence
        return [{k: v[i * each[k]:(i + 1) * each[k]] for k, v in out.items()} for i in range(len(seqs))]

    @property
    def step_calls(self) -> Counter:
        """Sequences per call of call_batch -> calls, every function's (a drafter's steps: /metrics)."""
        out: Counter = Counter()
        for (_, sequences), calls in self.batched_calls.items():
            out[sequences] += calls
        return out

    def commit(self, k: int) -> None:
        if not 0 <= k <= self.pending:
            raise Ds4Error(f"commit({k}): only {self.pending} verified rows are pending")
        self.pos += k
        self.history += self.seq.pending_tokens[:k]
        self.pending = 0

    def rollback(self) -> None:
        self.pending = 0

    @property
    def rewindable(self) -> int:
        """How many committed tokens rewind() can drop: what every ring of the groups in use keeps
        (StateSpec.rewind)."""
        return self.rewindable_of(self.seq)

    def rewindable_of(self, seq: Sequence) -> int:
        """rewindable for a sequence, attached or not."""
        return min([seq.pos] + [self._rewind_limits[g] for g in seq.fed if g in self._rewind_limits])

    def rewind(self, n: int) -> None:
        """Un-commits the last n tokens (n <= rewindable)."""
        if not 0 <= n <= self.rewindable:
            raise Ds4Error(f"rewind({n}): at most {self.rewindable} tokens can be rewound")
        self.pos -= n
        del self.history[len(self.history) - n:]
        self.pending = 0
