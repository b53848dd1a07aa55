"""Qwen3.8 Flash Next as a TVM Relax module (ds4-spec §5 and its Errata): hc residual streams mixed
by the low-rank HC mixer before every sublayer (there are no other layer norms), Gated DeltaNet or
gated attention with the QSA indexer, the softmax-routed MoE with a gated shared expert, PLE on its
layer, and the output head over the mixer without inject.

State (DESIGN.md), per GDN layer: the conv history of [q; k; v] as a ring of rows and the delta-rule
state as recurrent snapshot slots (nn/state.py); on the PLE layer also the ring of normalised gated
rows its dilated conv reads; per attention layer: K and V rows by position, a ring of the newest raw
index keys and the table of pooled block keys (one per `ratio` tokens). The PLE table rows come in
as the host input `ple` (ple.py)."""

from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import Bounds, StateSpec
from ...nn.attention import indexer_select, selected_pool_positions, softmax_attention
from ...nn.norm_rope import rms, rope_neox
from ...nn.linear_attention import causal_conv_silu, delta_rule, l2_normalized_heads
from ...nn.moe import choose_experts, dense_ffn, routed_experts
from ...nn.hyper import embedded_streams
from ...nn.functions import START, Arg, Declared, Fn, Sequences, last_rows, target_functions, tokens
from ...nn.qweight import QWeight
from ...nn.state import emit_rows, gather_context, ring_write
from .config import Config
from .tensors import layer_specs

F32 = "float32"


def layer_states(cfg: Config, b: Bounds, layer: int) -> list[StateSpec]:
    """The state tensors of one layer, in argument order."""
    p = f"blk.{layer}."
    if cfg.is_gdn(layer):
        D, hist = cfg.gdn_head_dim, cfg.conv_kernel - 1
        conv, slots = hist + b.max_verify, b.max_verify + 1
        out = [StateSpec(p + "gdn_conv", (conv, (2 * cfg.gdn_k_heads + cfg.gdn_v_heads) * D), ring=conv,
                         rewind=conv - hist),
               StateSpec(p + "gdn_state", (slots, cfg.gdn_v_heads * D * D), ring=slots, rewind=slots - 1)]
        if layer in cfg.ple_layers:
            hist = (cfg.ple_conv_kernel - 1) * cfg.ngram
            out.append(StateSpec(p + "ple_conv", (hist + b.max_verify, cfg.hc * cfg.n_embd), ring=hist + b.max_verify,
                                 rewind=b.max_verify))
        return out
    P, W = cfg.ratio(layer), cfg.n_head_kv * cfg.head_dim
    front = P - 1 + b.max_verify
    return [StateSpec(p + "attn_k", (b.max_context, W), stride=1), StateSpec(p + "attn_v", (b.max_context, W), stride=1),
            StateSpec(p + "idx_key_front", (front, cfg.idx_head_dim), ring=front, rewind=front - (P - 1)),
            StateSpec(p + "idx_pooled", (b.max_context // P, cfg.idx_head_dim), stride=P)]


def state_specs(cfg: Config, b: Bounds) -> list[StateSpec]:
    return [s for layer in range(cfg.n_layers) for s in layer_states(cfg, b, layer)]


def _per_stream(x: nn.Tensor, hc: int, D: int, eps: float, gamma: nn.Tensor) -> nn.Tensor:
    """RMSNorm of each stream of x [n, hc * D] (or [n, hc, D]) with its own gamma [hc * D]: [n, hc, D]."""
    return rms(op.reshape(x, (x.shape[0], hc, D)), eps) * op.reshape(gamma, (1, hc, D))


def hc_mix(X: nn.Tensor, w: dict, part: str, hc: int, eps: float, inject: bool = True):
    """The low-rank HC mixer (Errata): xn = per-stream RMSNorm(X) * gamma; lo = SiLU(down(xn) / hc);
    mixed = mean_s sigmoid(up(lo))_s * xn_s [n, D]; with inject also 2 sigmoid(W_inj xn / hc) [n, hc]."""
    n, _, D = X.shape
    label = part.replace(".", "_")
    xn = _per_stream(X, hc, D, eps, w[f"{part}_norm.weight"].values(name=f"{label}_norm"))
    flat = op.reshape(xn, (n, hc * D))
    lo = op.silu(w[f"{part}_down.weight"].linear(flat, name=f"{label}_down") * (1.0 / hc))
    gate = op.sigmoid(op.reshape(w[f"{part}_up.weight"].linear(lo, name=f"{label}_up"), (n, hc, D)))
    mixed = op.sum(gate * xn, axis=1) * (1.0 / hc)
    if not inject:
        return mixed
    return mixed, op.sigmoid(w[f"{part}_inject.weight"].linear(flat, name=f"{label}_inject") * (1.0 / hc)) * 2.0


def _inject(X: nn.Tensor, weights: nn.Tensor, out: nn.Tensor) -> nn.Tensor:
    """R_s += weights_s * out."""
    n, hc, D = X.shape
    return X + op.reshape(weights, (n, hc, 1)) * op.reshape(out, (n, 1, D))


def _constant_rows(x: nn.Tensor, width: int, value: float, name: str) -> nn.Tensor:
    return op.tensor_expr_op(lambda x_te: te.compute((x_te.shape[0], width), lambda t, h: tirx.const(value, F32),
                                                     name=name), name, [x])


def layer_weights(owner: nn.Module, layer: int, specs: list[tuple], types: dict) -> dict:
    """QWeights of blk.{layer}.SUFFIX for (suffix, shape, types) specs, by suffix, each an attribute
    of owner (so one of its parameters)."""
    out = {}
    for suffix, shape, _ in specs:
        name = f"blk.{layer}.{suffix}"
        out[suffix] = QWeight(name, types[name], tuple(reversed(shape)))
        setattr(owner, suffix.replace(".", "_"), out[suffix])
    return out


class Layer(nn.Module):
    """One Qwen3.8 trunk layer; `w` holds its QWeights by GGUF suffix."""

    def __init__(self, cfg: Config, layer: int, types: dict):
        self.cfg, self.il = cfg, layer
        self.w = layer_weights(self, layer, layer_specs(cfg, layer), types)
        self.inv_freq = (1.0 / cfg.rope_base ** (np.arange(0, cfg.n_rot, 2, dtype=np.int64).astype(np.float32)
                                                 / cfg.n_rot)).astype(np.float32)

    def v(self, suffix: str) -> nn.Tensor:
        return self.w[suffix].values(name=suffix.replace(".", "_"))

    def forward_layer(self, X, ple_parts: list, seqs: Sequences):
        """The layer over the rows of seqs (ple_parts: each sequence's PLE rows): the PLE and the
        token mixer (GDN or attention) per sequence, on its state; the rest on every row."""
        c, prefix = self.cfg, f"blk.{self.il}."
        if self.il in c.ple_layers:
            X = seqs.per_sequence(X, prefix, lambda i, rows, start, st: self.ple(rows, ple_parts[i], start, st))
        mixed, weights = hc_mix(X, self.w, "hc_attn", c.hc, c.rms_eps)
        mixer = self.gdn if c.is_gdn(self.il) else self.attention
        X = _inject(X, weights, seqs.per_sequence(mixed, prefix, lambda _, rows, start, st: mixer(rows, start, st)))
        mixed, weights = hc_mix(X, self.w, "hc_ffn", c.hc, c.rms_eps)
        return _inject(X, weights, self.moe(mixed))

    # ------------------------------------------------------------------ Gated DeltaNet
    def gdn(self, x, start, states):
        c, w = self.cfg, self.w
        n, D, Hk, Hv = x.shape[0], c.gdn_head_dim, c.gdn_k_heads, c.gdn_v_heads
        qkv, conv_ring = causal_conv_silu(states["gdn_conv"], w["attn_qkv.weight"].linear(x, name="gdn_qkv"),
                                          self.v("ssm_conv1d.weight"), start, name="gdn_conv")
        # value head j reads key head j % Hk (the GGUF's tiled order)
        q = op.concat([l2_normalized_heads(qkv, 0, Hk, D, 1.0 / math.sqrt(D), name="gdn_q_norm")] * (Hv // Hk), dim=1)
        k = op.concat([l2_normalized_heads(qkv, Hk * D, Hk, D, 1.0, name="gdn_k_norm")] * (Hv // Hk), dim=1)
        v = op.reshape(op.split(qkv, [2 * Hk * D], axis=1)[1], (n, Hv, D))
        g = self._decay_log(w["ssm_alpha.weight"].linear(x, name="gdn_alpha") + self.v("ssm_dt.bias"))
        beta = op.sigmoid(w["ssm_beta.weight"].linear(x, name="gdn_beta"))
        o, slots = delta_rule(q, k, v, op.broadcast_to(op.reshape(g, (n, Hv, 1)), (n, Hv, D)), beta,
                              states["gdn_state"], start, name="gdn_delta_rule", forms=self.forms)
        z = op.reshape(w["attn_gate.weight"].linear(x, name="gdn_z"), (n, Hv, D))
        o = rms(o, c.rms_eps, self.v("ssm_norm.weight")) * (op.sigmoid(z) if c.gate_type == "sigmoid" else op.silu(z))
        return w["ssm_out.weight"].linear(op.reshape(o, (n, Hv * D))), {"gdn_conv": conv_ring, "gdn_state": slots}

    def _decay_log(self, a: nn.Tensor) -> nn.Tensor:
        """Per-head log-decay ssm_a * softplus(alpha + dt_bias) [n, Hv] (ssm_a = -exp(A_log)); softplus
        as max(x, 0) + log(1 + exp(-|x|)): no log1p, which ROCm's device library lacks."""
        def f(a_te, s_te):
            def body(t, h):
                x = a_te[t, h]
                return s_te[h] * (tirx.max(x, tirx.const(0.0, F32))
                                  + te.log(tirx.const(1.0, F32) + te.exp(-te.abs(x))))

            return te.compute(a_te.shape, body, name="gdn_decay")

        return op.tensor_expr_op(f, "gdn_decay", [a, self.v("ssm_a")])

    # ------------------------------------------------------------------ gated attention + QSA
    def attention(self, x, start, states):
        c, w = self.cfg, self.w
        n, H, D = x.shape[0], c.n_head, c.head_dim
        qg = op.reshape(w["attn_q.weight"].linear(x, name="attn_q"), (n, H, 2 * D))
        q, gate = op.split(qg, 2, axis=2)
        q = rope_neox(rms(q, c.rms_eps, self.v("attn_q_norm.weight")), start, self.inv_freq, name="attn_q_rope",
                      forms=self.forms)
        new = self.attention_writes(x, start, states)
        sel = self._select_blocks(x, start, new["idx_pooled"])
        o = self._selected_attention(q, new["attn_k"], new["attn_v"], sel, start) * op.sigmoid(gate)
        return w["attn_output.weight"].linear(op.reshape(o, (n, H * D)), name="attn_output"), new

    def attention_writes(self, x, start, states) -> dict:
        """The rows this layer keeps of x's positions: K and V, the raw index keys and the pooled
        block keys of the blocks they complete (the MTP layer's observe writes only these)."""
        c, w = self.cfg, self.w
        n, Hkv, D = x.shape[0], c.n_head_kv, c.head_dim
        k = op.reshape(w["attn_k.weight"].linear(x, name="attn_k"), (n, Hkv, D))
        k = rope_neox(rms(k, c.rms_eps, self.v("attn_k_norm.weight")), start, self.inv_freq, name="attn_k_rope",
                      forms=self.forms)
        keys = ring_write(states["attn_k"], op.reshape(k, (n, Hkv * D)), start, name="attn_k_write")
        values = ring_write(states["attn_v"], w["attn_v.weight"].linear(x, name="attn_v"), start, name="attn_v_write")
        return {"attn_k": keys, "attn_v": values, **self._index_keys(x, start, states)}

    def _index_keys(self, x, start, states) -> dict:
        """QSA keys: raw index keys per token; every `ratio` tokens the block's mean, RMSNorm'd and
        rotated at the block's first position, into the pooled table."""
        c, P, ID = self.cfg, self.cfg.ratio(self.il), self.cfg.idx_head_dim
        raw = self.w["indexer.k_proj.weight"].linear(x, name="idx_k")
        ring = states["idx_key_front"]
        ctx = gather_context(ring, raw, start, P - 1, name="idx_key_context")
        mean = op.tensor_expr_op(lambda k: te.compute(
            (k.shape[0] - (P - 1), ID), lambda t, d: _sum_rows(k, t, d, P) * tirx.const(1.0 / P, F32),
            name="idx_block_mean"), "idx_block_mean", [ctx])
        pooled = rope_neox(rms(mean, c.rms_eps, self.v("indexer.k_norm.weight")), start, self.inv_freq,
                           offset=-(P - 1), name="idx_block_rope", forms=self.forms)
        table = emit_rows(states["idx_pooled"], pooled, start, P, compact=False, name="idx_block_emit")
        return {"idx_key_front": ring_write(ring, raw, start, name="idx_key_write"), "idx_pooled": table}

    def _select_blocks(self, x, start, table):
        """Blocks scored by sum_h relu(q_h . key) / sqrt(ID): the top_k / ratio best complete ones
        (all while there are no more) plus the tail."""
        c, P = self.cfg, self.cfg.ratio(self.il)
        n, IH, ID = x.shape[0], c.idx_n_head, c.idx_head_dim
        iq = op.reshape(self.w["indexer.q_proj.weight"].linear(x, name="idx_q"), (n, IH, ID))
        iq = rope_neox(rms(iq, c.rms_eps, self.v("indexer.q_norm.weight")), start, self.inv_freq, name="idx_q_rope",
                       forms=self.forms)
        weights = _constant_rows(x, IH, 1.0 / math.sqrt(ID), "idx_head_weights")
        return indexer_select(iq, weights, table, start, P, c.idx_top_k // P, name="qsa_indexer", forms=self.forms)

    def _selected_attention(self, q, keys, values, sel, start):
        c = self.cfg
        rows, group, D = int(keys.shape[0]), c.n_head // c.n_head_kv, c.head_dim

        def f(q_te, k_te, v_te, sel_te, s):
            A, pos, valid = selected_pool_positions(sel_te, s, c.ratio(self.il), True)

            def row(t, a):
                return tirx.max(tirx.min(pos(t, a), rows - 1), 0)

            def key(t, h, a, d):
                return k_te[row(t, a), (h // group) * D + d]

            def value(t, h, a, d):
                return v_te[row(t, a), (h // group) * D + d]

            return softmax_attention(q_te, key, value, valid, A, None, "qsa_attention")

        return op.tensor_expr_op(f, "qsa_attention", [q, keys, values, sel, start])

    # ------------------------------------------------------------------ MoE, PLE
    def moe(self, h):
        """Softmax router over all experts, top-k renormalised; the shared expert scaled by
        sigmoid(ffn_gate_inp_shexp . h)."""
        c, w = self.cfg, self.w
        probs = op.softmax(w["ffn_gate_inp.weight"].linear(h, name="router"), axis=-1)
        experts, ws = choose_experts(probs, c.n_expert_used, denominator=_total, forms=self.forms)
        shared_gate = op.sigmoid(op.matmul(h, op.reshape(self.v("ffn_gate_inp_shexp.weight"), (c.n_embd, 1))))
        return routed_experts(w, h, experts, ws, 0.0, forms=self.forms) + dense_ffn(w, h, 0.0, "_shexp") * shared_gate

    def ple(self, X, emb, start, states: dict):
        """R += gated + SiLU(conv(RMSNorm(gated))), gated_s = sigmoid(ssqrt(<key_s, query_s> / sqrt(D))) value:
        key_s and query_s the per-stream RMSNorms of ple_key(emb) and of R; ssqrt the signed square
        root (|x| clamped at 1e-6); conv the depthwise conv dilated by the n-gram size over its ring."""
        c, w = self.cfg, self.w
        n, hc, D = X.shape
        key = _per_stream(w["ple_key.weight"].linear(emb, name="ple_key"), hc, D, c.rms_eps, self.v("ple_norm_key.weight"))
        query = _per_stream(X, hc, D, c.rms_eps, self.v("ple_norm_query.weight"))
        gate = _signed_sqrt_gate(op.sum(key * query, axis=2) * (1.0 / math.sqrt(D)))
        value = w["ple_value.weight"].linear(emb, name="ple_value")
        gated = op.reshape(gate, (n, hc, 1)) * op.reshape(value, (n, 1, D))
        normed = op.reshape(_per_stream(gated, hc, D, c.rms_eps, self.v("ple_norm_conv.weight")), (n, hc * D))
        ring = states["ple_conv"]
        conv = self._dilated_conv(gather_context(ring, normed, start, (c.ple_conv_kernel - 1) * c.ngram,
                                                 name="ple_conv_context"))
        ring = ring_write(ring, normed, start, name="ple_conv_write")
        return X + gated + op.reshape(op.silu(conv), (n, hc, D)), {"ple_conv": ring}

    def _dilated_conv(self, ctx: nn.Tensor) -> nn.Tensor:
        """out[t, c] = sum_k w[c, k] ctx[t + k * dilation, c] (ctx row j: position start - hist + j)."""
        K, dil = self.cfg.ple_conv_kernel, self.cfg.ngram

        def f(x, w):
            j = te.reduce_axis((0, K), name="j")
            return te.compute((x.shape[0] - (K - 1) * dil, x.shape[1]),
                              lambda t, ch: te.sum(x[t + j * dil, ch] * w[ch, j], axis=j), name="ple_conv")

        return op.tensor_expr_op(f, "ple_conv", [ctx, self.v("ple_conv1d.weight")])


def _total(total):
    """The chosen experts' weights renormalised: each divided by their sum. One function for every
    layer, so that the GPU top-k kernel it is part of (kernels/gpu.top_k, cached by its arguments)
    is written once, not once per layer (0.2 s of TVMScript parsing each)."""
    return total


def _signed_sqrt_gate(s: nn.Tensor) -> nn.Tensor:
    """sigmoid(sign(s) sqrt(max(|s|, 1e-6)))."""
    def f(x):
        def body(*i):
            mag = te.sqrt(tirx.max(te.abs(x[i]), tirx.const(1e-6, F32)))
            sign = tirx.if_then_else(x[i] > 0, tirx.const(1.0, F32),
                                     tirx.if_then_else(x[i] < 0, tirx.const(-1.0, F32), tirx.const(0.0, F32)))
            return te.sigmoid(sign * mag)

        return te.compute(x.shape, body, name="ple_gate")

    return op.tensor_expr_op(f, "ple_gate", [s])


def _sum_rows(k, t, d, P: int):
    total = k[t, d]
    for j in range(1, P):
        total = total + k[t + j, d]
    return total


class Qwen4Exp(Declared, nn.Module):
    """The target: logits of every row (prefill: its last) from the token ids and the PLE rows,
    then `hidden`, the output head's input of every row (and with an MTP layer `streams`, the hc
    residual streams the head mixes, which the layer drafts from)."""

    OUTPUTS = ("logits", "hidden")

    def __init__(self, cfg: Config, types: dict, bounds: Bounds = Bounds()):
        self.cfg, self.bounds = cfg, bounds
        self.token_embd = QWeight("token_embd.weight", types["token_embd.weight"], (cfg.n_vocab, cfg.n_embd))
        self.output = QWeight("output.weight", types["output.weight"], (cfg.n_vocab, cfg.n_embd))
        W = cfg.hc * cfg.n_embd
        self.head = {"output_hc_norm.weight": QWeight("output_hc_norm.weight", types["output_hc_norm.weight"], (W,)),
                     "output_hc_down.weight": QWeight("output_hc_down.weight", types["output_hc_down.weight"],
                                                      (cfg.hc_rank, W)),
                     "output_hc_up.weight": QWeight("output_hc_up.weight", types["output_hc_up.weight"], (W, cfg.hc_rank))}
        for name, qw in self.head.items():
            setattr(self, name.replace(".weight", ""), qw)
        self.layers = nn.ModuleList([Layer(cfg, il, types) for il in range(cfg.n_layers)])
        self.state_names = [s.name for s in state_specs(cfg, bounds)]

    def _forward(self, ids, ple, start, states, last_only: bool):
        return self._rows(ids, ple, Sequences(self.state_names, [(start, states)]), 1 if last_only else None)

    def _rows(self, ids, ple, seqs: Sequences, last: int | None):
        c = self.cfg
        n = ids.shape[0]
        X = embedded_streams(self.token_embd, ids, c.hc, c.n_embd)
        ple_parts = seqs.split(ple)
        for layer in self.layers:
            X = layer.forward_layer(X, ple_parts, seqs)
        hidden = hc_mix(X, self.head, "output_hc", c.hc, c.rms_eps, inject=False)
        logits = self.output.linear(last_rows(hidden, last), name="output_lm_head")
        outs = {"logits": logits, "hidden": hidden, "streams": op.reshape(X, (n, c.hc * c.n_embd))}
        return (*(outs[k] for k in self.OUTPUTS), *seqs.outputs())

    def prefill(self, ids: nn.Tensor, ple: nn.Tensor, start, states):
        return self._forward(ids, ple, start, states, last_only=True)

    def prefill_all(self, ids: nn.Tensor, ple: nn.Tensor, start, states):
        return self._forward(ids, ple, start, states, last_only=False)

    def decode(self, ids: nn.Tensor, ple: nn.Tensor, start, states):
        return self._forward(ids, ple, start, states, last_only=False)

    def verify(self, ids: nn.Tensor, ple: nn.Tensor, start, states):
        return self._forward(ids, ple, start, states, last_only=False)

    def decode_batch(self, ids: nn.Tensor, ple: nn.Tensor, starts, states):
        """One token of each of len(starts) sequences (nn/functions.TargetFunctions.decode_batch)."""
        return self._rows(ids, ple, Sequences(self.state_names, list(zip(starts, states))), None)

    def prefill_batch(self, ids: nn.Tensor, ple: nn.Tensor, starts, states):
        """A prompt's chunk and one token of each other sequence (TargetFunctions.prefill_batch)."""
        return self._rows(ids, ple, Sequences(self.state_names, list(zip(starts, states)), chunked=True), len(starts))

    def verify_batch(self, ids: nn.Tensor, ple: nn.Tensor, starts, counts, offsets, states):
        """A block of rows of each sequence (TargetFunctions.verify_batch)."""
        seqs = Sequences(self.state_names, list(zip(starts, states)), counts=counts, offsets=offsets)
        return self._rows(ids, ple, seqs, None)

    def state_specs(self) -> list[StateSpec]:
        return state_specs(self.cfg, self.bounds)

    def functions(self) -> list[Fn]:
        width = max(self.cfg.n_embd, 1)
        return target_functions(lambda rows: (tokens(rows, "ids"), Arg("ple", "host", (rows, width)), START),
                                self.OUTPUTS, self.bounds.max_batch)
