"""Hyper-connections (ds4-spec §2): the residual kept as `hc` streams, mixed before each sublayer
(hc_pre: RMSNorm, mix, Sinkhorn-balanced gates), merged after it (hc_post), and folded into one
row for the output head (hc_head)."""

from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from ..kernels import gpu as gpu_kernels
from ..kernels.tags import ELEMWISE, PRESET
from ..kernels.forms import Forms
from .norm_rope import rms

F32 = "float32"


# ---------------------------------------------------------------------------- hyper-connections
def embedded_streams(token_embd, ids: nn.Tensor, hc: int, n_embd: int) -> nn.Tensor:
    """The tokens' embeddings (rows of the QWeight token_embd) copied into the hc residual streams
    [n, hc, n_embd] the first layer mixes."""
    n = ids.shape[0]
    emb = token_embd.rows(ids, name="embedding")
    return op.broadcast_to(op.reshape(emb, (n, 1, n_embd)), (n, hc, n_embd))


def hc_pre(X: nn.Tensor, fn, scale: nn.Tensor, base: nn.Tensor, hc: int, eps: float, hc_eps: float,
           iters: int, norm: nn.Tensor | None = None, *, forms: Forms):
    """X [T, hc, D] -> (sublayer input [T, D], post [T, hc], comb [T, hc(src), hc(dst)]) with the
    combine matrix c[dst, src] made doubly stochastic by Sinkhorn (eps in every divisor); with
    norm, the sublayer input RMS-normalized by it. In the GPU forms with a norm, two kernels: the
    mixing GEMV, which also sums the squares of the streams, and _hc_norm_func."""
    n, _, D = X.shape
    if norm is not None and forms.gpu:
        func = _hc_norm_func(int(hc), int(D), int(iters), float(hc_eps), float(eps), forms.binds_threads)
        mix = fn.linear_and_squares(op.reshape(X, (n, hc * D)), name="hc_mix")
        x, post, c = op.tensor_ir_op(func, "hc_pre_norm", args=[mix, scale, base, X, norm],
                                     out=[nn.Tensor.placeholder((n, D), F32), nn.Tensor.placeholder((n, hc), F32),
                                          nn.Tensor.placeholder((n, hc, hc), F32)])
        return x, post, c
    flat = rms(op.reshape(X, (n, hc * D)), eps)
    mix = fn.linear(flat, name="hc_mix")
    if forms.gpu:   # one kernel: there, a launch costs more than the work
        func = _hc_gates_sinkhorn_func(int(hc), int(iters), float(hc_eps))
        pre, post, c = op.tensor_ir_op(func, func.attrs["global_symbol"], args=[mix, scale, base],
                                       out=[nn.Tensor.placeholder((n, hc), F32), nn.Tensor.placeholder((n, hc), F32),
                                            nn.Tensor.placeholder((n, hc, hc), F32)])
    else:
        pre, post, c = hc_gates(mix, scale, base, hc, hc_eps)
        c = sinkhorn(c, iters, hc_eps)

    def weighted(x_te, p_te):
        h = te.reduce_axis((0, hc), name="h")
        return te.compute((n, D), lambda t, d: te.sum(p_te[t, h] * x_te[t, h, d], axis=h), name="hc_pre_sum")

    x = op.tensor_expr_op(weighted, "hc_pre_sum", [X, pre])
    return (x if norm is None else rms(x, eps, norm)), post, c


def hc_gates(mix: nn.Tensor, scale: nn.Tensor, base: nn.Tensor, hc: int, hc_eps: float):
    """From the mixing projection [T, (2 + hc) * hc]: pre = sigmoid(m * scale[0] + base) + eps,
    post = 2 sigmoid(m * scale[1] + base), and the combine logits c[t, dst, src] = m * scale[2] +
    base softmaxed over src, plus eps. One kernel: as relax ops it was some twenty (splits,
    scale-and-shift, sigmoid, softmax), each with its own VM calls, twice per layer and token."""
    def f(m, s, b):
        n = m.shape[0]
        sig = te.sigmoid
        pre = te.compute((n, hc), lambda t, j: sig(m[t, j] * s[0] + b[j]) + tirx.const(hc_eps, F32), name="hc_pre")
        post = te.compute((n, hc), lambda t, j: sig(m[t, hc + j] * s[1] + b[hc + j]) * tirx.const(2.0, F32),
                          name="hc_post")

        def logit(t, i, j):
            return m[t, 2 * hc + i * hc + j] * s[2] + b[2 * hc + i * hc + j]

        k = te.reduce_axis((0, hc), name="k")
        mx = te.compute((n, hc), lambda t, i: te.max(logit(t, i, k), axis=k), name="hc_comb_max")
        e = te.compute((n, hc, hc), lambda t, i, j: te.exp(logit(t, i, j) - mx[t, i]), name="hc_comb_exp")
        k2 = te.reduce_axis((0, hc), name="k2")
        den = te.compute((n, hc), lambda t, i: te.sum(e[t, i, k2], axis=k2), name="hc_comb_den")
        comb = te.compute((n, hc, hc), lambda t, i, j: e[t, i, j] / den[t, i] + tirx.const(hc_eps, F32),
                          name="hc_comb")
        return [pre, post, comb]

    return op.tensor_expr_op(f, "hc_gates", [mix, scale, base])


@T.macro(hygienic=False)
def _sinkhorn_rounds(O, S, vt, vs, hc, iters, eps):
    for it in range(iters):
        if it > 0:  # rows (sum over src), from the second round on
            for i in range(hc):
                S[vs, i] = T.float32(0)
                for j in range(hc):
                    S[vs, i] = S[vs, i] + O[vt, i, j]
                for j in range(hc):
                    O[vt, i, j] = O[vt, i, j] / (S[vs, i] + T.float32(eps))
        for j in range(hc):  # columns (sum over dst)
            S[vs, j] = T.float32(0)
            for i in range(hc):
                S[vs, j] = S[vs, j] + O[vt, i, j]
            for i in range(hc):
                O[vt, i, j] = O[vt, i, j] / (S[vs, j] + T.float32(eps))


@functools.lru_cache(maxsize=None)
def _sinkhorn_func(hc: int, iters: int, eps: float):
    @T.prim_func(s_tir=True)
    def sinkhorn(c_in: T.handle, c_out: T.handle):
        n = T.int64()
        C = T.match_buffer(c_in, (n, hc, hc), "float32")
        O = T.match_buffer(c_out, (n, hc, hc), "float32")
        S = T.alloc_buffer((n, hc), "float32")
        for t in range(n):
            with T.sblock("sinkhorn"):
                vt = T.axis.spatial(n, t)
                T.reads(C[vt, 0:hc, 0:hc])
                T.writes(O[vt, 0:hc, 0:hc], S[vt, 0:hc])
                for i, j in T.grid(hc, hc):
                    O[vt, i, j] = C[vt, i, j]
                _sinkhorn_rounds(O, S, vt, vt, hc, iters, eps)
    return sinkhorn.with_attr("global_symbol", f"sinkhorn_{hc}x{iters}")


# hc_gates and Sinkhorn for one token: its mix in row vm of m, pre in row vp, post and comb in row vt,
# scratch in row vs (the kernels below keep some of them in shared memory, one row per block)
@T.macro(hygienic=False)
def _hc_gates_rounds(m, vm, scale, base, pre, vp, post, O, vt, S, vs, hc, iters, eps):
    for j in range(hc):
        pre[vp, j] = T.sigmoid(m[vm, j] * scale[0] + base[j]) + T.float32(eps)
        post[vt, j] = T.sigmoid(m[vm, hc + j] * scale[1] + base[hc + j]) * T.float32(2.0)
    for i in range(hc):   # the combine logits softmaxed over src, plus eps
        S[vs, i] = T.min_value("float32")
        for j in range(hc):
            S[vs, i] = T.max(S[vs, i], m[vm, 2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j])
        for j in range(hc):
            O[vt, i, j] = T.exp(m[vm, 2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j] - S[vs, i])
        S[vs, i] = T.float32(0)
        for j in range(hc):
            S[vs, i] = S[vs, i] + O[vt, i, j]
        for j in range(hc):
            O[vt, i, j] = O[vt, i, j] / S[vs, i] + T.float32(eps)
    _sinkhorn_rounds(O, S, vt, vs, hc, iters, eps)


@functools.lru_cache(maxsize=None)
def _hc_gates_sinkhorn_func(hc: int, iters: int, eps: float):
    """hc_gates and sinkhorn as one kernel (the GPU forms): the same expressions, per token."""
    M = (2 + hc) * hc

    @T.prim_func(s_tir=True)
    def gates(mix: T.handle, scale: T.Buffer((3,), "float32"), base: T.Buffer((M,), "float32"), pre_h: T.handle,
              post_h: T.handle, comb_h: T.handle):
        n = T.int64()
        m = T.match_buffer(mix, (n, M), "float32")
        pre = T.match_buffer(pre_h, (n, hc), "float32")
        post = T.match_buffer(post_h, (n, hc), "float32")
        O = T.match_buffer(comb_h, (n, hc, hc), "float32")
        S = T.alloc_buffer((n, hc), "float32")
        for t in range(n):
            with T.sblock("hc_gates_sinkhorn"):
                vt = T.axis.spatial(n, t)
                T.reads(m[vt, 0:M], scale[0:3], base[0:M])
                T.writes(pre[vt, 0:hc], post[vt, 0:hc], O[vt, 0:hc, 0:hc], S[vt, 0:hc])
                _hc_gates_rounds(m, vt, scale, base, pre, vt, post, O, vt, S, vt, hc, iters, eps)
    return gates.with_attr("global_symbol", f"hc_gates_sinkhorn_{hc}x{iters}")


@functools.lru_cache(maxsize=None)
def _hc_norm_func(hc: int, D: int, iters: int, hc_eps: float, eps: float, bind: bool, head: bool = False):
    """The GPU forms' hc_pre (or with head, hc_head) with a norm after the mixing GEMV, as one
    kernel: a thread block per token normalizes the mix by the flat RMS (the GEMV's last column is
    the sum of squares of the streams, qweight.linear_and_squares); one thread runs the gates and
    Sinkhorn (the head: a thread per stream its sigmoid weight); then the block sums the weighted
    streams' squares by a tree over its threads and writes the normalized row. bind=False: the
    same loops serial (the numerics check on a CPU)."""
    M, K, NT = hc if head else (2 + hc) * hc, hc * D, gpu_kernels.THREADS
    assert M <= NT
    per_thread, rounds = (D + NT - 1) // NT, NT.bit_length() - 1
    blocks = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if bind else T.serial
    threads = (lambda: T.thread_binding(NT, thread="threadIdx.x")) if bind else (lambda: T.serial(NT))

    def weighted(pre, X, t, d):   # sum_h pre[h] X[t, h, d], in stream order as hc_pre_sum
        v = pre[0, 0] * X[t, 0, d]
        for h in range(1, hc):
            v = v + pre[0, h] * X[t, h, d]
        return v

    @T.macro
    def normed_sum(pre, X, w, out, red, t):
        for tx in threads():
            red[tx] = T.float32(0)
            for i in range(per_thread):
                if i * NT + tx < D:
                    red[tx] = red[tx] + weighted(pre, X, t, i * NT + tx) * weighted(pre, X, t, i * NT + tx)
        for k in T.unroll(rounds):
            for tx in threads():
                if tx < T.shift_right(NT // 2, k):
                    red[tx] = red[tx] + red[tx + T.shift_right(NT // 2, k)]
        for tx in threads():
            for i in range(per_thread):
                if i * NT + tx < D:
                    out[t, i * NT + tx] = weighted(pre, X, t, i * NT + tx) / T.sqrt(
                        red[0] / T.float32(D) + T.float32(eps)) * w[i * NT + tx]

    @T.prim_func(private=True)
    def hc_head_norm(mix_h: T.handle, scale: T.Buffer((1,), "float32"), base: T.Buffer((M,), "float32"),
                     x_h: T.handle, w: T.Buffer((D,), "float32"), out_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": gpu_kernels.OPAQUE})
        n = T.int64()
        m = T.match_buffer(mix_h, (n, M + 1), "float32")
        X = T.match_buffer(x_h, (n, hc, D), "float32")
        out = T.match_buffer(out_h, (n, D), "float32")
        for t in blocks(n):
            pre = T.alloc_buffer((1, hc), "float32", scope="shared")
            red = T.alloc_buffer((NT,), "float32", scope="shared")
            for tx in threads():
                if tx < M:
                    pre[0, tx] = T.sigmoid(m[t, tx] / T.sqrt(m[t, M] / T.float32(K) + T.float32(eps)) * scale[0]
                                           + base[tx]) + T.float32(hc_eps)
            normed_sum(pre, X, w, out, red, t)

    @T.prim_func(private=True)
    def hc_pre_norm(mix_h: T.handle, scale: T.Buffer((3,), "float32"), base: T.Buffer((M,), "float32"),
                    x_h: T.handle, w: T.Buffer((D,), "float32"), out_h: T.handle, post_h: T.handle, comb_h: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": gpu_kernels.OPAQUE})
        n = T.int64()
        m = T.match_buffer(mix_h, (n, M + 1), "float32")
        X = T.match_buffer(x_h, (n, hc, D), "float32")
        out = T.match_buffer(out_h, (n, D), "float32")
        post = T.match_buffer(post_h, (n, hc), "float32")
        O = T.match_buffer(comb_h, (n, hc, hc), "float32")
        for t in blocks(n):
            mm = T.alloc_buffer((1, M), "float32", scope="shared")
            pre = T.alloc_buffer((1, hc), "float32", scope="shared")
            S = T.alloc_buffer((1, hc), "float32", scope="local")   # the gate thread's scratch
            red = T.alloc_buffer((NT,), "float32", scope="shared")
            for tx in threads():
                if tx < M:
                    mm[0, tx] = m[t, tx] / T.sqrt(m[t, M] / T.float32(K) + T.float32(eps))
            for tx in threads():
                if tx == 0:
                    _hc_gates_rounds(mm, 0, scale, base, pre, 0, post, O, t, S, 0, hc, iters, hc_eps)
            normed_sum(pre, X, w, out, red, t)

    return gpu_kernels.hand_kernel(hc_head_norm if head else hc_pre_norm)


def sinkhorn(c: nn.Tensor, iters: int, eps: float) -> nn.Tensor:
    """c[t, dst, src] made doubly stochastic: columns, then (rows, columns) iters-1 times, eps in
    every divisor, sums in index order. One kernel per call: as separate sum/divide/add ops the
    20 rounds were ~100 kernel calls per hyper-connection, most of a small model's decode step."""
    n, hc, _ = c.shape
    return op.tensor_ir_op(_sinkhorn_func(int(hc), int(iters), float(eps)), f"sinkhorn_{hc}x{iters}", args=[c],
                           out=nn.Tensor.placeholder(c.shape, c.dtype))


def hc_post(out: nn.Tensor, X: nn.Tensor, post: nn.Tensor, comb: nn.Tensor, *, forms: Forms) -> nn.Tensor:
    """X'[dst] = post[dst] * out + sum_src c[dst, src]... read as comb[dst + hc*src] = c[src, dst].
    In the GPU forms one kernel (as relax ops: a transpose, then the matmul with its fused
    epilogue); the CPU keeps the separate kernels, whose product and sum LLVM cannot contract
    into one FMA, so its logits stay as they were."""
    if forms.gpu:
        return op.tensor_expr_op(_hc_post_te, "hc_post", [out, X, post, comb], attrs={PRESET: ELEMWISE})
    n, hc, D = X.shape
    mixed = op.matmul(op.permute_dims(comb, [0, 2, 1]), X)          # [T, dst, D] = sum_src c[src, dst] X[src]
    return op.reshape(post, (n, hc, 1)) * op.reshape(out, (n, 1, D)) + mixed


def _hc_post_te(o, x, p, c):
    n, hc, D = x.shape

    def mixed(t, dst, d):   # sum_src in source order, written out: no reduction block
        v = c[t, 0, dst] * x[t, 0, d]
        for src in range(1, int(hc)):
            v = v + c[t, src, dst] * x[t, src, d]
        return v

    return te.compute((n, hc, D), lambda t, dst, d: p[t, dst] * o[t, d] + mixed(t, dst, d), name="hc_post")


def hc_head(X: nn.Tensor, fn, scale: nn.Tensor, base: nn.Tensor, eps: float, hc_eps: float,
            norm: nn.Tensor | None = None, *, forms: Forms) -> nn.Tensor:
    """X [T, hc, D] -> [T, D]: the streams summed with sigmoid weights of their mix; with norm,
    RMS-normalized by it. In the GPU forms with a norm, two kernels (as hc_pre's)."""
    n, hc, D = X.shape
    if norm is not None and forms.gpu:
        func = _hc_norm_func(int(hc), int(D), 0, float(hc_eps), float(eps), forms.binds_threads, head=True)
        mix = fn.linear_and_squares(op.reshape(X, (n, hc * D)), name="hc_head_mix")
        return op.tensor_ir_op(func, "hc_head_norm", args=[mix, scale, base, X, norm],
                               out=nn.Tensor.placeholder((n, D), F32))
    mix = fn.linear(rms(op.reshape(X, (n, hc * D)), eps), name="hc_head_mix")
    w = op.sigmoid(mix * scale + base) + hc_eps
    h = op.sum(op.reshape(w, (n, hc, 1)) * X, axis=1)
    return h if norm is None else rms(h, eps, norm)
