"""Compiled artifacts: a directory with manifest.json, the compiled library per target and the
tokenizer/template data; weights stay in their GGUF files (the model and any support files),
each referenced by path, size and fingerprint.

The manifest says everything the runtime needs to drive a model without knowing its family: the
state tensors (`StateSpec`), the compiled functions with their named inputs and outputs
(`FunctionSpec`), which GGUF file and plane each weight argument comes from, and the drafters
compiled in with their settings."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__
from .errors import Ds4Error

SCHEMA_VERSION = 6  # 3: typed states and functions, any number of weight files, drafters by name;
#                    4: states say how far they can be rewound and how tables map rows to positions;
#                    5: functions take a slice of the weight arguments, weight files may live in the artifact;
#                    6: the sha256 of the library and the tokenizer (`hashes`), checked before loading
MANIFEST = "manifest.json"
_FINGERPRINT_SPAN = 8 << 20


@dataclass(frozen=True)
class Bounds:
    """The shapes an artifact is compiled for: context length, widest verify, prefill chunk, and
    the most sequences one batched call decodes (1: no batched functions)."""
    max_context: int = 4096
    max_verify: int = 16
    prefill_chunk: int = 256
    max_batch: int = 1


BATCH_DEFAULT = 1   # max_batch of a manifest written before batched functions existed


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from a file of an artifact or package; anything else is one line naming it."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError) as e:   # ValueError: bad JSON, bad UTF-8
        raise Ds4Error(f"{path}: unreadable {what} ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise Ds4Error(f"{path}: malformed {what} (not a JSON object)")
    return data


def file_sha256(path: Path, on_block=None) -> str:
    """on_block(n): called after each block of n bytes is hashed (a progress bar's advance)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
            if on_block is not None:
                on_block(len(block))
    return h.hexdigest()


def file_fingerprint(path: Path) -> str:
    """A quick identity of a large file: its size with the hash of its first and last 8 MiB."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        if size > 2 * _FINGERPRINT_SPAN:
            f.seek(size - _FINGERPRINT_SPAN)
            h.update(f.read(_FINGERPRINT_SPAN))
        else:
            h.update(f.read())
    return h.hexdigest()


def file_identity(path: Path, inside: Path | None = None) -> dict:
    """How an artifact refers to a GGUF it was compiled from (the model, or a support file); a file
    the compiler wrote into the artifact directory `inside` is named relative to it (it moves with it)."""
    path = Path(path).resolve()
    name = str(path.relative_to(Path(inside).resolve())) if inside is not None else str(path)
    return {"gguf_path": name, "gguf_size": os.path.getsize(path), "gguf_sha256": file_sha256(path),
            "gguf_fingerprint": file_fingerprint(path)}


def weight_file(art_dir: Path, identity: dict) -> Path:
    """Where a weight file of the artifact at art_dir is (relative paths: inside it)."""
    path = Path(identity["gguf_path"])
    return path if path.is_absolute() else Path(art_dir) / path


def same_file(path: Path, identity: dict) -> bool:
    """Whether path is the file `identity` describes (size and fingerprint; no full hash)."""
    return os.path.getsize(path) == identity["gguf_size"] and file_fingerprint(path) == identity["gguf_fingerprint"]


MODEL = "model"   # the weight file role of the GGUF that was compiled; support files have others


@dataclass(frozen=True)
class StateSpec:
    """A state tensor the runtime allocates (zeroed) and passes to the functions of its group.
    ring: for state indexed by position modulo a length (rows or recurrent slots), that length;
    the runtime keeps `ring - 1` positions of room past the committed length.
    rewind: for a ring, how many committed positions can be dropped with what the functions read
    still in it (a window of w read before each row in a ring of n: n - w); 0 when not given.
    stride: for a table of rows by number (not a ring), positions per row: row j holds what
    positions < (j + 1) * stride made, so a checkpoint keeps only the rows of committed positions."""
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    group: str = MODEL
    ring: int | None = None
    rewind: int = 0
    stride: int | None = None

    @property
    def rewindable(self) -> int | None:
        """Committed positions this state can drop (None: any, a table whose rows stay valid)."""
        return self.rewind if self.ring is not None else None

    def rows_for(self, pos: int) -> int:
        """Leading rows (of dim 0) a checkpoint at committed length pos must keep."""
        if self.ring is not None or self.stride is None:
            return self.shape[0]
        return min(self.shape[0], -(-pos // self.stride))

    def to_json(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> "StateSpec":
        return cls(**{**d, "shape": tuple(d["shape"])})


# Input kinds of a FunctionSpec: token ids (int32, checked against the vocabulary before any
# call), a float32 or int32 tensor, the start position (a shape value), a batched function's start
# positions or row counts (a shape value per sequence: a batched verify's blocks' rows, the rows
# before each), or a host input that the family's provider computes from the call's inputs and the
# engine's token history (families.Family.host_inputs).
INPUT_KINDS = ("tokens", "float32", "int32", "position", "positions", "counts", "host")


BATCHED = ("decode", "prefill", "verify")   # what a batched function does for its sequences


def batch_name(sequences: int, kind: str = "decode") -> str:
    """The name of the target's batched function of that many sequences (FunctionSpec.sequences):
    its batched decode, its batched prefill (a prompt's chunk and a decode of each other sequence:
    FunctionSpec.chunked) or its batched verify (a block of rows of each: FunctionSpec.blocks); or,
    kind another function's name, that function's calls of that many sequences in one (a drafter's
    step of fixed rows: nn/functions.batched_copies)."""
    return f"{kind}_batch{sequences}"


def width_variant(fn: str, width: int) -> str:
    """The name of function fn's copy recorded at one token count (FunctionSpec.widths)."""
    return f"{fn}_w{width}"


@dataclass(frozen=True)
class FunctionSpec:
    """A compiled function: arguments are `inputs` in order, then the state tensors of the group
    `states` (if any), then the bound weights; it returns `outputs` in order, then (with states)
    the updated states, which are written in place. params: the slice [lo, hi) of the manifest's
    weight arguments it takes (None: all of them). recorded: the call's argument tensors are
    recorded by its first call (CUDA graphs replay their addresses; schedules/graphs.py): the
    caller passes the same tensors every time, the position as a [1] int64 tensor and each state
    tensor as its own argument. per_width: its family calls it with 1..max_verify rows, the length
    of its first input (a speculative cycle's verify, a drafter's observation of the rows it
    accepted), so that where functions are recorded a copy of it is compiled per width. widths:
    the widths at which such a copy, recorded, was compiled (a FunctionSpec of its own, named
    width_variant(name, width)): `Engine.call` runs that copy for a call of that many rows (CUDA
    graphs replay static shapes only). sequences: a batched function's count of sequences, one row
    each: its inputs hold a value per sequence (a "positions" input: each one's first position) and
    the state tensors of the group follow once per sequence. chunked: the first of those sequences
    brings the rows of a prefill chunk (the others one row each), and the function returns the
    logits of each sequence's last row (its other outputs: those of every row, or of the logits'
    rows). blocks: each sequence brings a block of 1..max_verify rows of its own (a batched
    verify; "counts" inputs hold each one's row count and the rows before it), and the function returns the logits of
    every row."""
    name: str
    inputs: tuple[tuple[str, str], ...]     # (name, kind)
    outputs: tuple[str, ...]
    states: str | None = None
    params: tuple[int, int] | None = None
    recorded: bool = False
    per_width: bool = False
    widths: tuple[int, ...] = ()
    sequences: int = 1
    chunked: bool = False
    blocks: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "inputs": [list(i) for i in self.inputs], "outputs": list(self.outputs),
                "states": self.states, "params": list(self.params) if self.params is not None else None,
                **({"recorded": True} if self.recorded else {}), **({"per_width": True} if self.per_width else {}),
                **({"widths": list(self.widths)} if self.widths else {}),
                **({"sequences": self.sequences} if self.sequences != 1 else {}),
                **({"chunked": True} if self.chunked else {}), **({"blocks": True} if self.blocks else {})}

    @classmethod
    def from_json(cls, d: dict) -> "FunctionSpec":
        params = d.get("params")
        return cls(d["name"], tuple(tuple(i) for i in d["inputs"]), tuple(d["outputs"]), d.get("states"),
                   tuple(params) if params is not None else None, bool(d.get("recorded", False)),
                   bool(d.get("per_width", False)), tuple(int(w) for w in d.get("widths", ())),
                   int(d.get("sequences", 1)), bool(d.get("chunked", False)), bool(d.get("blocks", False)))


@dataclass
class Manifest:
    family: str
    architecture: str
    target: dict
    target_name: str
    weights: dict                      # role -> file_identity(); MODEL is the compiled GGUF
    bounds: dict
    kv_rounding: bool
    functions: list[dict]              # FunctionSpec.to_json()
    params: list[list]                 # [argument, GGUF tensor, plane field or null, weight file role]
    states: list[dict]                 # StateSpec.to_json()
    library: str
    n_vocab: int = 0
    drafters: dict = field(default_factory=dict)   # drafter name -> its settings (the family's data)
    tokenizer: str = "tokenizer.json"
    device: str = "cpu"                # cpu | cuda | rocm | metal
    arches: list = field(default_factory=list)   # GPU architectures the library holds code for
    schema_version: int = SCHEMA_VERSION
    tvm_version: str = ""
    ds4tvm_version: str = __version__
    hashes: dict = field(default_factory=dict)   # file in the artifact -> sha256: the library, the tokenizer
    extra: dict = field(default_factory=dict)

    def state_specs(self) -> list[StateSpec]:
        return [StateSpec.from_json(d) for d in self.states]

    def function_specs(self) -> dict[str, FunctionSpec]:
        return {d["name"]: FunctionSpec.from_json(d) for d in self.functions}

    @property
    def model(self) -> dict:
        return self.weights[MODEL]

    def write(self, out_dir: Path) -> Path:
        path = Path(out_dir) / MANIFEST
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, art_dir: Path) -> "Manifest":
        path = Path(art_dir) / MANIFEST
        if not path.is_file():
            raise Ds4Error(f"{art_dir}: not a ds4tvm artifact (no {MANIFEST})")
        raw = read_json_object(path, "manifest")
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise Ds4Error(f"{path}: manifest schema {raw.get('schema_version')} is not {SCHEMA_VERSION}; "
                           f"recompile with this ds4tvm")
        try:
            m = cls(**raw)
        except TypeError as e:
            raise Ds4Error(f"{path}: malformed manifest ({e})") from None
        m._check_form(path)
        return m

    def _check_form(self, path: Path) -> None:
        """The fields the runtime indexes with are of the types it expects: an edited manifest is one
        line, not a traceback (or, for a vocabulary, an index past a table) later."""
        def bad(what: str):
            raise Ds4Error(f"{path}: malformed manifest (field {what})")

        for name in ("family", "library", "tokenizer", "device"):
            if not isinstance(getattr(self, name), str):
                bad(f"{name!r} is not a string")
        for name in (self.library, self.tokenizer):
            if Path(name).name != name or name in ("", ".", ".."):
                bad(f"{name!r}: a file name inside the artifact is expected")
        if not isinstance(self.n_vocab, int) or not 0 < self.n_vocab < 1 << 31:
            bad(f"'n_vocab' is {self.n_vocab!r}, expected a vocabulary size")
        if isinstance(self.bounds, dict):
            self.bounds.setdefault("max_batch", BATCH_DEFAULT)
        if not isinstance(self.bounds, dict) or not all(
                isinstance(self.bounds.get(k), int) and 0 < self.bounds[k] < 1 << 31 for k in asdict(Bounds())):
            bad("'bounds' lacks max_context, max_verify, prefill_chunk or max_batch as positive integers")
        for name, kind in (("weights", dict), ("functions", list), ("params", list), ("states", list),
                           ("drafters", dict), ("hashes", dict), ("extra", dict)):
            if not isinstance(getattr(self, name), kind):
                bad(f"{name!r} is not a {kind.__name__}")
        if not all(isinstance(w, dict) and isinstance(w.get("gguf_path"), str) for w in self.weights.values()):
            bad("'weights' holds an entry without a gguf_path")
        if not all(isinstance(p, list) and len(p) == 4 for p in self.params):
            bad("'params' holds an entry that is not [argument, tensor, plane, role]")
        try:
            self.state_specs(), self.function_specs()
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            bad(f"'states' or 'functions' holds a malformed entry ({type(e).__name__}: {e})")

    def check_files(self, art_dir: Path) -> None:
        """The library and the tokenizer are the files the compiler wrote (their sha256), checked
        before the library is loaded: loading a library runs its code."""
        for name in (self.library, self.tokenizer):
            want, path = self.hashes.get(name), Path(art_dir) / name
            if not isinstance(want, str):
                raise Ds4Error(f"{art_dir}: its manifest has no sha256 for {name}; recompile the artifact")
            if not path.is_file():
                raise Ds4Error(f"{art_dir}: {name} is missing")
            if file_sha256(path) != want:
                raise Ds4Error(f"{path}: does not match the sha256 its manifest gives (replaced or damaged); "
                               f"recompile the artifact or restore the file")

    def check_runtime(self, art_dir: Path) -> None:
        import tvm

        if self.tvm_version != tvm.__version__:
            raise Ds4Error(f"{art_dir}: built with TVM {self.tvm_version}, this is TVM {tvm.__version__}; "
                           f"recompile the artifact")
        if self.ds4tvm_version != __version__:
            raise Ds4Error(f"{art_dir}: built by ds4tvm {self.ds4tvm_version}, this is {__version__}; "
                           f"recompile the artifact")

    def weight_paths(self, art_dir: Path, overrides: dict | None = None) -> dict[str, Path]:
        """The weight file of every role, as compiled or as `overrides` (role -> path) say, each
        checked to be the file the artifact was compiled from."""
        out = {}
        for role, ident in self.weights.items():
            path = Path((overrides or {}).get(role) or weight_file(art_dir, ident))
            what = "GGUF" if role == MODEL else f"{role} file"
            if not path.is_file():
                hint = "; pass the model file with -m" if role == MODEL else ""
                raise Ds4Error(f"{art_dir}: its {what} {path} is missing{hint}")
            if not same_file(path, ident):
                raise Ds4Error(f"{art_dir}: was compiled from a different {what} than {path} "
                               f"(expected sha256 {ident['gguf_sha256'][:16]}..., {ident['gguf_size']} bytes)")
            out[role] = path
        return out
