"""DeepSeek-V4's compressor windows (ds4-spec §2): the softmax-pooled row of each window of `ratio`
tokens (two overlapping lanes at ratio 4); nn/state.emit_rows writes them into the table of
compressed rows."""

from __future__ import annotations

from tvm import s_tir, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...kernels.slots import F32, NEG_INF
from ...kernels.forms import Forms
from ...nn.state import RingRows, args, rows_reader


def pooled_window(kv_ctx: RingRows, sc_ctx: RingRows, start, ratio: int, width: int, compact: bool, name: str, *,
                  forms: Forms) -> nn.Tensor:
    """The softmax-pooled row, per channel, of the window ending at each new token (positions
    start .. start + n - 1), or with compact only of the windows that end a compressed row there
    (positions p with (p + 1) % ratio == 0: (start + n) // ratio - start // ratio rows, in order),
    the only rows ever stored. ctx rows are positions start-2*ratio ... For ratio 4 the window is
    8 tokens through two lanes: the previous 4 positions read lane 0 (first `width` channels), the
    current 4 lane 1; the previous lane is absent for the first window. Other ratios: one lane.
    Without compact (a decode step's static shape) the row of a token that ends no window is
    zeros: emit_rows drops it. The contexts are nn/state.RingRows, read in place."""
    two = ratio == 4

    def f(*te_args):
        te_args = list(te_args)
        s = te_args.pop()
        kv, n_rows = rows_reader(kv_ctx, te_args, s)
        sc, _ = rows_reader(sc_ctx, te_args, s)
        n = n_rows - 2 * ratio
        m = (s + n) // ratio - s // ratio if compact else n
        L = 2 * ratio if two else ratio

        def end(i):   # the chunk row of window i's last position
            return (s // ratio + i + 1) * ratio - 1 - s if compact else i
        a = te.reduce_axis((0, L), name="a")

        def src(t, a_, d):
            # a_ < ratio: previous window (lane 0) when two lanes, else current window
            if two:
                row = t + 1 + a_                       # prev rows t+1..t+r, current t+r+1..t+2r
                ch = tirx.if_then_else(a_ < ratio, d, d + width)
            else:
                row = t + ratio + 1 + a_
                ch = d
            return row, ch

        def valid(t, a_):
            if not two:
                return tirx.const(True, "bool")
            return tirx.Or(a_ >= ratio, s + t + 1 - 2 * ratio >= 0)

        def score(t, a_, d):
            row, ch = src(t, a_, d)
            return tirx.if_then_else(valid(t, a_), sc(row, ch), tirx.const(NEG_INF, F32))

        mx = te.compute((m, width), lambda i, d: te.max(score(end(i), a, d), axis=a), name=name + "_max")
        a2 = te.reduce_axis((0, L), name="a2")
        den = te.compute((m, width), lambda i, d: te.sum(
            tirx.if_then_else(valid(end(i), a2), te.exp(score(end(i), a2, d) - mx[i, d]), tirx.const(0, F32)),
            axis=a2), name=name + "_den")
        a3 = te.reduce_axis((0, L), name="a3")

        def pooled(i, d):
            t = end(i)
            row, ch = src(t, a3, d)
            w = tirx.if_then_else(valid(t, a3), te.exp(score(t, a3, d) - mx[i, d]), tirx.const(0, F32))
            return te.sum(w * kv(row, ch), axis=a3)

        num = te.compute((m, width), pooled, name=name + "_num")
        if compact:
            return te.compute((m, width), lambda i, d: num[i, d] / den[i, d], name=name)
        return te.compute((m, width), lambda i, d: tirx.if_then_else(
            tirx.floormod(s + i + 1, ratio) == 0, num[i, d] / den[i, d], tirx.const(0, F32)), name=name)

    inputs = args(kv_ctx) + args(sc_ctx)
    if compact or kv_ctx.new.shape[0] != 1 or not forms.for_cpu:
        return op.tensor_expr_op(f, name, inputs + [start])
    return op.tensor_ir_op(_pooled_if_window_ends(f, [tuple(x.shape) for x in inputs], ratio), name,
                           args=inputs + [start], out=nn.Tensor.placeholder((1, width), F32))


def _pooled_if_window_ends(f, shapes: list, ratio: int):
    """f's kernel for one token (a CPU decode step) with its reductions run only when the token
    ends a window; otherwise the row is zeros, which emit_rows drops. At ratio 128 the pool's
    exponentials were ~6% of a decode step (perf, 2026-12-03). TE's reductions would take the
    condition (`where`) but TVM 0.27's create_prim_func drops it; dlight's rules would not read
    this form, so GPU decode keeps f's. shapes: those of f's tensor inputs."""
    inputs = [te.placeholder(shape, F32, f"ctx{i}") for i, shape in enumerate(shapes)]
    start = tirx.Var("start", "int64")
    func = te.create_prim_func([*inputs, start, f(*inputs, start)])
    root = func.body.block
    *reductions, row = root.body.seq
    body = tirx.SeqStmt([tirx.IfThenElse(tirx.floormod(start + 1, ratio) == 0, tirx.SeqStmt(reductions), None), row])
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                        root.alloc_buffers, root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize([], True, root)).without_attr("global_symbol")
