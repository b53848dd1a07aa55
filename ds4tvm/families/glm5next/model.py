"""GLM-5.3-Flash as a TVM Relax module (ds4-spec §4 and its Errata), weights read from GGUF planes in
either layout (tensors.py): mHC on every trunk layer, KDA or DSA attention, dense or MoE FFN, and
the output head over the unweighted mean of the 4 streams.

State (DESIGN.md), per KDA layer: the conv history of [q; k; v] as a ring of rows and the delta-rule
state as recurrent snapshot slots (nn/state.py), so a verify followed by commit(j) is a pick with
no replay; per DSA layer: the MLA latent rows by position, and for layers with their own indexer
rings of the newest index keys and pool gates and the table of pooled keys (one per `pool` tokens).
"""

from __future__ import annotations

import math

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import Bounds, StateSpec
from ...nn.attention import attend_with_sinks, indexer_select, selected_pool_positions
from ...nn.hyper import embedded_streams, hc_post, hc_pre
from ...nn.norm_rope import layer_norm, rms
from ...nn.linear_attention import causal_conv_silu, delta_rule, l2_normalized_heads
from ...nn.moe import choose_experts, dense_ffn, routed_experts
from ...nn.functions import START, Fn, Sequences, TargetFunctions, last_rows, target_functions, tokens
from ...nn.qweight import QWeight
from ...nn.state import emit_rows, gather_context, ring_write
from .config import LLAMA, Config
from .tensors import canonical_pairs

F32 = "float32"


def layer_states(cfg: Config, b: Bounds, layer: int) -> list[StateSpec]:
    """The state tensors of one layer, in argument order."""
    p = f"blk.{layer}."
    if not cfg.is_dsa(layer):
        H, D, hist = cfg.kda_n_head, cfg.kda_head_dim, cfg.conv_kernel - 1
        conv, slots = hist + b.max_verify, b.max_verify + 1
        return [StateSpec(p + "kda_conv", (conv, 3 * H * D), ring=conv, rewind=conv - hist),
                StateSpec(p + "kda_state", (slots, H * D * D), ring=slots, rewind=slots - 1)]
    out = [StateSpec(p + "mla_latent", (b.max_context, cfg.kv_lora_rank), stride=1)]
    if cfg.has_indexer(layer):
        P, ID = cfg.idx_pool, cfg.idx_head_dim
        front = P - 1 + b.max_verify
        out += [StateSpec(p + "idx_key_front", (front, ID), ring=front, rewind=front - (P - 1)),
                StateSpec(p + "idx_gate_front", (front, ID), ring=front, rewind=front - (P - 1)),
                StateSpec(p + "idx_pooled", (b.max_context // P, ID), stride=P)]
    return out


def state_specs(cfg: Config, b: Bounds) -> list[StateSpec]:
    return [s for layer in range(cfg.n_layers) for s in layer_states(cfg, b, layer)]


def _head_ids(x: nn.Tensor, heads: int) -> nn.Tensor:
    """[n, heads] int32 rows 0..heads-1: per-head matrices of a [H, N, K] tensor applied through
    the expert kernels (expert j = head j)."""
    return op.tensor_expr_op(lambda x_te: te.compute((x_te.shape[0], heads), lambda t, h: h.astype("int32"),
                                                     name="head_ids"), "head_ids", [x])


class Layer(nn.Module):
    """One GLM-5.3 layer: `w` holds its QWeights by canonical suffix, whatever the file's layout."""

    def __init__(self, cfg: Config, layer: int, types: dict):
        self.cfg, self.il = cfg, layer
        self.w = {}
        prefix = f"blk.{layer}."
        for canonical, spec, suffix in canonical_pairs(cfg):
            if canonical.name.startswith(prefix) and spec.name in types:
                w = QWeight(spec.name, types[spec.name], tuple(reversed(spec.shape)))
                setattr(self, suffix.replace(".", "_"), w)
                self.w[suffix] = w
        if cfg.layout != LLAMA and "kda_a_log.weight" in self.w:
            self.w["kda_a_log.weight"].derive = "neg_exp"   # -exp(A_log) on the host, as llama.cpp's file holds it

    def v(self, suffix: str) -> nn.Tensor:
        return self.w[suffix + ".weight"].values(name=suffix.replace(".", "_"))

    def _hc_pre(self, X, part: str):
        """HC pre of a sublayer with its RMSNorm (`attn_norm`, `ffn_norm`): (input, post, comb)."""
        c = self.cfg
        return hc_pre(X, self.w[f"hc_{part}_fn.weight"], self.v(f"hc_{part}_scale"), self.v(f"hc_{part}_base"),
                      c.hc, c.rms_eps, c.hc_eps, c.hc_sinkhorn_iters, norm=self.v(f"{part}_norm"), forms=self.forms)

    def attention(self, X, start, states: dict, prev_selection):
        """The attention sublayer with its hyper-connection: (X', new states, the selection a
        following DSA layer without its own indexer reuses)."""
        h, post, comb = self._hc_pre(X, "attn")
        if self.cfg.is_dsa(self.il):
            out, new, sel = self.dsa(h, start, states, prev_selection)
        else:
            (out, new), sel = self.kda(h, start, states), prev_selection
        return hc_post(out, X, post, comb, forms=self.forms), new, sel

    def ffn(self, X):
        h, post, comb = self._hc_pre(X, "ffn")
        return hc_post(self.ffn_out(h), X, post, comb, forms=self.forms)

    def ffn_out(self, h):
        c = self.cfg
        return self.moe(h) if c.is_moe(self.il) else dense_ffn(self.w, h, c.swiglu_shexp[self.il])

    def moe(self, h):
        """Sigmoid router; the bias only selects; chosen scores normalised and scaled."""
        c, w = self.cfg, self.w
        scores = op.sigmoid(w["ffn_gate_inp.weight"].linear(h, name="router"))
        experts, ws = choose_experts(scores, c.n_expert_used, w["exp_probs_b.bias"].values(name="probs_bias"),
                                     (lambda total: total + tirx.const(1e-20, F32)) if c.expert_weights_norm else None,
                                     c.expert_weights_scale, forms=self.forms)
        return routed_experts(w, h, experts, ws, c.swiglu_exp[self.il], forms=self.forms) + dense_ffn(w, h, c.swiglu_shexp[self.il],
                                                                                     "_shexp")

    # ------------------------------------------------------------------ KDA
    def kda(self, x, start, states):
        c, w = self.cfg, self.w
        n, H, D, K = x.shape[0], c.kda_n_head, c.kda_head_dim, c.conv_kernel
        inner = H * D
        proj = op.concat([w[f"kda_{p}.weight"].linear(x, name=f"kda_{p}") for p in "qkv"], dim=1)
        conv_w = op.concat([op.reshape(self.v(f"kda_{p}_conv"), (inner, K)) for p in "qkv"], dim=0)
        qkv, conv_ring = causal_conv_silu(states["kda_conv"], proj, conv_w, start, name="kda_conv")
        q = l2_normalized_heads(qkv, 0, H, D, 1.0 / math.sqrt(D), name="kda_q_norm")
        k = l2_normalized_heads(qkv, inner, H, D, 1.0, name="kda_k_norm")
        v = op.reshape(op.split(qkv, 3, axis=1)[2], (n, H, D))
        g = self._decay_log(w["kda_f_b.weight"].linear(w["kda_f_a.weight"].linear(x)) + self.v("kda_dt_bias"))
        beta = op.sigmoid(w["kda_beta.weight"].linear(x, name="kda_beta"))
        o, slots = delta_rule(q, k, v, g, beta, states["kda_state"], start, name="kda_delta_rule", forms=self.forms)
        gate = op.sigmoid(w["kda_g_b.weight"].linear(w["kda_g_a.weight"].linear(x)))
        o = rms(o, c.rms_eps, self.v("kda_o_norm")) * op.reshape(gate, (n, H, D))
        out = w["kda_output.weight"].linear(op.reshape(o, (n, inner)))
        return out, {"kda_conv": conv_ring, "kda_state": slots}

    def _decay_log(self, g: nn.Tensor) -> nn.Tensor:
        """Per-channel log-decay [n, H, D] from g = f_b(f_a(x)) + dt_bias: lb * sigmoid(rate * g)
        with the lower bound lb, else -rate * softplus(g), where rate = exp(A_log); the parameter
        holds -exp(A_log) in both layouts (Layer.__init__)."""
        c = self.cfg
        H, D, lb = c.kda_n_head, c.kda_head_dim, c.gate_lower_bound

        def f(g_te, a_te):
            def body(t, h, d):
                rate = -a_te[h]
                x = g_te[t, h * D + d]
                if lb is not None:
                    return tirx.const(lb, F32) * te.sigmoid(rate * x)
                softplus = tirx.if_then_else(x > tirx.const(20.0, F32), x, te.log(tirx.const(1.0, F32) + te.exp(x)))
                return -rate * softplus

            return te.compute((g_te.shape[0], H, D), body, name="kda_decay")

        return op.tensor_expr_op(f, "kda_decay", [g, self.v("kda_a_log")])

    # ------------------------------------------------------------------ DSA
    def dsa(self, x, start, states, prev_selection):
        c, w = self.cfg, self.w
        n, H = x.shape[0], c.n_head
        q_low = rms(w["attn_q_a.weight"].linear(x), c.rms_eps, self.v("attn_q_a_norm"))
        q = op.reshape(w["attn_q_b.weight"].linear(q_low), (n, H, c.key_length))
        table = self._latent_write(x, start, states)
        heads = _head_ids(x, H)
        q_abs = w["attn_k_b.weight"].expert_linear(q, heads, name="mla_q_absorb")        # [n, H, Rkv]
        new = {"mla_latent": table}
        if c.has_indexer(self.il):
            sel, idx_states = self.indexer(x, q_low, start, states)
            new.update(idx_states)
        else:
            sel = prev_selection
        o_lat = self._latent_attention(q_abs, table, sel, start)
        o = w["attn_v_b.weight"].expert_linear(o_lat, heads, name="mla_v_expand")        # [n, H, Dv]
        return w["attn_output.weight"].linear(op.reshape(o, (n, H * c.value_length))), new, sel

    def _latent_write(self, x, start, states):
        c = self.cfg
        latent = rms(self.w["attn_kv_a_mqa.weight"].linear(x), c.rms_eps, self.v("attn_kv_a_norm"))
        return ring_write(states["mla_latent"], latent, start, name="mla_latent_write")

    def dsa_writes(self, x, start, states) -> dict:
        """The state a DSA layer with its own indexer writes for the rows x (after attn_norm),
        without attending: latent rows, index key and gate rings, pooled keys."""
        return {"mla_latent": self._latent_write(x, start, states), **self._index_keys(x, start, states)}

    def _index_keys(self, x, start, states) -> dict:
        """Index keys (LayerNorm'd) and pool gates into their rings, and the keys of the pools the
        rows complete: pools of `pool` tokens from position 0, pooled by a softmax of gate + ape
        per channel."""
        c, w, P = self.cfg, self.w, self.cfg.idx_pool
        keys = layer_norm(w["indexer.attn_k.weight"].linear(x), c.idx_norm_eps, self.v("indexer.k_norm"),
                          w["indexer.k_norm.bias"].values(name="idx_k_norm_bias"), name="idx_k_norm")
        gates = w["indexer.pool_gate.weight"].linear(x, name="idx_pool_gate")
        key_ring, gate_ring = states["idx_key_front"], states["idx_gate_front"]
        kctx = gather_context(key_ring, keys, start, P - 1, name="idx_key_context")
        gctx = gather_context(gate_ring, gates, start, P - 1, name="idx_gate_context")
        cand = _pooled_keys(kctx, gctx, self.v("indexer.pool_ape"), P)
        return {"idx_key_front": ring_write(key_ring, keys, start, name="idx_key_write"),
                "idx_gate_front": ring_write(gate_ring, gates, start, name="idx_gate_write"),
                "idx_pooled": emit_rows(states["idx_pooled"], cand, start, P, compact=False, name="idx_pool_emit")}

    def indexer(self, x, q_low, start, states):
        """The pools each token attends (_index_keys): the top_k / pool best complete pools by
        sum_h w_h relu(q_h . key / sqrt(ID)) (all of them while there are no more)."""
        c, w = self.cfg, self.w
        n, P, IH, ID = x.shape[0], c.idx_pool, c.idx_n_head, c.idx_head_dim
        new = self._index_keys(x, start, states)
        iq = op.reshape(w["indexer.attn_q_b.weight"].linear(q_low), (n, IH, ID))
        iw = w["indexer.proj.weight"].linear(x) * (1.0 / math.sqrt(IH * ID))
        return indexer_select(iq, iw, new["idx_pooled"], start, P, c.idx_top_k // P, name="indexer", forms=self.forms), new

    def _latent_attention(self, q_abs, table, sel, start):
        """Softmax attention of the absorbed queries [n, H, Rkv] over the latent rows of the
        tokens of the selected pools (those complete at the token's position) and of the
        unfinished pool up to the token itself; keys and values are the latent rows."""
        c = self.cfg
        rows = int(table.shape[0])

        def f(q_te, lat, sel_te, s):
            A, pos, valid = selected_pool_positions(sel_te, s, c.idx_pool, c.idx_select_tail)

            def key(t, a, d):
                return lat[tirx.max(tirx.min(pos(t, a), rows - 1), 0), d]

            return attend_with_sinks(q_te, key, valid, A, None, "mla_attention", scale=1.0 / math.sqrt(c.key_length))

        return op.tensor_expr_op(f, "mla_attention", [q_abs, table, sel, start])


def _pooled_keys(kctx: nn.Tensor, gctx: nn.Tensor, ape: nn.Tensor, P: int) -> nn.Tensor:
    """For each new token t, the pooled key of the P rows ending at it (ctx rows t..t+P-1): per
    channel sum_j softmax_j(gate_j + ape[j]) key_j. Only the rows of tokens that end a pool are
    kept (emit_rows)."""
    def f(k, g, a):
        n, ID = k.shape[0] - (P - 1), k.shape[1]
        j = te.reduce_axis((0, P), name="j")
        logit = lambda t, jj, d: g[t + jj, d] + a[jj, d]   # noqa: E731
        mx = te.compute((n, ID), lambda t, d: te.max(logit(t, j, d), axis=j), name="idx_pool_max")
        j2 = te.reduce_axis((0, P), name="j2")
        den = te.compute((n, ID), lambda t, d: te.sum(te.exp(logit(t, j2, d) - mx[t, d]), axis=j2), name="idx_pool_den")
        j3 = te.reduce_axis((0, P), name="j3")
        num = te.compute((n, ID), lambda t, d: te.sum(te.exp(logit(t, j3, d) - mx[t, d]) * k[t + j3, d], axis=j3),
                         name="idx_pool_num")
        return te.compute((n, ID), lambda t, d: num[t, d] / den[t, d], name="idx_pool")

    return op.tensor_expr_op(f, "idx_pool", [kctx, gctx, ape])


class GLM5Next(TargetFunctions, nn.Module):
    """The target. Every call returns the logits, then `hidden` [rows, D]: the output head's input
    of every row (prefill's logits are its last row's; the MTP layer reads every row's hidden), and
    with `outputs` extended by the MTP subclass, `streams` [rows, hc * D]: the trunk's hc residual
    streams before they collapse."""

    outputs = ("logits", "hidden")

    def __init__(self, cfg: Config, types: dict, bounds: Bounds = Bounds()):
        self.cfg, self.bounds = cfg, bounds
        top = {spec.name: spec for _, spec, _ in canonical_pairs(cfg) if not spec.name.startswith("blk.")}
        for name, spec in top.items():
            setattr(self, name.replace(".weight", ""), QWeight(name, types[name], tuple(reversed(spec.shape))))
        self.layers = nn.ModuleList([Layer(cfg, il, types) for il in range(cfg.n_layers)])
        self.state_names = [s.name for s in state_specs(cfg, bounds)]

    def _rows(self, ids, seqs: Sequences, last: int | None):
        c = self.cfg
        n = ids.shape[0]
        X = embedded_streams(self.token_embd, ids, c.hc, c.n_embd)
        sels = [None] * len(seqs)   # each sequence's last DSA selection, which a layer without an indexer reuses

        def attention(i, rows, start, mine, layer):
            rows, new, sels[i] = layer.attention(rows, start, mine, sels[i])
            return rows, new

        for il, layer in enumerate(self.layers):
            X = seqs.per_sequence(X, f"blk.{il}.", lambda *a, layer=layer: attention(*a, layer))
            X = layer.ffn(X)
        hidden = rms(op.sum(X, axis=1) * (1.0 / c.hc), c.rms_eps, self.output_norm.values(name="output_norm"))
        outs = {"logits": self.output.linear(last_rows(hidden, last), name="output_lm_head"), "hidden": hidden,
                "streams": op.reshape(X, (n, c.hc * c.n_embd))}
        return (*(outs[k] for k in self.outputs), *seqs.outputs())

    def state_specs(self) -> list[StateSpec]:
        return state_specs(self.cfg, self.bounds)

    def functions(self) -> list[Fn]:
        return target_functions(lambda rows: (tokens(rows, "ids"), START), self.outputs, self.bounds.max_batch)
