"""A family module's compiled functions, each declared once (`Fn`): its inputs with their kinds and
shapes, its outputs, the state group it reads and writes, whether it is called with 1..max_verify
rows. The manifest's FunctionSpecs and the export spec TVM reads both come from the declarations
(`Declared`), and `TargetFunctions` is the surface every target module shares: prefill,
prefill_all, decode and verify over one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..artifact import BATCHED, FunctionSpec, batch_name
from .state import VERIFY_ROWS

MODE = {"param_mode": "plain", "effect_mode": "none"}
# the row count of each target function's token inputs: a prefill chunk, one token, a verify block
TARGET_ROWS = {"prefill": "n", "prefill_all": "n", "decode": 1, "verify": VERIFY_ROWS}


@dataclass(frozen=True)
class Arg:
    """An input: its name (the method's parameter), its kind in the manifest (tokens, position,
    host, float32, ...), and for a tensor its shape (ints, or names of symbolic sizes) and dtype;
    a position is the call's first position, a host int; "positions" (batched functions) the
    first position of each sequence, a host int per sequence; "counts" (a batched verify) a row
    count per sequence, a host int each (its block's rows, the call's rows before its block)."""
    name: str
    kind: str
    shape: tuple = ()
    dtype: str = "float32"

    def export(self, sequences: int = 1):
        if self.kind in ("positions", "counts"):
            return [int] * sequences
        return int if self.kind == "position" else nn.spec.Tensor(list(self.shape), self.dtype)


def tokens(rows, name: str = "tokens") -> Arg:
    return Arg(name, "tokens", (rows,), "int32")


START = Arg("start", "position")
STARTS = Arg("starts", "positions")
COUNTS = Arg("counts", "counts")
OFFSETS = Arg("offsets", "counts")


@dataclass(frozen=True)
class Fn:
    """A compiled function: its inputs in order, then (with `states`) the state tensors of that
    group as one argument named `state_arg` (a batched function, of `sequences` > 1 sequences: a
    list of them, one per sequence); outputs by name, then the updated states."""
    name: str
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]
    states: str | None = None
    per_width: bool = False
    state_arg: str = "states"
    sequences: int = 1
    chunked: bool = False
    blocks: bool = False
    method: str | None = None   # a batched copy's method (batched_copies); else the kind's (Declared.spec)

    def function_spec(self) -> FunctionSpec:
        return FunctionSpec(self.name, tuple((a.name, a.kind) for a in self.args), self.outputs, self.states,
                            per_width=self.per_width, sequences=self.sequences, chunked=self.chunked,
                            blocks=self.blocks)

    def export_spec(self, state_specs: list) -> dict:
        spec = {a.name: a.export(self.sequences) for a in self.args}
        if self.states is not None:
            one = [nn.spec.Tensor(list(s.shape), s.dtype) for s in state_specs if s.group == self.states]
            spec[self.state_arg] = one if self.sequences == 1 else [list(one) for _ in range(self.sequences)]
        return {**spec, "$": MODE}


def target_functions(args, outputs: tuple[str, ...], max_batch: int = 1) -> list[Fn]:
    """prefill, prefill_all, decode and verify of a target module: args(rows) gives the inputs of a
    call of `rows` rows (TARGET_ROWS), the model's states follow; verify is called with 1..max_verify
    rows. A module whose decode_batch decodes several sequences in one call (max_batch > 1) adds
    batch_name(b) for b = 2..max_batch: one row per sequence, STARTS for their positions; its
    prefill_batch, batch_name(b, "prefill"): a prompt's chunk and b - 1 decodes in one call; and
    its verify_batch, batch_name(b, "verify"): a block of rows of each of b sequences, their row
    counts in COUNTS and the rows before each block in OFFSETS, after STARTS."""
    out = [Fn(f, tuple(args(rows)), outputs, "model", per_width=f == "verify") for f, rows in TARGET_ROWS.items()]
    for kind in BATCHED:
        out += [Fn(batch_name(b, kind), _batched_inputs(args, kind, b), outputs, "model", sequences=b,
                   chunked=kind == "prefill", blocks=kind == "verify") for b in range(2, max_batch + 1)]
    return out


def batched_copies(fn: Fn, args, max_batch: int, method: str) -> list[Fn]:
    """fn's batched copies, batch_name(b, fn.name) for b = 2..max_batch, implemented by the module's
    `method`: fn's call for each of b sequences in one (args(b) gives their inputs, each sequence's
    rows one after another, START among them, which becomes STARTS), each sequence's states of fn's
    group, fn's outputs the same rows per sequence, one sequence after another. For a drafter's
    step of fixed rows, so that the scheduler runs the steps of several generations in one call
    (Engine.call_batch)."""
    return [Fn(batch_name(b, fn.name), tuple(STARTS if a == START else a for a in args(b)), fn.outputs, fn.states,
               state_arg=fn.state_arg, sequences=b, method=method) for b in range(2, max_batch + 1)]


class Sequences:
    """The sequences whose rows a call holds (one; several of one row each: a batched decode; or,
    chunked, a prompt's chunk first and one row of each other: a batched prefill; or, with
    `counts`, a block of rows of each, counts[i] rows of sequence i: a batched verify): each one's
    first position and state tensors by name, updated as its sublayers write them. The sublayers
    that read and write a sequence's state run per sequence (`per_sequence`), everything else on
    all rows at once."""

    def __init__(self, state_names: list[str], sequences: list[tuple], chunked: bool = False, counts=None,
                 offsets=None):
        self.names, self.chunked, self.counts, self.offsets = state_names, chunked, counts, offsets
        self.starts = [start for start, _ in sequences]
        self.states = [dict(zip(state_names, states)) for _, states in sequences]
        self.chunk = tirx.Var("chunk", "int64")   # the rows of a batched prefill's chunk
        self.verify_rows = [tirx.Var(VERIFY_ROWS, "int64") for _ in sequences]   # a batched verify's blocks' rows

    def __len__(self) -> int:
        return len(self.starts)

    def split(self, x: nn.Tensor) -> list[nn.Tensor]:
        """x's rows of each sequence."""
        if len(self) == 1:
            return [x]
        if self.counts is not None:   # each block stated verify's row count: its kernels are verify's
            return [with_rows(block_rows(x, first, rows), k)
                    for first, rows, k in zip(self.offsets, self.counts, self.verify_rows)]
        if not self.chunked:
            return list(op.split(x, len(self), axis=0))
        others = len(self) - 1   # (relax's split takes constant indices only)
        # The chunk's rows (n - others of the call's n) named as a row count of their own: the
        # kernels of its per-sequence work (RoPE, norms, attention, the compressors) are then
        # prefill's, not a copy for n - 1, n - 2, ... per batch size (~40 kernels each).
        chunk = with_rows(rows_of(x, lambda n: 0, lambda n: n - others, "chunk_rows"), self.chunk)
        return [chunk] + [rows_of(x, lambda n, i=i: n - others + i, lambda n: 1, "decode_row") for i in range(others)]

    def per_sequence(self, x, prefix: str, fn) -> nn.Tensor:
        """fn(i, rows, start, states) -> (rows, new states) applied to each sequence's rows of x with
        its state tensors under prefix (names without it), concatenated back. x: a tensor, or a
        list of tensors of the same rows (fn then gets the list of each one's rows)."""
        out = []
        pieces = [list(p) for p in zip(*map(self.split, x))] if isinstance(x, list) else self.split(x)
        for i, rows in enumerate(pieces):
            mine = {k[len(prefix):]: v for k, v in self.states[i].items() if k.startswith(prefix)}
            rows, new = fn(i, rows, self.starts[i], mine)
            self.states[i].update({prefix + k: v for k, v in new.items()})
            out.append(rows)
        rows = out[0] if len(out) == 1 else op.concat(out, dim=0)
        if self.counts is None:
            # (a batched prefill's rows come back as chunk + others rows: stating them n again, a second
            # match_cast, sent TVM 0.27's KillAfterLastUse into a recursion that overflowed the stack)
            return rows
        # a batched verify's blocks stated the call's rows again: with k0 + k1 + ... rows beside k,
        # FuseTIR fails on the GPU forms ("All shape inputs are expected to be single tirx var")
        return with_rows(rows, (x[0] if isinstance(x, list) else x).shape[0])

    def outputs(self) -> list[tuple]:
        """Every sequence's state tensors, in the names' order: what the function returns last."""
        return [tuple(m[k] for k in self.names) for m in self.states]


class Declared:
    """FunctionSpecs and the export spec of a module from its `functions()` declarations and its
    `state_specs()`."""

    def exported(self) -> list[Fn]:
        """functions(), less the batched prefills in the GPU forms, where a GPU prefills a chunk in
        a call of its own: the chunk's rows (n - b of a call's n) reach Qwen3.8's fused kernels as
        two expressions (n - 1 + 3 - 3 beside n - 1) and FuseTIR fails ("VarRemapGet(source) ==
        nullptr"; with the chunk's own row count, "All shape inputs are expected to be single tirx
        var"; stating its rows n again crashes: Sequences.per_sequence). A drafter step's batched
        copies are left out of the GPU forms too: never built or run on a GPU yet (a GPU drafts
        one sequence at a time, as before them)."""
        gpu = getattr(getattr(self, "forms", None), "gpu", False)
        return [f for f in self.functions() if not ((f.chunked or f.method) and gpu)]

    def function_specs(self) -> list[FunctionSpec]:
        return [f.function_spec() for f in self.exported()]

    def spec(self) -> dict:
        states = self.state_specs()
        for f in self.exported():
            if f.sequences > 1:   # every batch size is one method; TVM finds it under each name
                setattr(self, f.name, getattr(self, f.method) if f.method else self.prefill_batch if f.chunked
                        else self.verify_batch if f.blocks else self.decode_batch)
        return {f.name: f.export_spec(states) for f in self.exported()}


def _batched_inputs(args, kind: str, sequences: int) -> tuple[Arg, ...]:
    """A batched function's inputs: those of a call of its rows (one per sequence; a prompt's
    chunk and one each; verify blocks, counted as verify's rows (nn/state.few_rows), so that its
    all-rows kernels are verify's, whose rows do not depend on each other: each block's logits are
    its verify's bit for bit), with STARTS for START and, in a batched verify, COUNTS and OFFSETS after it."""
    rows = {"decode": sequences, "prefill": TARGET_ROWS["prefill"], "verify": TARGET_ROWS["verify"]}[kind]
    batched = (STARTS, COUNTS, OFFSETS) if kind == "verify" else (STARTS,)
    return tuple(x for a in args(rows) for x in (batched if a == START else (a,)))


class TargetFunctions(Declared):
    """The target functions of a module whose _rows(ids, sequences: Sequences, last) computes them
    (the logits of the last `last` rows, every row's with None: prefill its last row's, a batched
    prefill each sequence's last row's), its state tensors' names in `state_names`."""

    def prefill(self, ids: nn.Tensor, start, states):
        """A chunk of the prompt; logits of its last token [1, V], extra outputs of every token."""
        return self._forward(ids, start, states, last_only=True)

    def prefill_all(self, ids: nn.Tensor, start, states):
        """A chunk with the logits of every token [n, V] (oracle comparisons)."""
        return self._forward(ids, start, states, last_only=False)

    def decode(self, ids: nn.Tensor, start, states):
        return self._forward(ids, start, states, last_only=False)

    def verify(self, ids: nn.Tensor, start, states):
        """k <= max_verify tokens; logits of every row, so any prefix can be committed."""
        return self._forward(ids, start, states, last_only=False)

    def decode_batch(self, ids: nn.Tensor, starts, states):
        """One token of each of len(starts) sequences (row i of sequence i at starts[i], in
        states[i]); logits of every row, then every sequence's states."""
        return self._rows(ids, Sequences(self.state_names, list(zip(starts, states))), last=None)

    def prefill_batch(self, ids: nn.Tensor, starts, states):
        """A prompt's chunk (the first sequence's rows) and one token of each other sequence; the
        logits of each sequence's last row, then every sequence's states."""
        return self._rows(ids, Sequences(self.state_names, list(zip(starts, states)), chunked=True), last=len(starts))

    def verify_batch(self, ids: nn.Tensor, starts, counts, offsets, states):
        """A block of counts[i] rows of each of len(starts) sequences, one after another (offsets[i]
        rows before it); the logits of every row, then every sequence's states."""
        return self._rows(ids, Sequences(self.state_names, list(zip(starts, states)), counts=counts, offsets=offsets),
                          last=None)

    def _forward(self, ids, start, states, last_only: bool):
        return self._rows(ids, Sequences(self.state_names, [(start, states)]), last=1 if last_only else None)


def rows_of(x: nn.Tensor, first, count, name: str) -> nn.Tensor:
    """count(n) rows of x from row first(n) (its first axis, of n rows)."""
    from tvm import te

    def rows(t):
        n = t.shape[0]
        return te.compute((count(n), *t.shape[1:]), lambda r, *i: t[first(n) + r, *i], name=name)

    return op.tensor_expr_op(rows, name, [x])


def block_rows(x: nn.Tensor, offset, count) -> nn.Tensor:
    """The `count` rows of x from row `offset`, both symbolic values of the call (a batched verify's
    OFFSETS and COUNTS: one kernel for every block)."""
    from tvm import te

    def rows(t, first, n):
        return te.compute((n, *t.shape[1:]), lambda r, *i: t[first + r, *i], name="block_rows")

    return op.tensor_expr_op(rows, "block_rows", [x, offset, count])


def with_rows(x: nn.Tensor, rows) -> nn.Tensor:
    """x, its first axis stated to be `rows` (a symbolic row count, defined at its first
    statement), checked when the function runs."""
    from tvm import relax

    ty = relax.TensorType([rows, *x.shape[1:]], x.dtype)
    return nn.Tensor(_expr=relax.BlockBuilder.current().match_cast(x._expr, ty))


def last_rows(x: nn.Tensor, last: int | None, name: str = "last_rows") -> nn.Tensor:
    """The last `last` rows of x (its first axis; None: x)."""
    return x if last is None else rows_of(x, lambda n: n - last, lambda n: last, name)
