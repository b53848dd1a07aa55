"""Qwen3.8's MTP (nextn) layer beside its target, one artifact (ds4-spec §5: the layer is
`blk.{n_layers}` of the main GGUF, a gated-attention + MoE layer under its own HC mixers).

For the token t at position p and the target's hc residual streams R of position p - 1 (what the
output head mixed to choose t; zeros at position 0):
  X_s = eh_proj [enorm * RMSNorm(embed(t)); hnorm_s * RMSNorm(R_s)]   for every stream s;
  X  += inject * attention(hc_attn mix of X)   (its own K/V, raw index keys and pooled QSA blocks);
  X  += inject * MoE(hc_ffn mix of X);
  draft = argmax of the target's `output` over the nextn.hc_head mix of X (no inject).
A chained draft (depth 3) feeds X back as the R of the next position. `mtp_observe` only writes
the attention rows of committed positions (no attention output, no MoE, no head), so the layer's
state is a function of the committed text; `mtp_step` runs n rows (committed rows not yet
written, then the token drafted after: one pass) and the MoE and head of the last only.
"""

from __future__ import annotations

from dataclasses import replace

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import StateSpec
from ...nn.functions import START, Arg, Fn, last_rows, tokens
from ...nn.norm_rope import rms
from .model import Layer, Qwen4Exp, _inject, _per_stream, hc_mix, layer_states, layer_weights
from .tensors import nextn_specs

GROUP = "mtp"


class NextN(nn.Module):
    def __init__(self, cfg, types: dict):
        self.cfg = cfg
        self.layer = Layer(cfg, cfg.n_layers, types)
        self.w = layer_weights(self, cfg.n_layers, nextn_specs(cfg), types)

    def inputs(self, streams_prev: nn.Tensor, embedded: nn.Tensor) -> nn.Tensor:
        """X [n, hc, E] from R [n, hc * E] and the embeddings [n, E]."""
        c = self.cfg
        n, hc, E = embedded.shape[0], c.hc, c.n_embd
        e = rms(embedded, c.rms_eps, self.w["nextn.enorm.weight"].values(name="nextn_enorm"))
        h = _per_stream(streams_prev, hc, E, c.rms_eps, self.w["nextn.hnorm.weight"].values(name="nextn_hnorm"))
        pairs = op.concat([op.broadcast_to(op.reshape(e, (n, 1, E)), (n, hc, E)), h], dim=2)
        x = self.w["nextn.eh_proj.weight"].linear(op.reshape(pairs, (n * hc, 2 * E)), name="nextn_eh_proj")
        return op.reshape(x, (n, hc, E))

    def observe(self, X: nn.Tensor, start, states: dict) -> dict:
        L = self.layer
        mixed, _ = hc_mix(X, L.w, "hc_attn", self.cfg.hc, self.cfg.rms_eps)
        return L.attention_writes(mixed, start, states)

    def step(self, X: nn.Tensor, start, states: dict):
        """The head's input and X of the last row, and the new states."""
        c, L = self.cfg, self.layer
        mixed, weights = hc_mix(X, L.w, "hc_attn", c.hc, c.rms_eps)
        out, new = L.attention(mixed, start, states)
        X = _inject(X, weights, out)
        X = op.reshape(last_rows(op.reshape(X, (X.shape[0], c.hc * c.n_embd)), 1, name="nextn_last_row"),
                       (1, c.hc, c.n_embd))
        mixed, weights = hc_mix(X, L.w, "hc_ffn", c.hc, c.rms_eps)
        X = _inject(X, weights, L.moe(mixed))
        return hc_mix(X, self.w, "nextn.hc_head", c.hc, c.rms_eps, inject=False), X, new


def mtp_states(cfg, bounds) -> list[StateSpec]:
    return [replace(s, group=GROUP) for s in layer_states(cfg, bounds, cfg.n_layers)]


class Qwen4ExpWithMTP(Qwen4Exp):
    """The target, returning its streams too, with `mtp_observe` and `mtp_step` over the nextn
    layer's state (group "mtp")."""

    OUTPUTS = ("logits", "hidden", "streams")

    def __init__(self, cfg, types: dict, bounds):
        super().__init__(cfg, types, bounds)
        self.nextn = NextN(cfg, types)
        prefix = f"blk.{cfg.n_layers}."
        self.mtp_state_keys = [s.name[len(prefix):] for s in mtp_states(cfg, bounds)]

    def _inputs(self, streams_prev, tokens):
        return self.nextn.inputs(streams_prev, self.token_embd.rows(tokens, name="mtp_embedding"))

    def mtp_observe(self, streams_prev, tokens, start, states):
        """Rows of committed positions start..: token i with the target's streams before it."""
        named = dict(zip(self.mtp_state_keys, states))
        new = self.nextn.observe(self._inputs(streams_prev, tokens), start, named)
        return tuple(new[k] for k in self.mtp_state_keys)

    def mtp_step(self, streams_prev, tokens, start, states):
        """Rows start.. as mtp_observe writes them; the target's logits of the token after the last
        (the draft) and that row's X (the streams a chained step reads)."""
        c = self.cfg
        named = dict(zip(self.mtp_state_keys, states))
        head_in, X, new = self.nextn.step(self._inputs(streams_prev, tokens), start, named)
        logits = self.output.linear(head_in, name="mtp_lm_head")
        streams = op.reshape(X, (1, c.hc * c.n_embd))
        return logits, streams, tuple({**named, **new}[k] for k in self.mtp_state_keys)

    def state_specs(self) -> list[StateSpec]:
        return super().state_specs() + mtp_states(self.cfg, self.bounds)

    def functions(self) -> list[Fn]:
        inputs = (Arg("streams_prev", "float32", ("n", self.cfg.hc * self.cfg.n_embd)), tokens("n"), START)
        return super().functions() + [Fn("mtp_observe", inputs, (), GROUP, per_width=True),
                                      Fn("mtp_step", inputs, ("logits", "streams"), GROUP)]

    def drafter_settings(self) -> dict:
        return {"qwen_mtp": {"layer": self.cfg.n_layers}}
