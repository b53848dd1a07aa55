"""Building blocks shared by the DS4 families: norms, RoPE with host positions, hyper-connections,
and the attention over a window plus selected compressed rows (state helpers: nn/state.py)."""

from __future__ import annotations

import functools
import math

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T

from ..schedules.fusion import BROADCAST, ELEMWISE, PRESET
from . import gpu_kernels
from .qweight import binds_gpu_threads, exporting_gpu_forms
from .rounding import fp8_round_rows, hadamard_fp4
from .state import RingRows, recorded_width, ring_write, rows_reader
from .state import args as state_args

F32 = "float32"
NEG_INF = -3.0e38


def rms(x: nn.Tensor, eps: float, weight: nn.Tensor | None = None) -> nn.Tensor:
    """RMSNorm over the last axis (weightless when weight is None), as one kernel: written as
    relax ops it was seven (square, sum, divide, add, sqrt, divide, multiply), each with its own VM
    calls, and a model has dozens of norms per token."""
    def f(x_te, *w):
        return te.compute(x_te.shape, _rms_te(lambda i: x_te[i], x_te.shape, eps, w), name="rms")

    return op.tensor_expr_op(f, "rms", [x] + ([weight] if weight is not None else []))


def _rms_te(src, shape, eps: float, w: tuple, name: str = "rms"):
    """The normalized element i of src (an element accessor over shape), times w[0][i[-1]] when
    a weight is given."""
    D = shape[-1]
    k = te.reduce_axis((0, D), name="k")
    ss = te.compute(shape[:-1], lambda *i: te.sum(src((*i, k)) * src((*i, k)), axis=k), name=name + "_ss")

    def body(*i):
        y = src(i) / te.sqrt(ss[i[:-1]] / D.astype(F32) + tirx.const(eps, F32))
        return y * w[0][i[-1]] if w else y

    return body


def layer_norm(x: nn.Tensor, eps: float, weight: nn.Tensor, bias: nn.Tensor, name: str = "layer_norm") -> nn.Tensor:
    """LayerNorm over the last axis of x [T, D] (biased variance), with weight and bias."""
    def f(x_te, w, b):
        n, D = x_te.shape
        inv = tirx.const(1.0, F32) / D.astype(F32)
        k = te.reduce_axis((0, D), name="k")
        total = te.compute((n,), lambda t: te.sum(x_te[t, k], axis=k), name=name + "_sum")
        k2 = te.reduce_axis((0, D), name="k2")
        dev = te.compute((n,), lambda t: te.sum((x_te[t, k2] - total[t] * inv) * (x_te[t, k2] - total[t] * inv),
                                                axis=k2), name=name + "_dev")
        return te.compute((n, D), lambda t, d: (x_te[t, d] - total[t] * inv)
                          / te.sqrt(dev[t] * inv + tirx.const(eps, F32)) * w[d] + b[d], name=name)

    return op.tensor_expr_op(f, name, [x, weight, bias])


# ---------------------------------------------------------------------------- RoPE
def rope_inv_freq(n_rot: int, base: float, yarn: tuple[float, int, float, float] | None) -> np.ndarray:
    """Per-pair angular frequencies of interleaved RoPE; with YaRN (factor, original context,
    beta_fast, beta_slow) the ramp between interpolated and extrapolated frequencies, with the
    magnitude correction cancelled (DeepSeek-V4's attention factor 1)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    freq = base ** (-2.0 * i / n_rot)
    if yarn is not None and yarn[0] != 1.0:
        factor, orig, beta_fast, beta_slow = yarn

        def corr_dim(beta):
            return n_rot * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

        lo = max(0, math.floor(corr_dim(beta_fast)))
        hi = min(n_rot - 1, math.ceil(corr_dim(beta_slow)))
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
        freq = freq / factor * (1.0 - ramp) + freq * ramp
    return freq.astype(np.float32)


def rope(x: nn.Tensor, positions_start, inv_freq: np.ndarray, offset: int = 0, inverse: bool = False,
         name: str = "rope", stride: int = 1) -> nn.Tensor:
    """Rotates interleaved pairs of the last 2*len(inv_freq) channels of x [T, ..., D] at position
    start + t + offset (t the first axis); with stride > 1, at (start // stride + t) * stride + offset
    (rows that are every stride-th position, as compressed rows are)."""
    def f(x_te, fr, start):
        return te.compute(x_te.shape, _rope_te(lambda i: x_te[i], fr, start, 2 * len(inv_freq), x_te.shape[-1],
                                               offset, inverse, stride), name=name)

    # Opaque to FuseOps: fused into its neighbours, this kernel makes FuseTIR fail (s_tir RenewDefs,
    # "VarRemapGet(source) == nullptr"; found by marking kernel families opaque one at a time).
    return op.tensor_expr_op(f, name, [x, nn.Tensor.from_const(inv_freq), positions_start], attrs={"op_pattern": 8})


def rms_rope(x: nn.Tensor, eps: float, weight: nn.Tensor | None, positions_start, inv_freq: np.ndarray,
             name: str = "rms_rope", fp8: bool = False, fp4: bool = False, **at) -> nn.Tensor:
    """rope(rms(x, eps, weight), positions_start, inv_freq, **at), with fp8 then the E4M3 round
    trip of the channels before the rotated ones (rounding.fp8_round_rows), with fp4 then
    rounding.hadamard_fp4. In the GPU forms one kernel, the rotation reading the normalized pair
    in registers (with fp8, rows [n, D] only: gpu_kernels.rms_rope_fp8; with fp4, read inline by
    the transform); the CPU keeps its kernels."""
    n_rot = 2 * len(inv_freq)
    assert not (fp8 and fp4)
    if not exporting_gpu_forms():
        y = rope(rms(x, eps, weight), positions_start, inv_freq, **at)
        y = fp8_round_rows(y, int(x.shape[-1]) - n_rot) if fp8 else y
        return hadamard_fp4(y) if fp4 else y
    if fp4:
        def rotated(x_te, fr, start, *w):
            normalized = _rms_te(lambda i: x_te[i], x_te.shape, eps, w)
            body = _rope_te(lambda i: normalized(*i), fr, start, n_rot, x_te.shape[-1], **at)
            return lambda i: body(*i)

        return hadamard_fp4(x, before=([nn.Tensor.from_const(inv_freq), positions_start]
                                       + ([weight] if weight is not None else []), rotated))
    if fp8:
        func = gpu_kernels.rms_rope_fp8(int(x.shape[-1]), n_rot, float(eps), weight is not None, at.get("offset", 0),
                                        at.get("stride", 1), binds_gpu_threads())
        w = weight if weight is not None else nn.Tensor.from_const(np.zeros(1, np.float32))
        return op.tensor_ir_op(func, name, [x, nn.Tensor.from_const(inv_freq), positions_start, w],
                               nn.Tensor.placeholder(x.shape, F32))

    def f(x_te, fr, start, *w):
        normalized = _rms_te(lambda i: x_te[i], x_te.shape, eps, w)
        return te.compute(x_te.shape, _rope_te(lambda i: normalized(*i), fr, start, n_rot, x_te.shape[-1], **at),
                          name=name)

    return op.tensor_expr_op(f, name, [x, nn.Tensor.from_const(inv_freq), positions_start]
                             + ([weight] if weight is not None else []), attrs={"op_pattern": 8})


def rope_hadamard_fp4(x: nn.Tensor, positions_start, inv_freq: np.ndarray, name: str = "hadamard_fp4") -> nn.Tensor:
    """hadamard_fp4(rope(x, positions_start, inv_freq)); in the GPU forms one kernel, the
    transform reading the rotated pairs inline."""
    if not exporting_gpu_forms():
        return hadamard_fp4(rope(x, positions_start, inv_freq), name)

    def rotated(x_te, fr, start):
        body = _rope_te(lambda i: x_te[i], fr, start, 2 * len(inv_freq), x_te.shape[-1])
        return lambda i: body(*i)

    return hadamard_fp4(x, name, before=([nn.Tensor.from_const(inv_freq), positions_start], rotated))


def _rope_te(src, fr, start, n_rot: int, D, offset: int = 0, inverse: bool = False, stride: int = 1):
    """The rotated element idx of src (an element accessor) for rope's te.compute."""
    lo = D - n_rot

    def body(*idx):
        t, d = idx[0], idx[-1]
        rest = idx[1:-1]
        j = (d - lo) // 2
        pos = start + t if stride == 1 else (start // stride + t) * stride
        theta = (pos + offset).astype(F32) * fr[j]
        c, s = te.cos(theta), te.sin(theta)
        if inverse:
            s = -s
        even = (d - lo) % 2 == 0
        a = src((t, *rest, tirx.if_then_else(even, d, d - 1)))
        b = src((t, *rest, tirx.if_then_else(even, d + 1, d)))
        rotated = tirx.if_then_else(even, a * c - b * s, a * s + b * c)
        return tirx.if_then_else(d < lo, src(idx), rotated)

    return body


def rope_neox(x: nn.Tensor, positions_start, inv_freq: np.ndarray, offset: int = 0, name: str = "rope_neox"
              ) -> nn.Tensor:
    """Rotates the first 2*len(inv_freq) channels of x [T, ..., D] in halves (channel i with
    i + len(inv_freq), transformers' rotate_half) at position start + t + offset."""
    half = len(inv_freq)
    freq = nn.Tensor.from_const(inv_freq)

    def f(x_te, fr, start):
        def body(*idx):
            t, d = idx[0], idx[-1]
            rest = idx[1:-1]
            j = tirx.floormod(d, half)
            theta = (start + t + offset).astype(F32) * fr[tirx.min(j, half - 1)]
            c, s = te.cos(theta), te.sin(theta)
            lo = x_te[(t, *rest, tirx.min(j, d))]
            hi = x_te[(t, *rest, tirx.min(j + half, x_te.shape[-1] - 1))]
            rotated = tirx.if_then_else(d < half, lo * c - hi * s, hi * c + lo * s)
            return tirx.if_then_else(d < 2 * half, rotated, x_te[idx])

        return te.compute(x_te.shape, body, name=name)

    return op.tensor_expr_op(f, name, [x, freq, positions_start], attrs={"op_pattern": 8})


def periodic_rows(table: nn.Tensor, positions_start, n_like: nn.Tensor, period: int, name: str) -> nn.Tensor:
    """table[(start + t) % period] for each row t of n_like (DeepSeek-V4's compressor position
    bias). In the GPU forms marked a broadcast, which it is as far as fusion cares (a row read by
    index, no reduction), so that it fuses with its consumer's add into the GEMV before it."""
    def f(a, x, s):
        return te.compute((x.shape[0], a.shape[1]), lambda t, d: a[tirx.floormod(s + t, period), d], name=name)

    attrs = {"op_pattern": BROADCAST} if exporting_gpu_forms() else None
    return op.tensor_expr_op(f, name, [table, n_like, positions_start], attrs=attrs)


# ---------------------------------------------------------------------------- hyper-connections
def hc_pre(X: nn.Tensor, fn, scale: nn.Tensor, base: nn.Tensor, hc: int, eps: float, hc_eps: float,
           iters: int, norm: nn.Tensor | None = None):
    """X [T, hc, D] -> (sublayer input [T, D], post [T, hc], comb [T, hc(src), hc(dst)]) with the
    combine matrix c[dst, src] made doubly stochastic by Sinkhorn (eps in every divisor); with
    norm, the sublayer input RMS-normalized by it. In the GPU forms with a norm, two kernels: the
    mixing GEMV, which also sums the squares of the streams, and _hc_norm_func."""
    n, _, D = X.shape
    if norm is not None and exporting_gpu_forms():
        func = _hc_norm_func(int(hc), int(D), int(iters), float(hc_eps), float(eps), binds_gpu_threads())
        mix = fn.linear_and_squares(op.reshape(X, (n, hc * D)), name="hc_mix")
        x, post, c = op.tensor_ir_op(func, "hc_pre_norm", args=[mix, scale, base, X, norm],
                                     out=[nn.Tensor.placeholder((n, D), F32), nn.Tensor.placeholder((n, hc), F32),
                                          nn.Tensor.placeholder((n, hc, hc), F32)])
        return x, post, c
    flat = rms(op.reshape(X, (n, hc * D)), eps)
    mix = fn.linear(flat, name="hc_mix")
    if exporting_gpu_forms():   # one kernel: there, a launch costs more than the work
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


def hc_post(out: nn.Tensor, X: nn.Tensor, post: nn.Tensor, comb: nn.Tensor) -> nn.Tensor:
    """X'[dst] = post[dst] * out + sum_src c[dst, src]... read as comb[dst + hc*src] = c[src, dst].
    In the GPU forms one kernel (as relax ops: a transpose, then the matmul with its fused
    epilogue); the CPU keeps the separate kernels, whose product and sum LLVM cannot contract
    into one FMA, so its logits stay as they were."""
    if exporting_gpu_forms():
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
            norm: nn.Tensor | None = None) -> nn.Tensor:
    """X [T, hc, D] -> [T, D]: the streams summed with sigmoid weights of their mix; with norm,
    RMS-normalized by it. In the GPU forms with a norm, two kernels (as hc_pre's)."""
    n, hc, D = X.shape
    if norm is not None and exporting_gpu_forms():
        func = _hc_norm_func(int(hc), int(D), 0, float(hc_eps), float(eps), binds_gpu_threads(), head=True)
        mix = fn.linear_and_squares(op.reshape(X, (n, hc * D)), name="hc_head_mix")
        return op.tensor_ir_op(func, "hc_head_norm", args=[mix, scale, base, X, norm],
                               out=nn.Tensor.placeholder((n, D), F32))
    mix = fn.linear(rms(op.reshape(X, (n, hc * D)), eps), name="hc_head_mix")
    w = op.sigmoid(mix * scale + base) + hc_eps
    h = op.sum(op.reshape(w, (n, hc, 1)) * X, axis=1)
    return h if norm is None else rms(h, eps, norm)


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
                            rope_back: np.ndarray | None = None, write_ring: tuple | None = None):
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
    if isinstance(kv_ctx, RingRows) and exporting_gpu_forms() and window + M <= gpu_kernels.MAX_SLOTS:
        ring_shape = tuple(int(x) for x in kv_ctx.ring.shape)
        # the rows written land in slots no block reads: fewer new rows than the ring holds beyond
        # `before` (a recorded width: at most max_verify rows, for which rings are sized)
        in_kernel = write_ring is not None and write_ring[0] is kv_ctx.ring and write_ring[1] is kv_ctx.new \
            and (recorded_width(n) or isinstance(n, int) and n + kv_ctx.before <= ring_shape[0])
        func = gpu_kernels.window_attention(
            int(H), int(D), ring_shape, kv_ctx.before, tuple(int(x) for x in comp.shape) if has_comp else None,
            M if use_sel else None, window, ratio, 2 * len(rope_back) if rope_back is not None else 0,
            binds_gpu_threads(), in_kernel)
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
        out = _te_window_attention(q, kv_ctx, comp, sel, sinks, start, window, ratio, name)
        if rope_back is not None:
            out = rope(out, start, rope_back, inverse=True)
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
        A, valid, key = _window_slots(ctx, ctx_rows, rest[0] if has_comp else None, rest[1] if use_sel else None, s,
                                      window, ratio)
        return attend_with_sinks(q_te, key, valid, A, sk, name)

    return op.tensor_expr_op(f, name, args)


def _window_slots(ctx, ctx_rows, comp_te, sel_te, s, window: int, ratio: int):
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
                   name: str) -> nn.Tensor:
    """Lightning indexer: score_c = sum_h w[t,h] * relu(iq[t,h] . key_c) over the visible rows
    c < (p+1)//ratio; returns the indices of the top_k scores [T, min(top_k, rows)] (invisible rows
    score -inf, so when fewer than top_k are visible all of them are among the indices). Rows that
    are not visible yet are not scored at all (they were most of a short prefill's time); each dot
    is 16 partial sums along contiguous channels, summed in lane order."""
    rows = int(keys.shape[0])
    _, heads, dim = iq.shape
    if exporting_gpu_forms():
        scores = op.tensor_expr_op(functools.partial(_indexer_scores_te, ratio=ratio), name, [iq, w, keys, start])
    else:
        func = _indexer_scores_func(int(heads), int(dim), rows, ratio)
        scores = op.tensor_ir_op(func, name, args=[iq, w, keys, start],
                                 out=nn.Tensor.placeholder((iq.shape[0], rows), "float32"))
    k = min(top_k, rows)
    if exporting_gpu_forms() and rows <= gpu_kernels.MAX_BLOCK_THREADS:   # one launch where TOPI's sort takes five
        func = gpu_kernels.top_k(rows, k, False, bind=binds_gpu_threads())
        chosen, _ = op.tensor_ir_op(func, name + "_topk", [scores, nn.Tensor.from_const(np.zeros(1, np.float32))],
                                    [nn.Tensor.placeholder((iq.shape[0], k), "int32"),
                                     nn.Tensor.placeholder((iq.shape[0], k), F32)])
        return chosen
    return op.topk(scores, k=k, axis=-1, ret_type="indices", dtype="int32", name=name + "_topk")
