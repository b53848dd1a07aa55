"""GLM-5.3's attention layers (ds4-spec §4 and its Errata) in float64 numpy, written from the spec and
llama.cpp's `glm5-next` graph: the references the compiled layers will be checked against row by
row. Weights are the canonical tensors of one layer in numpy order (families/glm5next/tensors.py
names without blk.L.); x are the rows after attn_norm.

KDA (`kda_layer`), per token, with H heads of D channels and I = H * D:
  q, k, v = causal depthwise conv (width K, history of the K - 1 previous rows) of W{q,k,v} x, SiLU;
  q, k L2-normalised per head (x / sqrt(sum x^2 + 1e-6)), q scaled by 1 / sqrt(D);
  g = f_b(f_a(x)) + dt_bias per channel; decay log: lb * sigmoid(exp(A_log) * g) with the lower
  bound lb, else -exp(A_log) * softplus(g);
  beta = sigmoid(W_beta x) per head;
  per head S <- S * exp(g) (row-wise over the key channels); S += k (beta (v - S^T k))^T; o = S^T q;
  out = W_o (RMSNorm(o per head; o_norm, rms_eps) * sigmoid(g_b(g_a(x)))).
Its state after any row is what a snapshot ring must hold there.

DSA (`dsa_layer`): MLA without RoPE over the kv_lora latent, with the pooled sparse indexer:
  latent c = RMSNorm(W_kv_a x); q = W_q_b RMSNorm(W_q_a x) per head; the query of token t attends,
  with scale 1 / sqrt(key_length), to keys k_b c and values v_b c of the tokens its indexer selects;
  indexer: keys LayerNorm(W_k x) (weight, bias, eps 1e-6); pools of P consecutive tokens from
  position 0, each pooled key sum_i softmax_i(W_gate x_i + ape_i) * key_i (per channel over the pool);
  score of a complete pool ending at or before t: sum_h w_h relu(q_idx_h . pooled / sqrt(ID)), with
  w = W_proj x / sqrt(IH); the top_k / P best pools (ties to the lower pool) plus the unfinished tail
  (the (t + 1) % P newest tokens); with no more than top_k / P complete pools, all of them (dense).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

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


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def indexer_selection(w: dict, cfg, x: np.ndarray, q_low: np.ndarray) -> list[np.ndarray]:
    """For each row t of x [T, E] (positions 0..T-1) the token positions it attends, ascending."""
    P, IH, ID = cfg.idx_pool, cfg.idx_n_head, cfg.idx_head_dim
    k = x @ w["indexer.attn_k.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + cfg.idx_norm_eps)
    k = k * w["indexer.k_norm.weight"] + w["indexer.k_norm.bias"]
    gate = x @ w["indexer.pool_gate.weight"].T
    n_pools = len(x) // P
    pooled = np.zeros((n_pools, ID))
    for j in range(n_pools):
        logits = gate[j * P:(j + 1) * P] + w["indexer.pool_ape.weight"]          # [P, ID]
        e = np.exp(logits - logits.max(0))
        pooled[j] = (e / e.sum(0) * k[j * P:(j + 1) * P]).sum(0)
    q = (q_low @ w["indexer.attn_q_b.weight"].T).reshape(len(x), IH, ID)
    weights = x @ w["indexer.proj.weight"].T / np.sqrt(IH)                        # [T, IH]
    keep = cfg.idx_top_k // P
    out = []
    for t in range(len(x)):
        complete = (t + 1) // P
        if complete <= keep:
            pools = np.arange(complete)
        else:
            score = (weights[t][:, None] * np.maximum(q[t] @ pooled[:complete].T / np.sqrt(ID), 0)).sum(0)
            pools = np.sort(np.argsort(-score, kind="stable")[:keep])
        tokens = (pools[:, None] * P + np.arange(P)).reshape(-1)
        tail = np.arange(complete * P, t + 1) if cfg.idx_select_tail else np.arange(0)
        out.append(np.concatenate([tokens, tail]).astype(np.int64))
    return out


def dsa_layer(w: dict, cfg, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """out [T, E] for the rows x [T, E] of positions 0..T-1, and each row's selected positions."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    x = np.asarray(x, np.float64)
    H, Dk, Dv = cfg.n_head, cfg.key_length, cfg.value_length
    q_low = _rms(x @ w["attn_q_a.weight"].T, w["attn_q_a_norm.weight"], cfg.rms_eps)
    q = (q_low @ w["attn_q_b.weight"].T).reshape(len(x), H, Dk)
    c = _rms(x @ w["attn_kv_a_mqa.weight"].T, w["attn_kv_a_norm.weight"], cfg.rms_eps)   # [T, Rkv]
    keys = np.einsum("hrk,tr->thk", w["attn_k_b.weight"], c)          # k_b [H, Rkv, Dk] (numpy order)
    values = np.einsum("hvr,tr->thv", w["attn_v_b.weight"], c)        # v_b [H, Dv, Rkv]
    selection = indexer_selection(w, cfg, x, q_low)
    out = np.zeros((len(x), H, Dv))
    for t, sel in enumerate(selection):
        s = np.einsum("hk,shk->hs", q[t], keys[sel]) / np.sqrt(Dk)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[t] = np.einsum("hs,shv->hv", p / p.sum(-1, keepdims=True), values[sel])
    return out.reshape(len(x), H * Dv) @ w["attn_output.weight"].T, selection


def _swiglu(gate, up, limit):
    if limit > 0:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return _silu(gate) * up


def moe_ffn(w: dict, cfg, layer: int, x: np.ndarray) -> np.ndarray:
    """The FFN of an MoE layer for the rows x [T, E] (after ffn_norm): sigmoid scores, the top
    n_expert_used by score + bias, their scores normalised (sum + 1e-20) and scaled, clamped SwiGLU
    experts, plus the shared expert."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    scores = _sigmoid(x @ w["ffn_gate_inp.weight"].T)                                  # [T, X]
    chosen = np.argsort(-(scores + w["exp_probs_b.bias"]), axis=-1, kind="stable")[:, :cfg.n_expert_used]
    out = np.zeros_like(x)
    for t in range(len(x)):
        ws = scores[t, chosen[t]]
        if cfg.expert_weights_norm:
            ws = ws / (ws.sum() + 1e-20)
        for j, e in enumerate(chosen[t]):
            act = _swiglu(w["ffn_gate_exps.weight"][e] @ x[t], w["ffn_up_exps.weight"][e] @ x[t], cfg.swiglu_exp[layer])
            out[t] += cfg.expert_weights_scale * ws[j] * (w["ffn_down_exps.weight"][e] @ act)
    shared = _swiglu(x @ w["ffn_gate_shexp.weight"].T, x @ w["ffn_up_shexp.weight"].T, cfg.swiglu_shexp[layer])
    return out + shared @ w["ffn_down_shexp.weight"].T


def nextn_logits(w: dict, top: dict, cfg, tokens: list[int], hidden_before: np.ndarray) -> np.ndarray:
    """The MTP (nextn) layer's logits [T, V] for tokens at positions 0..T-1, each with the target's
    row of the position before it (hidden_before; a zero row at position 0), from the spec (§4 and
    its Errata): eh_proj [enorm(embed); hnorm(hidden)], one pre-norm DSA + MoE block without
    hyper-connections, shared_head_norm, the target's output head. What the row is follows hnorm's
    width: E, the output head's input [T, E]; hc * E, the trunk's hc streams before they collapse
    [T, hc * E], each stream RMS-normed on its own. w: the layer's canonical tensors (numpy order);
    top: token_embd, output_norm, output."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    emb = np.asarray(top["token_embd.weight"], np.float64)[tokens]
    e = _rms(emb, w["nextn.enorm.weight"], cfg.rms_eps)
    E, gamma = emb.shape[1], w["nextn.hnorm.weight"]
    rows = np.asarray(hidden_before, np.float64).reshape(len(tokens), -1, E)             # [T, streams, E]
    h = _rms(rows, np.ones(E), cfg.rms_eps).reshape(len(tokens), -1) * gamma
    x = np.concatenate([e, h], axis=1) @ w["nextn.eh_proj.weight"].T
    x = x + dsa_layer(w, cfg, _rms(x, w["attn_norm.weight"], cfg.rms_eps))[0]
    x = x + moe_ffn(w, cfg, cfg.n_layers, _rms(x, w["ffn_norm.weight"], cfg.rms_eps))
    norm = w.get("nextn.shared_head_norm.weight", top["output_norm.weight"])
    return _rms(x, norm, cfg.rms_eps) @ np.asarray(top["output.weight"], np.float64).T


def read_config(path) -> SimpleNamespace:
    """A GLM-5.3 GGUF's hyper-parameters in ds4's layout, read with gguf-py alone (the references
    read the file format, not ds4tvm's parser), under the names the functions above use."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    key = lambda name, default=None: (fields[f"glm5-next.{name}"].contents()   # noqa: E731
                                      if f"glm5-next.{name}" in fields else default)
    if key("layer_types") is None:
        raise ValueError(f"{path}: the reference reads ds4's GLM-5.3 layout (glm5-next.layer_types)")
    n, limit, lead = key("trunk_block_count"), float(key("swiglu_limit", 0.0)), key("leading_dense_block_count", 0)
    return SimpleNamespace(
        n_layers=n, n_embd=key("embedding_length"), n_ff=key("feed_forward_length", 0),
        n_ff_exp=key("expert_feed_forward_length"), n_expert=key("expert_count"),
        n_expert_used=key("expert_used_count"), n_dense_lead=lead, is_moe=lambda layer: layer >= lead,
        expert_weights_norm=bool(key("expert_weights_norm", False)),
        expert_weights_scale=float(key("expert_weights_scale", 1.0)), rms_eps=key("attention.layer_norm_rms_epsilon"),
        n_head=key("attention.head_count"), key_length=key("attention.key_length"),
        value_length=key("attention.value_length"), q_lora_rank=key("attention.q_lora_rank"),
        kv_lora_rank=key("attention.kv_lora_rank"), idx_pool=key("attention.indexer.pool_size"),
        idx_n_head=key("attention.indexer.head_count"), idx_head_dim=key("attention.indexer.key_length"),
        idx_top_k=key("attention.indexer.top_k"), idx_norm_eps=1e-6, idx_select_tail=True,
        kda_n_head=key("linear_attention.head_count"), kda_head_dim=key("linear_attention.head_dimension"),
        conv_kernel=key("linear_attention.conv_kernel"), gate_lower_bound=key("linear_attention.gate_lower_bound"),
        layer_types=tuple(key("layer_types")), swiglu_exp=(limit,) * (n + 1), swiglu_shexp=(limit,) * (n + 1))


def read_tensors(path, keep) -> dict:
    """The tensors whose name `keep` accepts, dequantized by gguf-py, in numpy order."""
    from gguf import GGUFReader, quants

    return {t.name: quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(int(d) for d in
                                                                                    reversed(t.shape)))
            for t in GGUFReader(path).tensors if keep(t.name)}


def read_nextn(path) -> tuple[SimpleNamespace, dict, dict]:
    """(config, the nextn layer's tensors without `blk.L.`, token_embd/output_norm/output) of a
    GGUF in ds4's layout: what `nextn_logits` takes."""
    cfg = read_config(path)
    prefix, top = f"blk.{cfg.n_layers}.", ("token_embd.weight", "output_norm.weight", "output.weight")
    values = read_tensors(path, lambda name: name.startswith(prefix) or name in top)
    layer = {name[len(prefix):]: v for name, v in values.items() if name.startswith(prefix)}
    return cfg, layer, {name: values[name] for name in top}
