"""State written in place and indexed by position (DESIGN.md "Model state"), so that a verify of k
rows followed by commit(j) is a counter change and rollback a no-op, for every kind of state:

- position rings (`gather_context` / `ring_write`): rows of the last `size` positions, slot
  pos % size: attention K/V windows, compressor frontiers, conv and token histories;
- recurrent snapshot slots (`recurrent_read` / `recurrent_write`): a recurrent state (KDA, GDN) kept
  as a ring of R >= max_verify + 1 slots, slot p % R holding the state *before* position p; a call
  starting at position s reads slot s (zeros at s = 0) and writes the state after each of its rows
  into the slots of the positions that follow, so the state before any committed length is there
  to pick. R > max_verify keeps a verify from overwriting the slot it started from;
- row tables by number (`emit_rows`): one row per `ratio` positions (compressed or pooled rows),
  written when the last position of its window is run.
"""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from ..kernels.slots import context_row
from ..kernels.tags import GATHER
from ..kernels.forms import Forms

F32 = "float32"


def gather_context(ring: nn.Tensor, new: nn.Tensor, start, before: int, name: str) -> nn.Tensor:
    """Rows for positions start-before .. start+n-1: the `before` older ones from the ring (slot
    pos % size; positions < 0 are zeros), then the n new rows. Read before the ring is updated."""
    def f(ring_te, new_te, s):
        return te.compute((new_te.shape[0] + before, ring_te.shape[1]), context_row(ring_te, new_te, s, before),
                          name=name)

    return op.tensor_expr_op(f, name, [ring, new, start], attrs={GATHER: 1})


def context_rows(ring: nn.Tensor, new: nn.Tensor, start, before: int, name: str, *, forms: Forms):
    """gather_context's rows for a reader that takes RingRows: left in the ring in the GPU forms,
    gathered into a tensor on the CPU (whose kernels are scheduled for that tensor)."""
    if forms.gpu:
        return RingRows(ring, new, before)
    return gather_context(ring, new, start, before, name)


class RingRows:
    """gather_context's rows left in the ring, for a reader's kernel to index in place (the GPU
    forms: a launch and a copy fewer per context). A reader takes `args(x)` among its kernel's
    arguments and reads the TE tensors they become through `rows_reader`; a plain tensor reads as
    itself, so one reader serves both."""

    def __init__(self, ring: nn.Tensor, new: nn.Tensor, before: int):
        self.ring, self.new, self.before = ring, new, before


def args(x) -> list:
    """The kernel arguments of x: a tensor, or a RingRows' ring and new rows."""
    return [x.ring, x.new] if isinstance(x, RingRows) else [x]


def rows_reader(x, te_args: list, s):
    """(element accessor (row, channel), row count) of x from the front of te_args (as args(x)
    put them), which it consumes; s the call's start position."""
    if not isinstance(x, RingRows):
        t = te_args.pop(0)
        return (lambda r, c: t[r, c]), t.shape[0]
    ring_te, new_te = te_args.pop(0), te_args.pop(0)
    return context_row(ring_te, new_te, s, x.before), new_te.shape[0] + x.before


@functools.lru_cache(maxsize=None)
def _ring_write_func(size: int, width: int):
    @T.prim_func(s_tir=True)
    def ring_write(ring: T.handle, rows: T.handle, start: T.int64):
        n = T.int64()
        R = T.match_buffer(ring, (size, width), "float32")
        X = T.match_buffer(rows, (n, width), "float32")
        for i, j in T.grid(n, width):
            with T.sblock("write"):
                vi, vj = T.axis.remap("SS", [i, j])
                if vi + size >= n:  # only the last `size` rows can survive in the ring
                    R[T.floormod(start + vi, size), vj] = X[vi, vj]
    return ring_write.with_attr("global_symbol", f"ring_write_{size}x{width}")


def ring_write(ring: nn.Tensor, rows: nn.Tensor, start, name: str) -> nn.Tensor:
    """Writes rows for positions start.. into the ring in place. Callers emit it after every read
    of the ring's old rows (gather_context): the VM runs bindings in order, and the CPU pipeline
    does not fuse (schedules/llvm.py), so no read can move past the write."""
    size, width = ring.shape
    func = _ring_write_func(int(size), int(width))
    return op.tensor_ir_inplace_op(func, f"ring_write_{size}x{width}", args=[ring, rows, start], inplace_indices=[0],
                                   out=nn.Tensor.placeholder(ring.shape, ring.dtype))


@functools.lru_cache(maxsize=None)
def _ring_write_pair_func(size: int, width: int):
    @T.prim_func(s_tir=True)
    def ring_write_pair(ring_a: T.handle, ring_b: T.handle, rows_a: T.handle, rows_b: T.handle, start: T.int64):
        n = T.int64()
        RA = T.match_buffer(ring_a, (size, width), "float32")
        RB = T.match_buffer(ring_b, (size, width), "float32")
        XA = T.match_buffer(rows_a, (n, width), "float32")
        XB = T.match_buffer(rows_b, (n, width), "float32")
        for i, j in T.grid(n, width):
            with T.sblock("write"):
                vi, vj = T.axis.remap("SS", [i, j])
                if vi + size >= n:
                    RA[T.floormod(start + vi, size), vj] = XA[vi, vj]
                    RB[T.floormod(start + vi, size), vj] = XB[vi, vj]
    return ring_write_pair.with_attr("global_symbol", f"ring_write_pair_{size}x{width}")


def ring_write_pair(rings: tuple, rows: tuple, start, names: tuple, *, forms: Forms) -> tuple:
    """ring_write of two rings of one shape written at the same positions (a compressor's
    projections and scores); in the GPU forms one kernel."""
    if not forms.gpu or rings[0].shape != rings[1].shape:
        return tuple(ring_write(r, x, start, name=name) for r, x, name in zip(rings, rows, names))
    size, width = rings[0].shape
    func = _ring_write_pair_func(int(size), int(width))
    out = op.tensor_ir_inplace_op(func, func.attrs["global_symbol"], args=[*rings, *rows, start],
                                  inplace_indices=[0, 1], out=[nn.Tensor.placeholder(r.shape, r.dtype) for r in rings])
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _compressor_write_func(rows: int, row_width: int, size: int, width: int, ratio: int):
    W = max(row_width, width)

    @T.prim_func(s_tir=True)
    def compressor_write(table: T.handle, ring_a: T.handle, ring_b: T.handle, cand: T.handle, rows_a: T.handle,
                         rows_b: T.handle, start: T.int64):
        n = T.int64()
        R = T.match_buffer(table, (rows, row_width), "float32")
        RA = T.match_buffer(ring_a, (size, width), "float32")
        RB = T.match_buffer(ring_b, (size, width), "float32")
        X = T.match_buffer(cand, (n, row_width), "float32")
        XA = T.match_buffer(rows_a, (n, width), "float32")
        XB = T.match_buffer(rows_b, (n, width), "float32")
        for i, j in T.grid(n, W):
            with T.sblock("write"):
                vi, vj = T.axis.remap("SS", [i, j])
                if vj < row_width and T.floormod(start + vi + 1, ratio) == 0 and \
                        T.floordiv(start + vi + 1, ratio) <= rows:
                    R[T.floordiv(start + vi + 1, ratio) - 1, vj] = X[vi, vj]
                if vj < width and vi + size >= n:
                    RA[T.floormod(start + vi, size), vj] = XA[vi, vj]
                    RB[T.floormod(start + vi, size), vj] = XB[vi, vj]
    return compressor_write.with_attr("global_symbol", f"compressor_write_{rows}x{row_width}_r{ratio}_{size}x{width}")


def compressor_writes(table: nn.Tensor, candidates: nn.Tensor, rings: tuple, rows: tuple, start, ratio: int,
                      compact: bool, names: tuple, *, forms: Forms) -> tuple:
    """emit_rows of the candidates into the row table and ring_write_pair of the rows into the
    two rings: (table, ring, ring). In the GPU forms a step of one row per candidate (a decode)
    runs them as one kernel."""
    if not forms.gpu or compact or rings[0].shape != rings[1].shape:
        return (emit_rows(table, candidates, start, ratio, compact, name=names[0]),
                *ring_write_pair(rings, rows, start, names[1:], forms=forms))
    (n_rows, row_width), (size, width) = table.shape, rings[0].shape
    func = _compressor_write_func(int(n_rows), int(row_width), int(size), int(width), ratio)
    out = op.tensor_ir_inplace_op(func, func.attrs["global_symbol"], args=[table, *rings, candidates, *rows, start],
                                  inplace_indices=[0, 1, 2],
                                  out=[nn.Tensor.placeholder(t.shape, t.dtype) for t in (table, *rings)])
    return tuple(out)


def recurrent_read(slots: nn.Tensor, start, name: str = "recurrent_read") -> nn.Tensor:
    """The state before position start [1, W] from slots [R, W]: slot start % R, zeros at 0."""
    R, W = slots.shape

    def f(s_te, s):
        return te.compute((1, W), lambda _, w: tirx.if_then_else(s > 0, s_te[tirx.floormod(s, R), w],
                                                                 tirx.const(0, F32)), name=name)

    return op.tensor_expr_op(f, name, [slots, start])


def recurrent_write(slots: nn.Tensor, states: nn.Tensor, start, name: str = "recurrent_write") -> nn.Tensor:
    """Writes the state after each row i [n, W] (row i is position start + i) into the slot of
    position start + i + 1, in place; emit it after the recurrent_read of the same call."""
    return ring_write(slots, states, start + 1, name=name)


@functools.lru_cache(maxsize=None)
def _emit_rows_func(rows: int, width: int, ratio: int, compact: bool):
    def end(start, i):   # the position where candidate i's window ends
        return (start // ratio + i + 1) * ratio - 1 if compact else start + i

    @T.prim_func(s_tir=True)
    def emit_rows(table: T.handle, cand: T.handle, start: T.int64):
        n = T.int64()
        R = T.match_buffer(table, (rows, width), "float32")
        X = T.match_buffer(cand, (n, width), "float32")
        for i, j in T.grid(n, width):
            with T.sblock("emit"):
                vi, vj = T.axis.remap("SS", [i, j])
                if T.floormod(end(start, vi) + 1, ratio) == 0 and T.floordiv(end(start, vi) + 1, ratio) <= rows:
                    R[T.floordiv(end(start, vi) + 1, ratio) - 1, vj] = X[vi, vj]
    return emit_rows.with_attr("global_symbol", f"emit_rows_{rows}x{width}_r{ratio}{'_c' if compact else ''}")


# The token count of a function exported to be recorded at each of several widths (a CUDA graph
# per width: schedules/graphs.width_copies): symbolic while exported, no shape may depend on the
# position in it; at most max_verify rows.
RECORDED_WIDTH = "width"


def recorded_width(n) -> bool:
    """Whether a token count is RECORDED_WIDTH's (a call of at most max_verify rows)."""
    return isinstance(n, tirx.Var) and n.name == RECORDED_WIDTH


VERIFY_ROWS = "k"   # the token count of the target's verify (nn/functions.TARGET_ROWS): 1..max_verify


def few_rows(n) -> bool:
    """Whether a call's row count is a few: static (a decode, a batched decode's one per
    sequence), a recorded width or a verify block's count, never a prefill chunk's."""
    return isinstance(n, int) or recorded_width(n) or isinstance(n, tirx.Var) and n.name == VERIFY_ROWS


def compacts(x: nn.Tensor) -> bool:
    """Whether pooled_window pools only the windows that end among x's tokens. A call of a dynamic
    number of tokens (prefill, verify) does; a decode step (one static token) and a recorded width
    pool one window per token whether it ends there or not, as a row count that depends on the
    position would make their static-shape kernels allocate a dynamic size, which CUDA code
    generation refuses."""
    n = x.shape[0]
    return not isinstance(n, int) and not recorded_width(n)


def emit_rows(table: nn.Tensor, candidates: nn.Tensor, start, ratio: int, compact: bool, name: str) -> nn.Tensor:
    """Writes into the row table the candidates (pooled_window's output) whose window ends a
    compressed row: with compact, every candidate, in order from row start // ratio; else candidate
    t, for position start + t, when (start + t + 1) % ratio == 0."""
    rows, width = table.shape
    func = _emit_rows_func(int(rows), int(width), ratio, compact)
    return op.tensor_ir_inplace_op(func, func.attrs["global_symbol"], args=[table, candidates, start],
                                   inplace_indices=[0], out=nn.Tensor.placeholder(table.shape, table.dtype))
