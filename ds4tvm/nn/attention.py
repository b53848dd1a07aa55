"""Attention over a window of recent rows plus compressed or selected rows (the context rows come
from nn/state.py), softmax with per-head sinks, and the indexer that selects which compressed rows
a token reads."""

from __future__ import annotations

import functools
import math

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from ..kernels import cpu_attention
from ..kernels import gpu as gpu_kernels
from ..kernels.slots import NEG_INF, window_slots
from ..kernels.forms import Forms
from .norm_rope import rope
from .state import RingRows, recorded_width, ring_write, rows_reader
from .state import args as state_args

F32 = "float32"


def attend_with_sinks(q_te, key, valid, A, sinks, name: str, scale: float | None = None):
    """TE softmax attention of q [T, H, D] over A key slots, key(t, a, d) giving slot a's row for
    token t and valid(t, a) whether it is visible; values are the keys (K = V, as in DeepSeek-V4 and
    in absorbed MLA, whose keys and values are the latent rows). One learned sink logit per head
    joins the denominator (sinks None: no sink). Scale 1/sqrt(D) unless given."""
    def shared(t, h, a, d):
        return key(t, a, d)

    return softmax_attention(q_te, shared, shared, valid, A, sinks, name, scale)


def softmax_attention(q_te, key, value, valid, A, sinks, name: str, scale: float | None = None):
    """TE softmax attention of q [T, H, D] over A slots: key(t, h, a, d) and value(t, h, a, d) give
    slot a's rows for head h of token t (grouped-query heads share theirs), valid(t, a) whether it
    is visible; sinks [H] or None as in attend_with_sinks."""
    n, H, D = q_te.shape
    scale = tirx.const(scale if scale is not None else 1.0 / math.sqrt(int(D)), F32)
    k = te.reduce_axis((0, D), name="k")
    qk = te.compute((n, H, A), lambda t, h, a: te.sum(q_te[t, h, k] * key(t, h, a, k), axis=k), name=name + "_qk")
    masked = te.compute((n, H, A), lambda t, h, a: tirx.if_then_else(
        valid(t, a), qk[t, h, a] * scale, tirx.const(NEG_INF, F32)), name=name + "_masked")
    a1 = te.reduce_axis((0, A), name="a1")
    mx_rows = te.compute((n, H), lambda t, h: te.max(masked[t, h, a1], axis=a1), name=name + "_rowmax")
    if sinks is not None:
        mx = te.compute((n, H), lambda t, h: tirx.max(mx_rows[t, h], sinks[h]), name=name + "_max")
    else:
        mx = mx_rows
    e = te.compute((n, H, A), lambda t, h, a: tirx.if_then_else(
        valid(t, a), te.exp(masked[t, h, a] - mx[t, h]), tirx.const(0, F32)), name=name + "_exp")
    a2 = te.reduce_axis((0, A), name="a2")
    den_rows = te.compute((n, H), lambda t, h: te.sum(e[t, h, a2], axis=a2), name=name + "_rowsum")
    if sinks is not None:
        den = te.compute((n, H), lambda t, h: den_rows[t, h] + te.exp(sinks[h] - mx[t, h]), name=name + "_den")
    else:
        den = den_rows
    a3 = te.reduce_axis((0, A), name="a3")
    num = te.compute((n, H, D), lambda t, h, d: te.sum(e[t, h, a3] * value(t, h, a3, d), axis=a3), name=name + "_pv")
    return te.compute((n, H, D), lambda t, h, d: num[t, h, d] / den[t, h], name=name)


def selected_pool_positions(sel_te, s, P: int, tail: bool):
    """The slots of a pooled sparse selection, for token t at position s + t: the P tokens of each
    pool listed in sel [T, M] (pool c holds positions cP..cP+P-1; a listed pool counts once it is
    complete at t's position, -1 or a pool not yet complete is skipped) and, with tail, the
    unfinished pool's tokens up to t itself. Returns (A slots, pos(t, a), valid(t, a))."""
    M = int(sel_te.shape[1])
    A = M * P + (P - 1 if tail else 0)

    def complete(t):
        return tirx.floordiv(s + t + 1, P)

    def chosen(t, a):
        return sel_te[t, tirx.min(tirx.floordiv(a, P), M - 1)].astype("int64")

    def pos(t, a):
        return tirx.if_then_else(a < M * P, chosen(t, a) * P + tirx.floormod(a, P), complete(t) * P + a - M * P)

    def valid(t, a):
        in_pool = tirx.And(chosen(t, a) >= 0, chosen(t, a) < complete(t))
        return tirx.if_then_else(a < M * P, in_pool, pos(t, a) <= s + t)

    return A, pos, valid


def sparse_window_attention(q: nn.Tensor, kv_ctx, comp: nn.Tensor | None, sel: nn.Tensor | None,
                            sinks: nn.Tensor, start, window: int, ratio: int, name: str,
                            rope_back: np.ndarray | None = None, write_ring: tuple | None = None, *, forms: Forms):
    """Softmax attention of q [T, H, D] over, for token t at position p = start + t:
    - the raw window: positions p-window+1..p, rows of kv_ctx (row j = position start-window+1+j);
    - compressed rows c < (p+1)//ratio of `comp`: all of them, or those listed in sel [T, M];
    - one learned sink logit per head in the denominator. Values are the keys (K = V).
    kv_ctx is a tensor or nn/state.RingRows. rope_back: RoPE frequencies to rotate each output
    row back by, at its token's position (rope(..., inverse=True)). write_ring (ring, rows): the
    rows written into the ring after the attention read it (ring_write); then returns (output,
    ring). With RingRows in the GPU forms, one kernel (gpu_kernels.window_attention) that also
    writes a decode step's or a recorded width's rows into the ring: a thread block per (token,
    head)."""
    has_comp = comp is not None
    use_sel = sel is not None
    n, H, D = q.shape
    M = (int(sel.shape[1]) if use_sel else int(comp.shape[0])) if has_comp else 0
    if isinstance(kv_ctx, RingRows) and forms.gpu and window + M <= gpu_kernels.MAX_SLOTS:
        ring_shape = tuple(int(x) for x in kv_ctx.ring.shape)
        # the rows written land in slots no block reads: fewer new rows than the ring holds beyond
        # `before` (a recorded width: at most max_verify rows, for which rings are sized)
        in_kernel = write_ring is not None and write_ring[0] is kv_ctx.ring and write_ring[1] is kv_ctx.new \
            and (recorded_width(n) or isinstance(n, int) and n + kv_ctx.before <= ring_shape[0])
        func = gpu_kernels.window_attention(
            int(H), int(D), ring_shape, kv_ctx.before, tuple(int(x) for x in comp.shape) if has_comp else None,
            M if use_sel else None, window, ratio, 2 * len(rope_back) if rope_back is not None else 0,
            forms.binds_threads, in_kernel)
        fr = rope_back if rope_back is not None else np.zeros(1, np.float32)
        args = [q, kv_ctx.ring, kv_ctx.new, sinks, start, nn.Tensor.from_const(fr),
                comp if has_comp else nn.Tensor.from_const(np.zeros((1, 1), np.float32)),
                sel if use_sel else nn.Tensor.from_const(np.zeros((1, 1), np.int32))]
        if in_kernel:
            ring, out = op.tensor_ir_inplace_op(func, name, args, inplace_indices=[1, -1],
                                                out=[nn.Tensor.placeholder(kv_ctx.ring.shape, F32),
                                                     nn.Tensor.placeholder(q.shape, F32)])
            return out, ring
        out = op.tensor_ir_op(func, name, args, nn.Tensor.placeholder(q.shape, F32))
    else:
        if forms.for_cpu and forms.cpu_linears.int8_dot and not isinstance(kv_ctx, RingRows) \
                and cpu_attention.supports(int(H), int(D)):   # the float build keeps its logits bit for bit
            func = cpu_attention.window_attention(int(H), int(D), window, ratio, int(comp.shape[0]) if has_comp else None,
                                                  M if use_sel else None,
                                                  forms.cpu_linears.threads > 1 and not isinstance(n, int),
                                                  forms.cpu_linears.threads > 1 and isinstance(n, int))
            args = [q, kv_ctx, sinks, start,
                    comp if has_comp else nn.Tensor.from_const(np.zeros((1, int(D)), np.float32)),
                    sel if use_sel else nn.Tensor.from_const(np.zeros((1, 1), np.int32))]
            out = op.tensor_ir_op(func, name, args, nn.Tensor.placeholder(q.shape, F32))
        else:
            out = _te_window_attention(q, kv_ctx, comp, sel, sinks, start, window, ratio, name)
        if rope_back is not None:
            out = rope(out, start, rope_back, inverse=True, forms=forms)
    if write_ring is None:
        return out
    return out, ring_write(*write_ring, start, name=name + "_ring_write")


def _te_window_attention(q, kv_ctx, comp, sel, sinks, start, window: int, ratio: int, name: str):
    has_comp, use_sel = comp is not None, sel is not None
    ctx_args = state_args(kv_ctx)
    args = [q, *ctx_args, sinks, start] + ([comp] if has_comp else []) + ([sel] if use_sel else [])

    def f(q_te, *rest):
        k = len(ctx_args)
        ctx_te, (sk, s), rest = list(rest[:k]), rest[k:k + 2], rest[k + 2:]
        ctx, ctx_rows = rows_reader(kv_ctx, ctx_te, s)
        A, valid, key = window_slots(ctx, ctx_rows, rest[0] if has_comp else None, rest[1] if use_sel else None, s,
                                      window, ratio)
        return attend_with_sinks(q_te, key, valid, A, sk, name)

    return op.tensor_expr_op(f, name, args)


@functools.lru_cache(maxsize=None)
def _indexer_scores_func(heads: int, dim: int, rows: int, ratio: int):
    lanes = 16 if dim % 16 == 0 else 1

    @T.prim_func(s_tir=True)
    def scores(q: T.handle, weight: T.handle, table: T.handle, start: T.int64, out: T.handle):
        n = T.int64()
        Q = T.match_buffer(q, (n, heads, dim), "float32")
        W = T.match_buffer(weight, (n, heads), "float32")
        K = T.match_buffer(table, (rows, dim), "float32")
        S = T.match_buffer(out, (n, rows), "float32")
        acc = T.alloc_buffer((n, lanes), "float32")
        total = T.alloc_buffer((n, 2), "float32")
        for t in range(n):
            with T.sblock("scores"):
                vt = T.axis.spatial(n, t)
                T.reads(Q[vt, 0:heads, 0:dim], W[vt, 0:heads], K[0:rows, 0:dim])
                T.writes(S[vt, 0:rows], acc[vt, 0:lanes], total[vt, 0:2])
                for c in range(T.int64(rows)):
                    if c < T.floordiv(start + vt + T.int64(1), T.int64(ratio)):   # visible rows only
                        total[vt, 0] = T.float32(0)
                        for h in range(T.int64(heads)):
                            for lane in range(T.int64(lanes)):
                                acc[vt, lane] = T.float32(0)
                            for ko in range(T.int64(dim // lanes)):
                                for lane in range(T.int64(lanes)):
                                    acc[vt, lane] = acc[vt, lane] + Q[vt, h, ko * T.int64(lanes) + lane] * K[c, ko * T.int64(lanes) + lane]
                            total[vt, 1] = T.float32(0)
                            for lane in range(T.int64(lanes)):
                                total[vt, 1] = total[vt, 1] + acc[vt, lane]
                            total[vt, 0] = total[vt, 0] + W[vt, h] * T.max(total[vt, 1], T.float32(0))
                        S[vt, c] = total[vt, 0]
                    else:
                        S[vt, c] = T.float32(NEG_INF)
    return scores.with_attr("global_symbol", f"indexer_scores_{heads}x{dim}_{rows}_r{ratio}")


def _indexer_scores_te(q, w, keys, s, ratio: int):
    """The GPU form of the indexer's scores: the per-head dots over every row, then their weighted
    relu sum (NEG_INF for rows not visible yet), each a reduction with a thread per output (the
    CPU's kernel is one serial loop per token, a single GPU thread: ~0.5 M multiply-adds at 256
    rows, 134 M at 16 K)."""
    n, heads, dim = q.shape
    rows = keys.shape[0]
    d = te.reduce_axis((0, dim), name="d")
    qk = te.compute((n, rows, heads), lambda t, c, h: te.sum(q[t, h, d] * keys[c, d], axis=d), name="indexer_qk")
    h = te.reduce_axis((0, heads), name="h")

    def term(t, c):   # a row not visible yet sums to NEG_INF (its first head's term, zeros after it)
        visible = w[t, h] * tirx.max(qk[t, c, h], tirx.const(0, F32))
        hidden = tirx.if_then_else(h == 0, tirx.const(NEG_INF, F32), tirx.const(0, F32))
        return tirx.if_then_else(c < tirx.floordiv(s + t + 1, ratio), visible, hidden)

    return te.compute((n, rows), lambda t, c: te.sum(term(t, c), axis=h), name="indexer_scores")


def indexer_select(iq: nn.Tensor, w: nn.Tensor, keys: nn.Tensor, start, ratio: int, top_k: int,
                   name: str, *, forms: Forms) -> nn.Tensor:
    """Lightning indexer: score_c = sum_h w[t,h] * relu(iq[t,h] . key_c) over the visible rows
    c < (p+1)//ratio; returns the indices of the top_k scores [T, min(top_k, rows)] (invisible rows
    score -inf, so when fewer than top_k are visible all of them are among the indices). Rows that
    are not visible yet are not scored at all (they were most of a short prefill's time); each dot
    is 16 partial sums along contiguous channels, summed in lane order."""
    rows = int(keys.shape[0])
    _, heads, dim = iq.shape
    if forms.gpu:
        scores = op.tensor_expr_op(functools.partial(_indexer_scores_te, ratio=ratio), name, [iq, w, keys, start])
    else:
        func = cpu_attention.indexer_scores(int(heads), int(dim), rows, ratio, forms.cpu_linears.threads) \
            if forms.for_cpu and cpu_attention.indexer_supports(int(dim), rows) \
            else _indexer_scores_func(int(heads), int(dim), rows, ratio)
        scores = op.tensor_ir_op(func, name, args=[iq, w, keys, start],
                                 out=nn.Tensor.placeholder((iq.shape[0], rows), "float32"))
    k = min(top_k, rows)
    if forms.gpu and rows <= gpu_kernels.MAX_BLOCK_THREADS:   # one launch where TOPI's sort takes five
        func = gpu_kernels.top_k(rows, k, False, bind=forms.binds_threads)
        chosen, _ = op.tensor_ir_op(func, name + "_topk", [scores, nn.Tensor.from_const(np.zeros(1, np.float32))],
                                    [nn.Tensor.placeholder((iq.shape[0], k), "int32"),
                                     nn.Tensor.placeholder((iq.shape[0], k), F32)])
        return chosen
    return op.topk(scores, k=k, axis=-1, ret_type="indices", dtype="int32", name=name + "_topk")
