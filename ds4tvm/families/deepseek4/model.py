"""DeepSeek-V4-Flash as a TVM Relax module (ds4-spec §2), weights read from GGUF planes.

State is explicit and append-only by position (DESIGN.md): per layer a raw ring of the last
window + max_verify K=V rows; for compressed layers the compressor's recent projections (ring of
2*ratio + max_verify) and the table of compressed rows; for ratio-4 layers the same for the
indexer. A call writes the rows of its positions; rows past the committed length are dead until
rewritten, so commit and rollback are counter changes in the runtime.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import Bounds, StateSpec
from ...nn.attention import indexer_select, sparse_window_attention
from ...nn.hyper import embedded_streams, hc_head, hc_post, hc_pre
from ...nn.norm_rope import periodic_rows, rms, rms_rope, rope, rope_hadamard_fp4, rope_inv_freq
from ...nn.moe import choose_experts, dense_ffn, routed_experts, table_experts
from ...nn.functions import START, Fn, Sequences, TargetFunctions, last_rows, target_functions, tokens
from ...nn.qweight import Weights
from ...nn.state import RingRows, compacts, compressor_writes, context_rows
from .compressor import pooled_window
from .config import Config
from .tensors import tensor_specs


def _floored_total(total):
    """What the chosen experts' weights are divided by: their sum, at least 6.1e-5. One function for
    every layer, so that the GPU routing kernels it is part of (kernels/gpu.top_k and table_experts,
    cached by their arguments) are written once, not once per layer."""
    return tirx.max(total, tirx.const(6.1e-5, "float32"))


def state_specs(cfg: Config, b: Bounds) -> list[StateSpec]:
    """Every float32 state tensor, in argument order: rings of rows indexed by position modulo
    their length, and the compressed-row tables (row number = position // ratio)."""
    out = []
    for il in range(cfg.n_layers):
        r, p = cfg.ratio(il), f"blk.{il}."
        window = cfg.sliding_window + b.max_verify
        # each ring can be rewound by its length minus the rows read before a new one
        out.append(StateSpec(p + "kv_ring", (window, cfg.head_dim), ring=window,
                             rewind=window - (cfg.sliding_window - 1)))
        if r:
            lanes = 2 if r == 4 else 1
            front = 2 * r + b.max_verify
            out += [StateSpec(p + "comp_kv_front", (front, lanes * cfg.head_dim), ring=front, rewind=front - 2 * r),
                    StateSpec(p + "comp_score_front", (front, lanes * cfg.head_dim), ring=front, rewind=front - 2 * r),
                    StateSpec(p + "comp_rows", (b.max_context // r, cfg.head_dim), stride=r)]
            if r == 4:
                out += [StateSpec(p + "idx_kv_front", (front, 2 * cfg.idx_head_dim), ring=front, rewind=front - 2 * r),
                        StateSpec(p + "idx_score_front", (front, 2 * cfg.idx_head_dim), ring=front,
                                  rewind=front - 2 * r),
                        StateSpec(p + "idx_rows", (b.max_context // r, cfg.idx_head_dim), stride=r)]
    return out


class Block(nn.Module):
    def __init__(self, cfg: Config, il: int, specs: dict, types: dict, prefix: str | None = None):
        self.cfg, self.il, self.ratio = cfg, il, cfg.ratio(il)
        prefix = prefix or f"blk.{il}."
        W = Weights(self, specs, types, prefix)
        names = [s[len(prefix):] for s in specs if s.startswith(prefix)]
        self.w = {}
        for short in names:
            if short == "ffn_gate_tid2eid.weight":
                self.tid2eid = nn.Parameter((cfg.n_vocab, cfg.n_expert_used), "int32")
                self.raw_tensors = {prefix + short: self.tid2eid}
            else:
                self.w[short] = W(short)
        for short in self.w:
            if short.endswith("_ape.weight"):   # read whole, as values: converted at load, not every step
                self.w[short].read_as_float32()
        self.has_bias = "exp_probs_b.bias" in self.w

    def v(self, short: str) -> nn.Tensor:
        return self.w[short + ".weight"].values(name=short.replace(".", "_"))

    def attn_input(self, X):
        """HC pre of the attention sublayer and attn_norm: (N, post, comb)."""
        c, w = self.cfg, self.w
        return hc_pre(X, w["hc_attn_fn.weight"], self.v("hc_attn_scale"), self.v("hc_attn_base"),
                      c.hc, c.rms_eps, c.hc_eps, c.hc_sinkhorn_iters, norm=self.v("attn_norm"), forms=self.forms)

    def kv_rows(self, N, start, freq, kv_rounding: bool):
        """The K=V row of each token: attn_kv, then kv_rows_of."""
        return self.kv_rows_of(self.w["attn_kv.weight"].linear(N), start, freq, kv_rounding)

    def kv_rows_of(self, kv, start, freq, kv_rounding: bool):
        """K=V rows from attn_kv's projections: kv_a_norm, RoPE at each one's position, FP8 rounding
        (the cache keeps FP8 values: the token attends to its rounded row too)."""
        return rms_rope(kv, self.cfg.rms_eps, self.v("attn_kv_a_norm"), start, freq, fp8=kv_rounding, forms=self.forms)

    def attention(self, X, start, states, rope_main, rope_comp, kv_rounding: bool):
        """The attention sublayer of one sequence: (X', its states, written)."""
        seqs = Sequences(list(states), [(start, list(states.values()))])
        return self.attention_rows(X, seqs, "", rope_main, rope_comp, kv_rounding), seqs.states[0]

    def attention_rows(self, X, seqs: Sequences, prefix: str, rope_main, rope_comp, kv_rounding: bool):
        """The attention sublayer over the rows of seqs: the projections on every row at once (one
        read of the weights for all sequences), RoPE, the compressor, the indexer and attention
        per sequence, on its states under prefix."""
        c, r, w = self.cfg, self.ratio, self.w
        n = X.shape[0]
        H, Dh = c.n_head, c.head_dim
        N, post, comb = self.attn_input(X)
        QR = rms(w["attn_q_a.weight"].linear(N), c.rms_eps, self.v("attn_q_a_norm"))
        projected = [op.reshape(w["attn_q_b.weight"].linear(QR), (n, H, Dh)), w["attn_kv.weight"].linear(N)]
        if r:
            projected += self._compressor_inputs(N, "attn_compressor")
            if r == 4:
                projected += self._compressor_inputs(N, "indexer_compressor") + [
                    op.reshape(w["indexer.attn_q_b.weight"].linear(QR), (n, c.idx_n_head, c.idx_head_dim)),
                    w["indexer.proj.weight"].linear(N) * (1.0 / math.sqrt(c.idx_head_dim * c.idx_n_head))]
        attn = seqs.per_sequence(projected, prefix, lambda _, parts, start, states: self._attend(
            parts, start, states, rope_main, rope_comp, kv_rounding))
        groups = c.o_groups
        low = w["attn_output_a.weight"].grouped_linear(op.reshape(attn, (n, groups, H // groups * Dh)), groups)
        out = w["attn_output_b.weight"].linear(op.reshape(low, (n, groups * c.o_lora_rank)))
        return hc_post(out, X, post, comb, forms=self.forms)

    def _attend(self, parts: list, start, states: dict, rope_main, rope_comp, kv_rounding: bool):
        """One sequence's attention from its rows' projections (attention_rows' order): (output,
        new states)."""
        c, r = self.cfg, self.ratio
        q, kv = parts[:2]
        freq = rope_comp if r else rope_main
        Q = rms_rope(q, c.rms_eps, None, start, freq, forms=self.forms)
        KV = self.kv_rows_of(kv, start, freq, kv_rounding)
        ring = states["kv_ring"]
        ctx = context_rows(ring, KV, start, c.sliding_window - 1, name="kv_context", forms=self.forms)
        new_states = {}
        comp_rows = sel = None
        if r:
            comp_rows, new_states = self._compress(parts[2:4], start, states, "attn_compressor", "comp", c.head_dim,
                                                   rope_comp, fp8=kv_rounding)
            if r == 4:
                idx_rows, idx_states = self._compress(parts[4:6], start, states, "indexer_compressor", "idx",
                                                      c.idx_head_dim, rope_comp, fp4=kv_rounding)
                new_states.update(idx_states)
                iq, iw = parts[6:8]
                iq = rope_hadamard_fp4(iq, start, rope_comp, forms=self.forms) if kv_rounding \
                    else rope(iq, start, rope_comp, forms=self.forms)
                sel = indexer_select(iq, iw, idx_rows, start, r, c.idx_top_k, name="indexer", forms=self.forms)
        attn, new_states["kv_ring"] = sparse_window_attention(
            Q, ctx, comp_rows, sel, self.v("attn_sinks"), start, c.sliding_window, max(r, 1), name="attention",
            rope_back=freq, write_ring=(ring, KV), forms=self.forms)
        return attn, new_states

    def _compressor_inputs(self, N, wname: str) -> list:
        """A compressor's projections of every row: [kv, score logits]."""
        return [self.w[f"{wname}_kv.weight"].linear(N), self.w[f"{wname}_gate.weight"].linear(N)]

    def _compress(self, projected: list, start, states, wname, sname, width, rope_comp, fp8=False, fp4=False):
        """From one sequence's projections (_compressor_inputs): the pooled row of every window that
        ends among its tokens (normalised, RoPE'd at the window start, rounded as FP8 or FP4 values
        when asked), written into the row table; a call of several tokens pools only those windows
        (nn/state.compacts)."""
        c, r = self.cfg, self.ratio
        kv, score = projected
        score = score + periodic_rows(self.v(f"{wname}_ape"), start, kv, r, "ape", forms=self.forms)
        kv_front, sc_front = states[f"{sname}_kv_front"], states[f"{sname}_score_front"]
        # the pool reads the rings in place, every form: a decode pools only where a window ends, and a
        # gather on the CPU copied 2 * ratio rows every step
        kv_ctx, sc_ctx = RingRows(kv_front, kv, 2 * r), RingRows(sc_front, score, 2 * r)
        compact = compacts(kv)
        pooled = pooled_window(kv_ctx, sc_ctx, start, r, width, compact, name=f"{sname}_pool", forms=self.forms)
        # RoPE'd at the window's first position
        cand = rms_rope(pooled, c.rms_eps, self.v(f"{wname}_norm"), start, rope_comp, fp8=fp8, fp4=fp4,
                        **(dict(stride=r) if compact else dict(offset=1 - r)), forms=self.forms)
        rows, kv_front, sc_front = compressor_writes(states[f"{sname}_rows"], cand, (kv_front, sc_front), (kv, score),
                                                     start, r, compact,
                                                     (f"{sname}_emit", f"{sname}_kv_write", f"{sname}_score_write"), forms=self.forms)
        return rows, {f"{sname}_rows": rows, f"{sname}_kv_front": kv_front, f"{sname}_score_front": sc_front}

    def moe(self, X, ids):
        c, w = self.cfg, self.w
        h, post, comb = hc_pre(X, w["hc_ffn_fn.weight"], self.v("hc_ffn_scale"), self.v("hc_ffn_base"),
                               c.hc, c.rms_eps, c.hc_eps, c.hc_sinkhorn_iters, norm=self.v("ffn_norm"), forms=self.forms)
        p = op.sqrt(op.softplus(w["ffn_gate_inp.weight"].linear(h)))
        denominator = _floored_total if c.expert_weights_norm else None
        if self.il < c.n_hash_layers:
            experts, ps = table_experts(self.tid2eid, ids, p, denominator, c.expert_weights_scale, forms=self.forms)
        else:
            bias = w["exp_probs_b.bias"].values(name="probs_bias") if self.has_bias else None
            experts, ps = choose_experts(p, c.n_expert_used, bias, denominator, c.expert_weights_scale, forms=self.forms)
        limit = c.swiglu_clamp[self.il]
        y = routed_experts(w, h, experts, ps, limit, forms=self.forms) + dense_ffn(w, h, limit, "_shexp")
        return hc_post(y, X, post, comb, forms=self.forms)


class DeepSeekV4(TargetFunctions, nn.Module):
    """The target. Every call returns the logits, then the extra outputs a paired drafter reads:
    `hidden` [rows of logits, D] (the output head's input: ONNX draft heads read it),
    `captured` [n, L, D] (the mean of the HC streams after capture_layers: DSpark's input) and
    `hc_state` [n, hc, D] (the final HC streams before the output head: legacy MTP's input)."""


    def __init__(self, cfg: Config, types: dict, bounds: Bounds = Bounds(), kv_rounding: bool = False,
                 capture_layers: tuple[int, ...] = (), hc_state: bool = False):
        self.cfg, self.bounds, self.kv_rounding = cfg, bounds, kv_rounding
        self.capture_layers, self.hc_state = tuple(capture_layers), hc_state
        specs = {s.name: s for s in tensor_specs(cfg)}
        top = Weights(self, specs, types, "")
        self.token_embd = top("token_embd.weight")
        self.output = top("output.weight")
        self.output_norm = top("output_norm.weight")
        self.output_hc_fn = top("output_hc_fn.weight")
        self.output_hc_base = top("output_hc_base.weight")
        self.output_hc_scale = top("output_hc_scale.weight")
        self.layers = nn.ModuleList([Block(cfg, il, specs, types) for il in range(cfg.n_layers)])
        self.rope_main = rope_inv_freq(cfg.n_rot, cfg.rope_base, None)
        self.rope_comp = rope_inv_freq(cfg.n_rot, cfg.compress_rope_base,
                                       (cfg.yarn_factor, cfg.yarn_orig_ctx, cfg.yarn_beta_fast, cfg.yarn_beta_slow))
        self.state_names = [s.name for s in state_specs(cfg, bounds)]

    def extra_outputs(self) -> tuple[str, ...]:
        return ("hidden",) + (("captured",) if self.capture_layers else ()) + (("hc_state",) if self.hc_state else ())

    def hidden_of(self, X, head_fn, head_scale, head_base, norm, name: str):
        """HC head (streams -> one row) and RMSNorm: what the output head reads."""
        c = self.cfg
        return hc_head(X, head_fn, head_scale.values(name=f"{name}_hc_scale"),
                       head_base.values(name=f"{name}_hc_base"), c.rms_eps, c.hc_eps, norm.values(name=f"{name}_norm"), forms=self.forms)

    def logits_of(self, X, head_fn, head_scale, head_base, norm, name: str):
        """The target's output head over hidden_of."""
        return self.output.linear(self.hidden_of(X, head_fn, head_scale, head_base, norm, name), name=f"{name}_lm_head")

    def _rows(self, ids, seqs: Sequences, last: int | None):
        c = self.cfg
        n = ids.shape[0]
        X = embedded_streams(self.token_embd, ids, c.hc, c.n_embd)
        captured = []
        for il, layer in enumerate(self.layers):
            X = layer.attention_rows(X, seqs, f"blk.{il}.", self.rope_main, self.rope_comp, self.kv_rounding)
            X = layer.moe(X, ids)
            if il in self.capture_layers:
                captured.append(op.reshape(op.sum(X, axis=1) * (1.0 / c.hc), (n, 1, c.n_embd)))
        extras = ([op.concat(captured, dim=1)] if captured else []) + ([X] if self.hc_state else [])
        X = last_rows(X, last)
        hidden = self.hidden_of(X, self.output_hc_fn, self.output_hc_scale, self.output_hc_base, self.output_norm,
                                "output")
        logits = self.output.linear(hidden, name="output_lm_head")
        return (logits, hidden, *extras, *seqs.outputs())

    def state_specs(self) -> list[StateSpec]:
        return state_specs(self.cfg, self.bounds)

    def functions(self) -> list[Fn]:
        return target_functions(lambda rows: (tokens(rows, "ids"), START), ("logits", *self.extra_outputs()),
                                self.bounds.max_batch)

    def drafter_settings(self) -> dict:
        return {}
