"""The runtime engine: loads an artifact, binds the GGUF's weight planes once, owns the state
tensors and the committed length, and exposes prefill / decode / verify / commit / rollback.

State is append-only by position (see families/deepseek4/model.py): a verify writes rows for
positions past the committed length, commit(k) keeps the first k of them and rollback() drops
them, both by moving counters only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..artifact import Manifest, same_file
from ..errors import Cancelled, Ds4Error
from ..gguf import open_gguf
from ..gguf.quant import ALIGN, to_planes


def _runtime_sidecars(kind: str) -> None:
    """With TVM's runtime alone (loader.runtime_only_tvm), TVM registers neither the built-ins of
    its extra library (sort, top-k, used by the sampling kernels) nor a GPU's device API: load the
    libraries that hold them, as a full import of TVM does."""
    import tvm
    from tvm_ffi.libinfo import load_lib_ctypes

    if not tvm.base._RUNTIME_ONLY:
        return
    lib_dir = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    for name in ("tvm_runtime_extra", f"tvm_runtime_{kind}"):
        if name not in tvm.base._LOADED_LIBS and (lib_dir / f"lib{name}.so").is_file():
            try:
                tvm.base._LOADED_LIBS[name] = load_lib_ctypes("tvm", name, "RTLD_LOCAL", extra_lib_paths=[lib_dir])
            except OSError:   # no driver here (libcuda.so.1 missing): the device probe then finds none
                pass


def probe_device(kind: str):
    """(TVM device, its architecture or None) for cpu | cuda | rocm | metal; None when absent."""
    import tvm

    _runtime_sidecars(kind)

    if kind == "cpu":
        return tvm.cpu(), None
    open_device = {"cuda": tvm.cuda, "rocm": tvm.rocm, "metal": tvm.metal}.get(kind)
    dev = open_device(0) if open_device is not None else None
    if dev is None or not dev.exist:
        return None
    if kind == "cuda":
        return dev, "sm_" + dev.compute_version.replace(".", "")
    return dev, None


def device_for(m: Manifest, art_dir: Path):
    """The device an artifact's code runs on here, or one line saying why it cannot run here."""
    found = probe_device(m.device)
    if found is None:
        raise Ds4Error(f"{art_dir}: holds {m.target_name} code for a {m.device} GPU; this machine has none "
                       f"(compile the GGUF for it: ds4-compile --target cpu)")
    dev, arch = found
    if m.device == "cuda" and arch not in m.arches:
        raise Ds4Error(f"{art_dir}: holds code for {', '.join(m.arches)}; this GPU is {arch} "
                       f"(ds4-compile --target cuda:{arch})")
    return dev


class Engine:
    def __init__(self, artifact_dir: str | Path, gguf_path: str | Path | None = None,
                 support_path: str | Path | None = None):
        import tvm
        import tvm_ffi
        from tvm.runtime.vm import VirtualMachine

        self._tvm, self._Shape = tvm, tvm_ffi.Shape
        self.dir = Path(artifact_dir)
        self.manifest = m = Manifest.read(self.dir)
        m.check_runtime(self.dir)
        gguf_path = Path(gguf_path or m.gguf_path)
        if not gguf_path.is_file():
            raise Ds4Error(f"{self.dir}: its GGUF {gguf_path} is missing; pass the model file with -m")
        m.check_gguf(gguf_path, self.dir)
        self.gguf = open_gguf(gguf_path)
        self.draft = m.extra.get("draft")
        self.draft_gguf = None
        if self.draft is not None:
            dpath = Path(support_path or self.draft["gguf_path"])
            if not dpath.is_file():
                raise Ds4Error(f"{self.dir}: its DSpark support file {dpath} is missing")
            if not same_file(dpath, self.draft):
                raise Ds4Error(f"{self.dir}: was compiled with a different support file than {dpath}")
            self.draft_gguf = open_gguf(dpath)
        self.dev = device_for(m, self.dir)
        # TVM's CPU pool reads TVM_NUM_THREADS when it starts (at the first parallel kernel); left
        # unset it used one thread on this 2-core machine. Default: every core this process may use.
        os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
        lib = tvm.runtime.load_module(str(self.dir / m.library))
        self.vm = VirtualMachine(lib, self.dev)
        self.params = self._bind_params()
        for g in (self.gguf, self.draft_gguf):
            if g is not None:
                g.release_pages()
        self.states = [tvm.runtime.empty(tuple(shape), "float32", self.dev) for _, shape in m.states]
        self.rings = [tvm.runtime.empty(tuple(shape), "float32", self.dev)
                      for _, shape in (self.draft["rings"] if self.draft else [])]
        for s in self.states + self.rings:
            s.copyfrom(np.zeros(s.shape, np.float32))
        b = m.bounds
        self.max_context, self.max_verify, self.chunk = b["max_context"], b["max_verify"], b["prefill_chunk"]
        self.n_vocab = int(self.gguf.tensors["token_embd.weight"].shape[1])
        self.captured = None  # [n, len(capture_layers), D] of the last call, when compiled with capture
        self.pos = 0          # committed tokens
        self.pending = 0      # rows written by the last verify, not yet committed
        self.tokenizer_data = json.loads((self.dir / m.tokenizer).read_text())

    def _bind_params(self) -> list:
        planes, out = {}, []
        for _, tensor, field, source in self.manifest.params:
            t = (self.draft_gguf if source == "draft" else self.gguf).tensors[tensor]
            if field is None:
                out.append(self._to_device(np.ascontiguousarray(t.data)))
                continue
            if tensor not in planes:
                planes[tensor] = to_planes(t.data, t.ggml_type, tuple(reversed(t.shape)))
            out.append(self._to_device(planes[tensor].fields[field]))
        return out

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

    def _call(self, fn: str, ids: np.ndarray) -> np.ndarray:
        tvm = self._tvm
        out = self.vm[fn](tvm.runtime.tensor(ids, self.dev), self._Shape([self.pos]), self.states, *self.params)
        if len(out) == 3:  # artifacts paired with a drafter also return the captured layers [n, L, D]
            self.captured = out[1].numpy()
        return out[0].numpy()

    # ------------------------------------------------------------------ API
    def reset(self) -> None:
        self.pos = self.pending = 0

    def prefill(self, tokens, all_logits: bool = False, on_chunk=None) -> np.ndarray:
        """Appends and commits the tokens in chunks; the last token's logits [V] (or every row).
        on_chunk(done, total) is called after each chunk; returning True cancels the prefill."""
        ids = self._ids(tokens)
        self._room(len(ids))
        self.pending = 0
        rows, captured = [], []
        for i in range(0, len(ids), self.chunk):
            part = ids[i:i + self.chunk]
            out = self._call("prefill_all" if all_logits else "prefill", part)
            rows.append(out)
            if self.captured is not None:
                captured.append(self.captured)
            self.pos += len(part)
            if on_chunk is not None and on_chunk(i + len(part), len(ids)):
                raise Cancelled(f"prefill stopped after {i + len(part)} of {len(ids)} tokens")
        if captured:
            self.captured = np.concatenate(captured)
        return np.concatenate(rows) if all_logits else rows[-1][-1]

    def decode(self, token: int) -> np.ndarray:
        ids = self._ids([token])
        self._room(1)
        self.pending = 0
        out = self._call("decode", ids)[0]
        self.pos += 1
        return out

    def verify(self, tokens) -> np.ndarray:
        """Runs k <= max_verify tokens after the committed ones without committing them; the
        logits of every row [k, V]. Follow with commit(j) for the accepted prefix, or rollback()."""
        ids = self._ids(tokens)
        if not 1 <= len(ids) <= self.max_verify:
            raise Ds4Error(f"verify takes 1..{self.max_verify} tokens, got {len(ids)}")
        self._room(len(ids))
        out = self._call("verify", ids)
        self.pending = len(ids)
        return out

    def commit(self, k: int) -> None:
        if not 0 <= k <= self.pending:
            raise Ds4Error(f"commit({k}): only {self.pending} verified rows are pending")
        self.pos += k
        self.pending = 0

    def rollback(self) -> None:
        self.pending = 0

    def rewind(self, n: int) -> None:
        """Un-commits the last n tokens (n <= max_verify, which the rings keep room for)."""
        if not 0 <= n <= min(self.pos, self.max_verify):
            raise Ds4Error(f"rewind({n}): at most {min(self.pos, self.max_verify)} tokens can be rewound")
        self.pos -= n
        self.pending = 0

    # ------------------------------------------------------------------ DSpark drafter
    def dspark_observe(self, captured: np.ndarray, start: int, direct: bool) -> None:
        """Writes the drafter's context rows for committed positions start.. (captured rows)."""
        fn = "dspark_observe_direct" if direct else "dspark_observe"
        self.vm[fn](self._tvm.runtime.tensor(np.ascontiguousarray(captured, np.float32), self.dev),
                    self._Shape([start]), self.rings, *self.params)

    def dspark_block(self, captured_row: np.ndarray, tokens: list[int], start: int) -> np.ndarray:
        out = self.vm["dspark_block"](self._tvm.runtime.tensor(np.ascontiguousarray(captured_row[None], np.float32),
                                                               self.dev),
                                      self._tvm.runtime.tensor(self._ids(tokens), self.dev), self._Shape([start]),
                                      self.rings, *self.params)
        return out.numpy()

    def dspark_logits(self, r: np.ndarray) -> np.ndarray:
        return self.vm["dspark_logits"](self._tvm.runtime.tensor(np.ascontiguousarray(r, np.float32), self.dev),
                                        *self.params).numpy()

    def dspark_markov(self, prev: int) -> tuple[np.ndarray, np.ndarray]:
        m, bias = self.vm["dspark_markov"](self._tvm.runtime.tensor(self._ids([prev]), self.dev), *self.params)
        return m.numpy()[0], bias.numpy()[0]
