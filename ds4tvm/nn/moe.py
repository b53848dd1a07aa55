"""Feed-forward blocks shared by the families: the clamped SwiGLU, the routed experts of a chosen
set with their weights, and the dense (shared-expert or leading-layer) FFN. Weights are the QWeights
of one layer keyed by their GGUF suffix (`ffn_gate_exps.weight`, ...)."""

from __future__ import annotations

from tvm import te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op


def clamped_swiglu(gate: nn.Tensor, up: nn.Tensor, limit: float) -> nn.Tensor:
    """SiLU(min(gate, limit)) * clip(up, -limit, limit); limit <= 0: no clamp."""
    if limit > 0:
        gate = op.minimum(gate, nn.Tensor.from_scalar(limit, "float32"))
        up = op.minimum(op.maximum(up, nn.Tensor.from_scalar(-limit, "float32")),
                        nn.Tensor.from_scalar(limit, "float32"))
    return op.silu(gate) * up


def chosen_scores(scores: nn.Tensor, experts: nn.Tensor) -> nn.Tensor:
    """scores[t, experts[t, j]]: each token's scores of its chosen experts [T, k]."""
    def gather(p_te, e_te):
        return te.compute(e_te.shape, lambda t, j: p_te[t, e_te[t, j]], name="route_weight")

    return op.tensor_expr_op(gather, "route_weight", [scores, experts])


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
