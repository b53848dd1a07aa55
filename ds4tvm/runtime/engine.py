"""The runtime engine: loads an artifact, binds the weight planes of its GGUF files once, owns the
state tensors its manifest describes (StateSpec), the committed length and token history, and
exposes prefill / decode / verify / commit / rollback, plus `call` for any other compiled function
(FunctionSpec) - the drafters' functions. It knows no family: the manifest says everything.

State is indexed by position (DESIGN.md): a verify writes rows (or recurrent slots) for positions
past the committed length, commit(k) keeps the first k of them and rollback() drops them, both by
moving counters only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..artifact import MODEL, FunctionSpec, Manifest
from ..devices import device_for
from ..errors import Cancelled, Ds4Error
from ..gguf import open_gguf
from ..gguf.quant import ALIGN, to_planes


@dataclass
class Step:
    """One target call: the logits ([V] for the last row, or [k, V]) and the function's other
    named outputs (e.g. captured hidden states, per-row hidden states), one row per token."""
    fn: str
    logits: np.ndarray
    outputs: dict = field(default_factory=dict)


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
        self.files = {role: open_gguf(p) for role, p in m.weight_paths(self.dir, weights).items()}
        self.gguf = self.files[MODEL]
        self.drafters = m.drafters
        self.functions = m.function_specs()
        self.dev = device_for(m, self.dir)
        # TVM's CPU pool reads TVM_NUM_THREADS when it starts (at the first parallel kernel); left
        # unset it used one thread on this 2-core machine. Default: every core this process may use.
        os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
        lib = tvm.runtime.load_module(str(self.dir / m.library))
        self.vm = VirtualMachine(lib, self.dev)
        self.params = self._bind_params()
        for g in self.files.values():
            g.release_pages()
        self.state_specs = m.state_specs()
        self.states: dict[str, list] = {}
        for s in self.state_specs:
            self.states.setdefault(s.group, []).append(tvm.runtime.empty(s.shape, s.dtype, self.dev))
        self.host_inputs = self._host_inputs()
        b = m.bounds
        self.max_context, self.max_verify, self.chunk = b["max_context"], b["max_verify"], b["prefill_chunk"]
        self.n_vocab = m.n_vocab
        self.tokenizer_data = json.loads((self.dir / m.tokenizer).read_text())
        self.reset()

    def _bind_params(self) -> list:
        planes, out = {}, []
        for _, tensor, field_, role in self.manifest.params:
            t = self.files[role].tensors[tensor]
            if field_ is None:
                out.append(self._to_device(np.ascontiguousarray(t.data)))
                continue
            if (role, tensor) not in planes:
                planes[role, tensor] = to_planes(t.data, t.ggml_type, tuple(reversed(t.shape)))
            out.append(self._to_device(planes[role, tensor].fields[field_]))
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

    def _room(self, n: int) -> None:
        if self.pos + n > self.max_context:
            raise Ds4Error(f"{self.pos + n} tokens exceed the compiled context of {self.max_context} "
                           f"(ds4-compile --max-context)")

    # ------------------------------------------------------------------ calls
    def _argument(self, kind: str, value):
        if kind == "position":
            return self._Shape([int(value)])
        if kind == "tokens":
            return self._tvm.runtime.tensor(self._ids(value), self.dev)
        return self._tvm.runtime.tensor(np.ascontiguousarray(value, np.int32 if kind == "int32" else np.float32),
                                        self.dev)

    def call(self, fn: str, **inputs) -> dict[str, np.ndarray]:
        """Runs compiled function fn with its FunctionSpec's inputs by name (a "start" position
        defaults to the committed length; a host input is computed by its family's provider from
        the call's other inputs and the engine, e.g. its token history) and returns its named
        outputs."""
        spec: FunctionSpec = self.functions.get(fn)
        if spec is None:
            raise Ds4Error(f"{self.dir}: has no function {fn!r}; it has {', '.join(sorted(self.functions))}")
        args = []
        for name, kind in spec.inputs:
            if kind == "host":
                value = self.host_inputs[name](self, inputs)
            else:
                value = inputs.get(name, self.pos if kind == "position" else None)
            if value is None:
                raise Ds4Error(f"{fn}: input {name!r} ({kind}) is missing")
            args.append(self._argument(kind, value))
        if spec.states is not None:
            args.append(self.states[spec.states])
        result = self.vm[fn](*args, *self.params)
        result = [result] if hasattr(result, "numpy") else list(result)
        return {name: result[i].numpy() for i, name in enumerate(spec.outputs)}

    def _step(self, fn: str, ids: np.ndarray, last_row: bool = False) -> Step:
        out = self.call(fn, ids=ids, start=self.pos)
        logits = out.pop("logits")
        return Step(fn, logits[-1] if last_row else logits, out)

    # ------------------------------------------------------------------ API
    def reset(self) -> None:
        """A new sequence: no committed tokens, and every state tensor zeroed (a recurrent state
        must not carry over; position-indexed rows would be dead anyway)."""
        for tensors in self.states.values():
            for t in tensors:
                t.copyfrom(np.zeros(t.shape, t.dtype))
        self.pos = self.pending = 0
        self.history: list[int] = []        # committed tokens
        self._pending_tokens: list[int] = []

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
        self.pos += 1
        self.history.append(int(token))
        return step

    def verify(self, tokens) -> Step:
        """Runs k <= max_verify tokens after the committed ones without committing them; the
        logits of every row [k, V]. Follow with commit(j) for the accepted prefix, or rollback()."""
        ids = self._ids(tokens)
        if not 1 <= len(ids) <= self.max_verify:
            raise Ds4Error(f"verify takes 1..{self.max_verify} tokens, got {len(ids)}")
        self._room(len(ids))
        step = self._step("verify", ids)
        self.pending, self._pending_tokens = len(ids), ids.tolist()
        return step

    def commit(self, k: int) -> None:
        if not 0 <= k <= self.pending:
            raise Ds4Error(f"commit({k}): only {self.pending} verified rows are pending")
        self.pos += k
        self.history += self._pending_tokens[:k]
        self.pending = 0

    def rollback(self) -> None:
        self.pending = 0

    def rewind(self, n: int) -> None:
        """Un-commits the last n tokens (n <= max_verify, which the rings keep room for)."""
        if not 0 <= n <= min(self.pos, self.max_verify):
            raise Ds4Error(f"rewind({n}): at most {min(self.pos, self.max_verify)} tokens can be rewound")
        self.pos -= n
        del self.history[len(self.history) - n:]
        self.pending = 0
