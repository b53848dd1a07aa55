"""GLM-5.3's KDA layer (ds4-spec §4) token by token in float64 numpy, written from the spec and
llama.cpp's `glm5-next` graph: the reference the compiled layer will be checked against, row by row
and across prefill / decode / verify boundaries (its state after any row is what a snapshot ring
must hold there).

Per token x (after attn_norm), with H heads of D channels and I = H * D:
  q, k, v = causal depthwise conv (width K, history of the K - 1 previous rows) of W{q,k,v} x, SiLU;
  q, k L2-normalised per head (x / sqrt(sum x^2 + 1e-6)), q scaled by 1 / sqrt(D);
  g = f_b(f_a(x)) + dt_bias per channel; decay log: lb * sigmoid(exp(A_log) * g) with the lower
  bound lb, else -exp(A_log) * softplus(g);
  beta = sigmoid(W_beta x) per head;
  per head S <- S * exp(g) (row-wise over the key channels); S += k (beta (v - S^T k))^T; o = S^T q;
  out = W_o (RMSNorm(o per head; o_norm, rms_eps) * sigmoid(g_b(g_a(x)))).
Weights are the canonical tensors of one layer in numpy order (tensors.py names without blk.L.)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KDAState:
    conv: np.ndarray    # [K - 1, 3 I]: the last K - 1 rows of [Wq x; Wk x; Wv x], oldest first
    S: np.ndarray       # [H, D, D]: key channel x value channel

    @classmethod
    def zeros(cls, cfg) -> "KDAState":
        inner = cfg.kda_n_head * cfg.kda_head_dim
        return cls(np.zeros((cfg.conv_kernel - 1, 3 * inner)), np.zeros((cfg.kda_n_head, cfg.kda_head_dim,
                                                                          cfg.kda_head_dim)))

    def copy(self) -> "KDAState":
        return KDAState(self.conv.copy(), self.S.copy())


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def decay_log(w: dict, cfg, x: np.ndarray) -> np.ndarray:
    """The per-channel log-decay g [T, H, D] of rows x [T, E]."""
    H, D = cfg.kda_n_head, cfg.kda_head_dim
    g = (x @ w["kda_f_a.weight"].T @ w["kda_f_b.weight"].T + w["kda_dt_bias.weight"]).reshape(-1, H, D)
    rate = np.exp(w["kda_a_log.weight"].reshape(1, H, 1))
    if cfg.gate_lower_bound is not None:
        return cfg.gate_lower_bound * _sigmoid(rate * g)
    return -rate * np.where(g > 20.0, g, np.log1p(np.exp(np.minimum(g, 20.0))))


def kda_layer(w: dict, cfg, x: np.ndarray, state: KDAState | None = None, states: list | None = None):
    """out [T, E] for rows x [T, E] after `state` (zeros: a new sequence), and the state after the
    last row; `states`, when a list, receives a copy of the state after every row."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    x = np.asarray(x, np.float64)
    H, D = cfg.kda_n_head, cfg.kda_head_dim
    inner = H * D
    st = (state or KDAState.zeros(cfg)).copy()
    proj = np.concatenate([x @ w[f"kda_{n}.weight"].T for n in "qkv"], axis=1)          # [T, 3I]
    conv_w = np.concatenate([w[f"kda_{n}_conv.weight"] for n in "qkv"])                   # [3I, K]
    g, beta = decay_log(w, cfg, x), _sigmoid(x @ w["kda_beta.weight"].T)                  # [T,H,D], [T,H]
    gate = _sigmoid(x @ w["kda_g_a.weight"].T @ w["kda_g_b.weight"].T).reshape(-1, H, D)
    out = np.zeros((len(x), H, D))
    for t in range(len(x)):
        window = np.concatenate([st.conv, proj[t:t + 1]])                                 # [K, 3I]
        st.conv = window[1:]
        qkv = _silu((window * conv_w.T).sum(axis=0))
        q, k, v = (qkv[i * inner:(i + 1) * inner].reshape(H, D) for i in range(3))
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(D)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        st.S = st.S * np.exp(g[t])[:, :, None]
        delta = (v - np.einsum("hkv,hk->hv", st.S, k)) * beta[t][:, None]
        st.S = st.S + k[:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", st.S, q)
        if states is not None:
            states.append(st.copy())
    normed = out / np.sqrt((out * out).mean(-1, keepdims=True) + cfg.rms_eps) * w["kda_o_norm.weight"]
    return (normed * gate).reshape(len(x), inner) @ w["kda_output.weight"].T, st
