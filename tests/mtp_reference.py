"""A numpy reference of DeepSeek-V4's legacy one-stage MTP draft (ds4-spec §7), written from the
spec's text (§2 for the V4 block, hyper-connections and output head) and gguf's dequantizer; no
code of the TVM graph is used. FP8 rounding of the cached rows is left out: compare with an
artifact compiled with --no-kv-rounding."""

from __future__ import annotations

import numpy as np
from gguf import quants


class Weights:
    def __init__(self, gguf_file, prefix: str = ""):
        self.f, self.prefix = gguf_file, prefix

    def __call__(self, name: str) -> np.ndarray:
        t = self.f.tensors[self.prefix + name]
        w = quants.dequantize(np.asarray(t.data), t.ggml_type).astype(np.float64)
        return w.reshape(tuple(reversed(t.shape)))   # numpy order: [out, in]


def rms(x, eps, w=None):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def hc_pre(X, fn, scale, base, eps, hc_eps, iters):
    """§2 HC pre for one token: X [hc, D] -> (x [D], post [hc], comb [hc, hc] as mix-indexed)."""
    hc = X.shape[0]
    mix = fn @ rms(X.reshape(-1), eps)
    pre = sigmoid(mix[:hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * sigmoid(mix[hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (mix[2 * hc:] * scale[2] + base[2 * hc:]).reshape(hc, hc)    # c[dst, src]
    c = np.exp(c - c.max(axis=1, keepdims=True))
    c = c / c.sum(axis=1, keepdims=True) + hc_eps
    c = c / (c.sum(axis=0, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=1, keepdims=True) + hc_eps)
        c = c / (c.sum(axis=0, keepdims=True) + hc_eps)
    return pre @ X, post, c


def hc_post(out, X, post, c):
    """X'_dst = post_dst * out + sum_src comb[dst + hc * src] X_src, comb flattened as c[row, col]."""
    return post[:, None] * out[None] + c.T @ X


def rope(x, pos, n_rot, base, inverse=False):
    """Interleaved pairs over the last n_rot values of each row of x [..., D]."""
    x = x.copy()
    j = np.arange(n_rot // 2)
    theta = pos * base ** (-2.0 * j / n_rot) * (-1 if inverse else 1)
    tail = x[..., -n_rot:]
    a, b = tail[..., 0::2].copy(), tail[..., 1::2].copy()
    tail[..., 0::2] = a * np.cos(theta) - b * np.sin(theta)
    tail[..., 1::2] = a * np.sin(theta) + b * np.cos(theta)
    return x


class MTPReference:
    def __init__(self, target_gguf, support_gguf, cfg):
        """cfg: the target's Config (the block shares its hyper-parameters, ratio 0)."""
        self.c, self.t, self.w = cfg, Weights(target_gguf), Weights(support_gguf, "mtp.0.")
        self.rows: dict[int, np.ndarray] = {}

    def inputs(self, hc_prev, token):
        c, w = self.c, self.w
        e = w("e_proj.weight") @ rms(self.t("token_embd.weight")[token], c.rms_eps, w("enorm.weight"))
        h = rms(hc_prev, c.rms_eps, w("hnorm.weight")) @ w("h_proj.weight").T
        return e[None] + h

    def _attn_in(self, X):
        c, w = self.c, self.w
        x, post, comb = hc_pre(X, w("hc_attn_fn.weight"), w("hc_attn_scale.weight"), w("hc_attn_base.weight"),
                               c.rms_eps, c.hc_eps, c.hc_sinkhorn_iters)
        return rms(x, c.rms_eps, w("attn_norm.weight")), post, comb

    def kv_row(self, X, pos):
        c, w = self.c, self.w
        n = self._attn_in(X)[0]
        return rope(rms(w("attn_kv.weight") @ n, c.rms_eps, w("attn_kv_a_norm.weight")), pos, c.n_rot, c.rope_base)

    def observe(self, hc_prev, token, pos):
        self.rows[pos] = self.kv_row(self.inputs(hc_prev, token), pos)

    def step(self, hc_prev, token, pos):
        """(logits [V], X' [hc, D]) of one draft step; writes the row of pos."""
        X = self.inputs(hc_prev, token)
        self.rows[pos] = self.kv_row(X, pos)
        X = self._attention(X, pos)
        X = self._moe(X)
        return self._head(X), X

    def _attention(self, X, pos):
        c, w = self.c, self.w
        H, D = c.n_head, c.head_dim
        n, post, comb = self._attn_in(X)
        q = w("attn_q_b.weight") @ rms(w("attn_q_a.weight") @ n, c.rms_eps, w("attn_q_a_norm.weight"))
        q = rope(rms(q.reshape(H, D), c.rms_eps), pos, c.n_rot, c.rope_base)
        keys = np.stack([self.rows[p] for p in range(max(0, pos - c.sliding_window + 1), pos + 1)])
        scores = q @ keys.T / np.sqrt(D)                                 # [H, rows]
        sinks = w("attn_sinks.weight")
        m = np.maximum(scores.max(axis=1), sinks)
        p = np.exp(scores - m[:, None])
        attn = (p @ keys) / (p.sum(axis=1) + np.exp(sinks - m))[:, None]
        attn = rope(attn, pos, c.n_rot, c.rope_base, inverse=True)
        g, per = c.o_groups, H // c.o_groups
        wa = w("attn_output_a.weight")
        low = np.concatenate([wa[i * c.o_lora_rank:(i + 1) * c.o_lora_rank] @ attn[i * per:(i + 1) * per].reshape(-1)
                              for i in range(g)])
        return hc_post(w("attn_output_b.weight") @ low, X, post, comb)

    def _moe(self, X):
        c, w = self.c, self.w
        x, post, comb = hc_pre(X, w("hc_ffn_fn.weight"), w("hc_ffn_scale.weight"), w("hc_ffn_base.weight"),
                               c.rms_eps, c.hc_eps, c.hc_sinkhorn_iters)
        h = rms(x, c.rms_eps, w("ffn_norm.weight"))
        p = np.sqrt(np.log1p(np.exp(w("ffn_gate_inp.weight") @ h)))
        chosen = np.argsort(-(p + w("exp_probs_b.bias")), kind="stable")[:c.n_expert_used]
        weights = p[chosen] / max(p[chosen].sum(), 6.1e-5) * c.expert_weights_scale
        lim = c.swiglu_clamp[0]

        def swiglu(gate, up):
            return (lambda g: g / (1 + np.exp(-g)))(np.minimum(gate, lim)) * np.clip(up, -lim, lim)

        gate, up, down = w("ffn_gate_exps.weight"), w("ffn_up_exps.weight"), w("ffn_down_exps.weight")
        y = sum(wt * (down[e] @ swiglu(gate[e] @ h, up[e] @ h)) for wt, e in zip(weights, chosen))
        y = y + w("ffn_down_shexp.weight") @ swiglu(w("ffn_gate_shexp.weight") @ h, w("ffn_up_shexp.weight") @ h)
        return hc_post(y, X, post, comb)

    def _head(self, X):
        c, w = self.c, self.w
        pre = w("hc_head_fn.weight") @ rms(X.reshape(-1), c.rms_eps)
        wts = sigmoid(pre * w("hc_head_scale.weight")[0] + w("hc_head_base.weight")) + c.hc_eps
        return self.t("output.weight") @ rms(wts @ X, c.rms_eps, w("norm.weight"))
