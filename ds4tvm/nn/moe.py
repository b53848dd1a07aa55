"""Feed-forward blocks shared by the families: the clamped SwiGLU, the routed experts of a chosen
set with their weights, and the dense (shared-expert or leading-layer) FFN. Weights are the QWeights
of one layer keyed by their GGUF suffix (`ffn_gate_exps.weight`, ...)."""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..kernels.tags import BROADCAST
from ..kernels import gpu as gpu_kernels
from ..kernels.forms import Forms


def clamped_swiglu(gate: nn.Tensor, up: nn.Tensor, limit: float, *, forms: Forms) -> nn.Tensor:
    """SiLU(min(gate, limit)) * clip(up, -limit, limit); limit <= 0: no clamp. On the CPU one
    kernel (no fusion pass there: as relax ops it was five kernels and five passes over the rows,
    a batched decode's scaling with its sequences) whose exp is arithmetic (_exp_value), which
    LLVM vectorizes: a call of expf per value took 6% of a batched decode of 8."""
    if not forms.gpu:
        def f(g, u):
            return te.compute(g.shape, lambda *i: _swiglu_value(g[i], u[i], limit), name="swiglu")

        return op.tensor_expr_op(f, "swiglu", [gate, up])
    if limit > 0:
        gate = op.minimum(gate, nn.Tensor.from_scalar(limit, "float32"))
        up = op.minimum(op.maximum(up, nn.Tensor.from_scalar(-limit, "float32")),
                        nn.Tensor.from_scalar(limit, "float32"))
    return op.silu(gate) * up


def _swiglu_value(g, u, limit: float):
    """clamped SiLU(g) * u of one gate and up value, SiLU as g / (1 + exp(-g)) with _exp_value."""
    def silu(x):
        return x / (tirx.const(1.0, "float32") + _exp_value(-x))

    return gpu_kernels.clamped_swiglu_value(g, u, limit, silu)


def _exp_value(x):
    """exp(x) of a float32 in arithmetic only: x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by Cephes'
    degree-6 polynomial, 2^n built in the exponent bits (the method of TVM's topi.fast_exp; within
    an ulp of exp: tests/unit/test_swiglu_exp.py); x clamped to [-87.33, 88.37], where 2^n is a
    normal float32 (below it, the smallest normal, about 1.2e-38: 1 + exp(x) is still 1)."""
    f32 = "float32"

    def c(v):
        return tirx.const(v, f32)

    x = tirx.max(tirx.min(x, c(88.37)), c(-87.33))
    n = tirx.floor(x * c(1.44269504088896341) + c(0.5))
    r = x - n * c(0.693359375) - n * c(-2.12194440e-4)   # ln 2 in two parts: r exact to float32
    p = c(1.9875691500e-4)
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c(k)
    e = p * (r * r) + r + c(1.0)
    two_n = tirx.reinterpret(f32, tirx.shift_left(n.astype("int32") + 127, 23))
    return e * two_n


def choose_experts(scores: nn.Tensor, k: int, bias: nn.Tensor | None = None, denominator=None,
                   scale: float = 1.0, *, forms: Forms) -> tuple[nn.Tensor, nn.Tensor]:
    """(experts, weights): the indices of each token's k highest scores (plus bias [E] when given)
    [T, k] int32, highest first (equal scores: the lower index first), and route_weights of the
    unbiased scores for them. In the GPU forms one kernel (gpu_kernels.top_k) where TOPI's sort,
    the bias add and the weights took seven launches."""
    E = int(scores.shape[1])
    if not forms.gpu or E > gpu_kernels.MAX_BLOCK_THREADS:
        experts = op.topk(scores if bias is None else scores + bias, k=k, axis=-1, ret_type="indices", dtype="int32")
        return experts, route_weights(scores, experts, denominator, scale)
    func = gpu_kernels.top_k(E, k, bias is not None, denominator, float(scale), forms.binds_threads)
    absent = nn.Tensor.from_const(np.zeros(1, np.float32))
    experts, weights = op.tensor_ir_op(func, "choose_experts", [scores, bias if bias is not None else absent],
                                       [nn.Tensor.placeholder((scores.shape[0], k), "int32"),
                                        nn.Tensor.placeholder((scores.shape[0], k), "float32")])
    return experts, weights


def table_experts(table: nn.Tensor, ids: nn.Tensor, scores: nn.Tensor, denominator=None,
                  scale: float = 1.0, *, forms: Forms) -> tuple[nn.Tensor, nn.Tensor]:
    """(experts, weights): each token's row of a token-id table [V, k] and route_weights of the
    scores for them; in the GPU forms one kernel (gpu_kernels.table_experts)."""
    if not forms.gpu:
        # "clip" (the ids are range-checked before every call, so it never changes a row): the
        # default "fast" mode makes TVM warn at every compile that it segfaults out of bounds
        experts = nn.core.wrap_nested(relax.op.take(table._expr, ids._expr, axis=0, mode="clip"), "take")
        return experts, route_weights(scores, experts, denominator, scale)
    (V, k), E = [int(d) for d in table.shape], int(scores.shape[1])
    func = gpu_kernels.table_experts(E, V, k, denominator, float(scale), forms.binds_threads)
    experts, weights = op.tensor_ir_op(func, "table_experts", [scores, table, ids],
                                       [nn.Tensor.placeholder((scores.shape[0], k), "int32"),
                                        nn.Tensor.placeholder((scores.shape[0], k), "float32")])
    return experts, weights


def route_weights(scores: nn.Tensor, experts: nn.Tensor, denominator=None, scale: float = 1.0) -> nn.Tensor:
    """Each token's weights of its chosen experts [T, k] in one kernel: scores[t, experts[t, j]],
    divided by denominator(their sum) when given (a TIR expression of it), times scale. As relax ops
    it was five kernels per MoE layer (gather, sum, clamp or shift, divide, multiply), the same
    float operations in the same order (a division and a product: nothing for LLVM to contract)."""
    def f(p_te, e_te):
        n, k = e_te.shape
        chosen = te.compute((n, k), lambda t, j: p_te[t, e_te[t, j]], name="route_chosen")
        if denominator is None:
            weight = chosen
        else:
            j2 = te.reduce_axis((0, k), name="j2")
            total = te.compute((n,), lambda t: te.sum(chosen[t, j2], axis=j2), name="route_sum")
            weight = te.compute((n, k), lambda t, j: chosen[t, j] / denominator(total[t]), name="route_norm")
        if scale == 1.0:
            return weight
        return te.compute((n, k), lambda t, j: weight[t, j] * tirx.const(scale, "float32"), name="route_weight")

    return op.tensor_expr_op(f, "route_weights", [scores, experts])


def routed_experts(w: dict, h: nn.Tensor, experts: nn.Tensor, weights: nn.Tensor, limit: float, *, forms: Forms) -> nn.Tensor:
    """sum_j weights[t, j] * FFN_{experts[t, j]}(h[t]) [T, D], reading only the chosen experts."""
    n, k = h.shape[0], experts.shape[1]
    gate, up = w["ffn_gate_exps.weight"].expert_linear(h, experts), w["ffn_up_exps.weight"]
    act = up.expert_swiglu(gate, h, experts, limit)   # the GPU forms: the SwiGLU in the up GEMV
    if act is None:
        act = clamped_swiglu(gate, up.expert_linear(h, experts), limit, forms=forms)
    routed = w["ffn_down_exps.weight"].expert_linear(act, experts)            # [T, k, D]
    if forms.gpu:   # fused into the next GEMV's epilogue (the shared expert's down projection)
        return op.tensor_expr_op(_weighted_slots, "routed_sum", [weights, routed], attrs={"op_pattern": BROADCAST})
    return op.sum(op.reshape(weights, (n, k, 1)) * routed, axis=1)


def _weighted_slots(w_te, r_te):
    """sum_j w[t, j] r[t, j, :] written out over the k slots, in slot order: elementwise for
    fusion (marked a broadcast, as a row read by index is), where a reduction would stay a kernel."""
    n, k, D = r_te.shape

    def body(t, d):
        v = w_te[t, 0] * r_te[t, 0, d]
        for j in range(1, int(k)):
            v = v + w_te[t, j] * r_te[t, j, d]
        return v

    return te.compute((n, D), body, name="routed_sum")


def dense_ffn(w: dict, h: nn.Tensor, limit: float, suffix: str = "") -> nn.Tensor:
    """down(SwiGLU(gate h, up h)) of `ffn_{gate,up,down}{suffix}.weight` (suffix `_shexp`: the
    shared expert)."""
    gate = w[f"ffn_gate{suffix}.weight"]
    act = clamped_swiglu(gate.linear(h), w[f"ffn_up{suffix}.weight"].linear(h), limit, forms=gate.forms)
    return w[f"ffn_down{suffix}.weight"].linear(act)
