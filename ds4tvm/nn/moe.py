"""Feed-forward blocks shared by the families: the clamped SwiGLU, the routed experts of a chosen
set with their weights, and the dense (shared-expert or leading-layer) FFN. Weights are the QWeights
of one layer keyed by their GGUF suffix (`ffn_gate_exps.weight`, ...)."""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .qweight import exporting_gpu_forms


def clamped_swiglu(gate: nn.Tensor, up: nn.Tensor, limit: float) -> nn.Tensor:
    """SiLU(min(gate, limit)) * clip(up, -limit, limit); limit <= 0: no clamp."""
    if limit > 0:
        gate = op.minimum(gate, nn.Tensor.from_scalar(limit, "float32"))
        up = op.minimum(op.maximum(up, nn.Tensor.from_scalar(-limit, "float32")),
                        nn.Tensor.from_scalar(limit, "float32"))
    return op.silu(gate) * up


def choose_experts(scores: nn.Tensor, k: int) -> nn.Tensor:
    """The indices of each token's k highest scores [T, k] int32, highest first (equal scores:
    the lower index first). In the GPU forms each expert's rank among the scores, then the expert
    of each rank: two small kernels where TOPI's sort launches five."""
    if not exporting_gpu_forms():
        return op.topk(scores, k=k, axis=-1, ret_type="indices", dtype="int32")

    def f(x):
        n, E = x.shape
        one, zero = tirx.const(1, "int32"), tirx.const(0, "int32")
        other = te.reduce_axis((0, E), name="other")
        rank = te.compute((n, E), lambda t, e: te.sum(tirx.if_then_else(tirx.Or(
            x[t, other] > x[t, e], tirx.And(x[t, other] == x[t, e], other < e)), one, zero), axis=other),
            name="expert_rank")
        e = te.reduce_axis((0, E), name="e")
        return te.compute((n, k), lambda t, j: te.sum(tirx.if_then_else(rank[t, e] == j, e.astype("int32"), zero),
                                                      axis=e), name="chosen_experts")

    return op.tensor_expr_op(f, "choose_experts", [scores])


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


def routed_experts(w: dict, h: nn.Tensor, experts: nn.Tensor, weights: nn.Tensor, limit: float) -> nn.Tensor:
    """sum_j weights[t, j] * FFN_{experts[t, j]}(h[t]) [T, D], reading only the chosen experts."""
    n, k = h.shape[0], experts.shape[1]
    act = clamped_swiglu(w["ffn_gate_exps.weight"].expert_linear(h, experts),
                         w["ffn_up_exps.weight"].expert_linear(h, experts), limit)
    routed = w["ffn_down_exps.weight"].expert_linear(act, experts)            # [T, k, D]
    return op.sum(op.reshape(weights, (n, k, 1)) * routed, axis=1)


def dense_ffn(w: dict, h: nn.Tensor, limit: float, suffix: str = "") -> nn.Tensor:
    """down(SwiGLU(gate h, up h)) of `ffn_{gate,up,down}{suffix}.weight` (suffix `_shexp`: the
    shared expert)."""
    act = clamped_swiglu(w[f"ffn_gate{suffix}.weight"].linear(h), w[f"ffn_up{suffix}.weight"].linear(h), limit)
    return w[f"ffn_down{suffix}.weight"].linear(act)
