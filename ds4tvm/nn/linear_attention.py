"""Linear attention shared by the recurrent families (GLM-5.3's KDA; Qwen3.8's Gated DeltaNet is the
case of one decay per head): the causal depthwise conv over a history ring, per-head L2
normalisation, and the gated delta rule over recurrent snapshot slots (nn/state.py)."""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from ..kernels.forms import Forms
from .state import gather_context, ring_write

F32 = "float32"
L2_EPS = 1e-6


def causal_conv_silu(ring: nn.Tensor, x: nn.Tensor, weight: nn.Tensor, start, name: str):
    """SiLU of the depthwise causal conv of the rows x [n, C] (positions start..) with weight [C, K]
    over each channel's K - 1 previous rows (the ring of history, zeros before position 0), and the
    ring with the new rows written. Weight column K - 1 multiplies the current row."""
    K = int(weight.shape[1])
    ctx = gather_context(ring, x, start, K - 1, name=name + "_context")

    def f(c, w):
        n, C = c.shape[0] - (K - 1), c.shape[1]
        j = te.reduce_axis((0, K), name="j")
        s = te.compute((n, C), lambda t, ch: te.sum(c[t + j, ch] * w[ch, j], axis=j), name=name + "_sum")
        return te.compute((n, C), lambda t, ch: s[t, ch] * te.sigmoid(s[t, ch]), name=name)

    return op.tensor_expr_op(f, name, [ctx, weight]), ring_write(ring, x, start, name=name + "_write")


def l2_normalized_heads(x: nn.Tensor, offset: int, heads: int, dim: int, scale: float, name: str) -> nn.Tensor:
    """Columns offset.. of x [n, C] as heads [n, H, D], each head x / sqrt(sum x^2 + 1e-6) * scale."""
    def f(x_te):
        n = x_te.shape[0]
        k = te.reduce_axis((0, dim), name="k")

        def at(t, h, d):
            return x_te[t, offset + h * dim + d]

        ss = te.compute((n, heads), lambda t, h: te.sum(at(t, h, k) * at(t, h, k), axis=k), name=name + "_ss")
        return te.compute((n, heads, dim), lambda t, h, d: at(t, h, d) / te.sqrt(ss[t, h] + tirx.const(L2_EPS, F32))
                          * tirx.const(scale, F32), name=name)

    return op.tensor_expr_op(f, name, [x])


@functools.lru_cache(maxsize=None)
def _delta_rule_func(heads: int, dk: int, dv: int, slots: int):
    width = heads * dk * dv

    @T.prim_func(s_tir=True)
    def delta_rule(q: T.handle, k: T.handle, v: T.handle, g: T.handle, beta: T.handle, state: T.handle,
                   start: T.int64, out: T.handle):
        n = T.int64()
        Q = T.match_buffer(q, (n, heads, dk), "float32")
        Kx = T.match_buffer(k, (n, heads, dk), "float32")
        V = T.match_buffer(v, (n, heads, dv), "float32")
        G = T.match_buffer(g, (n, heads, dk), "float32")
        B = T.match_buffer(beta, (n, heads), "float32")
        S = T.match_buffer(state, (slots, width), "float32")
        O = T.match_buffer(out, (n, heads, dv), "float32")
        u = T.alloc_buffer((heads, dv), "float32")
        decay = T.alloc_buffer((heads, dk), "float32")
        for h in T.parallel(heads):
            with T.sblock("delta_rule"):
                vh = T.axis.spatial(heads, h)
                T.reads(Q[0:n, vh, 0:dk], Kx[0:n, vh, 0:dk], V[0:n, vh, 0:dv], G[0:n, vh, 0:dk], B[0:n, vh],
                        S[0:slots, 0:width])
                T.writes(S[0:slots, 0:width], O[0:n, vh, 0:dv], u[vh, 0:dv], decay[vh, 0:dk])
                for i in range(n):
                    # the state before row i is in slot (start + i) % R (zeros at position 0); the
                    # state after it goes to the next position's slot
                    for kk in range(dk):
                        decay[vh, kk] = T.exp(G[i, vh, kk])
                    for vv in range(dv):
                        u[vh, vv] = T.float32(0)
                    for kk in range(dk):
                        for vv in range(dv):
                            S[T.floormod(start + i + 1, slots), (vh * dk + kk) * dv + vv] = T.if_then_else(
                                start + i > 0, S[T.floormod(start + i, slots), (vh * dk + kk) * dv + vv]
                                * decay[vh, kk], T.float32(0))
                            u[vh, vv] = u[vh, vv] + S[T.floormod(start + i + 1, slots), (vh * dk + kk) * dv + vv] \
                                * Kx[i, vh, kk]
                    for vv in range(dv):
                        u[vh, vv] = B[i, vh] * (V[i, vh, vv] - u[vh, vv])
                        O[i, vh, vv] = T.float32(0)
                    for kk in range(dk):
                        for vv in range(dv):
                            S[T.floormod(start + i + 1, slots), (vh * dk + kk) * dv + vv] = (
                                S[T.floormod(start + i + 1, slots), (vh * dk + kk) * dv + vv] + Kx[i, vh, kk] * u[vh, vv])
                            O[i, vh, vv] = O[i, vh, vv] + S[T.floormod(start + i + 1, slots), (vh * dk + kk) * dv + vv] \
                                * Q[i, vh, kk]
    return delta_rule.with_attr("global_symbol", f"delta_rule_{heads}x{dk}x{dv}_r{slots}")


@functools.lru_cache(maxsize=None)
def _delta_rule_gpu_func(heads: int, dk: int, dv: int, slots: int, bind: bool = True):
    """The same recurrence for GPUs, scheduled here: one thread block per head and one thread per
    value channel. Column vv of S (dk entries) depends only on itself, k, q and v[vv], so a thread
    carries its column through every row with no synchronisation; the threads of a block read and
    write consecutive floats of each state row. bind=False: the same loops serial, which runs on a
    CPU (the unit test of this form)."""
    width = heads * dk * dv
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda n: T.thread_binding(n, thread="threadIdx.x")) if bind else T.serial

    @T.prim_func(private=True)
    def delta_rule(q: T.handle, k: T.handle, v: T.handle, g: T.handle, beta: T.handle, state: T.handle,
                   start: T.int64, out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True})
        n = T.int64()
        Q = T.match_buffer(q, (n, heads, dk), "float32")
        Kx = T.match_buffer(k, (n, heads, dk), "float32")
        V = T.match_buffer(v, (n, heads, dv), "float32")
        G = T.match_buffer(g, (n, heads, dk), "float32")
        B = T.match_buffer(beta, (n, heads), "float32")
        S = T.match_buffer(state, (slots, width), "float32")
        O = T.match_buffer(out, (n, heads, dv), "float32")
        acc = T.alloc_buffer((2,), "float32", scope="local")
        for h in blocks(heads):
            for c in threads(dv):
                for i in range(n):
                    acc[0] = T.float32(0)
                    for kk in range(dk):
                        S[T.floormod(start + i + 1, slots), (h * dk + kk) * dv + c] = T.if_then_else(
                            start + i > 0, S[T.floormod(start + i, slots), (h * dk + kk) * dv + c]
                            * T.exp(G[i, h, kk]), T.float32(0))
                        acc[0] = acc[0] + S[T.floormod(start + i + 1, slots), (h * dk + kk) * dv + c] * Kx[i, h, kk]
                    acc[0] = B[i, h] * (V[i, h, c] - acc[0])
                    acc[1] = T.float32(0)
                    for kk in range(dk):
                        S[T.floormod(start + i + 1, slots), (h * dk + kk) * dv + c] = (
                            S[T.floormod(start + i + 1, slots), (h * dk + kk) * dv + c] + Kx[i, h, kk] * acc[0])
                        acc[1] = acc[1] + S[T.floormod(start + i + 1, slots), (h * dk + kk) * dv + c] * Q[i, h, kk]
                    O[i, h, c] = acc[1]
    return delta_rule.with_attr("global_symbol", f"delta_rule_gpu_{heads}x{dk}x{dv}_r{slots}")


def delta_rule(q: nn.Tensor, k: nn.Tensor, v: nn.Tensor, g: nn.Tensor, beta: nn.Tensor, slots: nn.Tensor, start,
               name: str = "delta_rule", *, forms: Forms):
    """The gated delta rule per head over rows q, k [n, H, Dk], v [n, H, Dv] with log-decays g
    [n, H, Dk] (one per key channel) and beta [n, H]: S <- diag(exp g) S; S += k (beta (v - S^T k))^T;
    o = S^T q. S [H, Dk, Dv] starts from the snapshot slot of position start and the state after
    each row is written, in place, to the slot of the position after it (nn/state.py). Returns
    (o [n, H, Dv], the slots). Rows are computed alike whatever n, so a verify and the decode steps
    it stands for leave the same bits."""
    _, H, Dk = q.shape
    Dv = v.shape[2]
    R = slots.shape[0]

    func = (_delta_rule_func(int(H), int(Dk), int(Dv), int(R)) if forms.for_cpu
            else _delta_rule_gpu_func(int(H), int(Dk), int(Dv), int(R), bind=forms.binds_threads))
    slots_out, o = op.tensor_ir_inplace_op(
        func, func.attrs["global_symbol"], args=[q, k, v, g, beta, slots, start], inplace_indices=[5, -1],
        out=[nn.Tensor.placeholder(slots.shape, F32), nn.Tensor.placeholder((q.shape[0], H, Dv), F32)])
    return o, slots_out
