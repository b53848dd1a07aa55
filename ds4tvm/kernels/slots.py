"""Which context row each attention slot reads, as TIR expressions over TE tensors or TIR buffers:
the window attention's TE form (nn/attention.py) and its GPU kernel (kernels/gpu.py) build from
the same ones."""

from __future__ import annotations

from tvm import tirx

F32 = "float32"


NEG_INF = -3.0e38


def window_slots(ctx, ctx_rows, comp_te, sel_te, s, window: int, ratio: int):
    """sparse_window_attention's slots: (A, valid(t, a), key(t, a, d)) over the context rows (an
    accessor) and the compressed rows (all of comp_te, or those listed in sel_te; None: none)."""
    has_comp, use_sel = comp_te is not None, sel_te is not None
    M = (sel_te.shape[1] if use_sel else comp_te.shape[0]) if has_comp else 0

    def row_index(t, a):
        return sel_te[t, a - window].astype("int64") if use_sel else (a - window)

    def valid(t, a):
        pos = s + t
        in_window = tirx.And(a < window, pos - window + 1 + a >= 0)
        if not has_comp:
            return in_window
        nvis = tirx.floordiv(pos + 1, ratio)
        return tirx.Or(in_window, tirx.And(a >= window, row_index(t, a) < nvis))

    def key(t, a, d):
        if not has_comp:
            return ctx(t + a, d)
        return tirx.if_then_else(a < window, ctx(tirx.min(t + a, ctx_rows - 1), d),
                                 comp_te[tirx.max(tirx.min(row_index(t, a), comp_te.shape[0] - 1), 0), d])

    return window + M, valid, key


def context_row(ring_te, new_te, s, before: int):
    """gather_context's element (j, d) as an expression over the ring and the new rows (TE tensors
    or TIR buffers)."""
    size = ring_te.shape[0]

    def body(j, d):
        pos = s - before + j
        old = tirx.if_then_else(pos >= 0, ring_te[tirx.floormod(pos, size), d], tirx.const(0, F32))
        return tirx.if_then_else(j < before, old, new_te[tirx.max(j - before, 0), d])

    return body
