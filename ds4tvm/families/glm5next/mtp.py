"""GLM-5.3's MTP (nextn) layer beside its target, one artifact (ds4-spec §4 and its Errata; the layer
is the last of the main GGUF, `blk.{n_layers}`).

For the token t at position p and the target's row before it, h (position p - 1), with no
hyper-connections:
  x  = eh_proj [enorm * RMSNorm(embed(t)); hnorm * RMSNorm(h)];
where h is what the file's eh_proj width says (config.mtp_input_of): the output head's input there
(post output_norm, what chose t; llama.cpp's t_h_nextn), or the trunk's hc streams before they
collapse (ds4-spec §4, HC-shaped), each stream normed on its own, as DeepSeek-V4's and Qwen3.8's MTP
layers norm theirs, and hnorm's weight [hc * D] over them all;
  x += DSA(attn_norm * RMSNorm(x))   (its own latent rows and pooled indexer, at the target's positions);
  x += FFN(ffn_norm * RMSNorm(x))    (the sigmoid-router MoE with its shared expert);
  draft = argmax of the target's `output` over shared_head_norm * RMSNorm(x) (output_norm when a
          llama.cpp file has no shared_head_norm).
Position 0 pairs its token with a zero hidden state (nothing precedes it). Rows of committed
positions are written from (token, the target's hidden before it) by `mtp_observe`, which only
projects and stores (no attention, no FFN), so the layer's state is a function of the committed
text; `mtp_step` writes the row of the token it drafts after, which is that token's committed row
once the token is committed.
"""

from __future__ import annotations

from dataclasses import replace

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import StateSpec
from ...nn.functions import START, Arg, Fn, Sequences, batched_copies, tokens
from ...nn.norm_rope import rms
from .config import STREAMS
from .model import GLM5Next, Layer, layer_states

GROUP = "mtp"


class NextN(nn.Module):
    def __init__(self, cfg, types: dict):
        self.cfg = cfg
        self.layer = Layer(cfg, cfg.n_layers, types)

    def inputs(self, hidden_prev: nn.Tensor, embedded: nn.Tensor) -> nn.Tensor:
        L, c = self.layer, self.cfg
        e = rms(embedded, c.rms_eps, L.v("nextn.enorm"))
        if c.mtp_input == STREAMS:
            n = hidden_prev.shape[0]
            streams = rms(op.reshape(hidden_prev, (n, c.hc, c.n_embd)), c.rms_eps)
            h = op.reshape(streams, (n, c.hc * c.n_embd)) * L.v("nextn.hnorm")
        else:
            h = rms(hidden_prev, c.rms_eps, L.v("nextn.hnorm"))
        return L.w["nextn.eh_proj.weight"].linear(op.concat([e, h], dim=1), name="nextn_eh_proj")

    def observe(self, x: nn.Tensor, start, states: dict) -> dict:
        L = self.layer
        return L.dsa_writes(rms(x, self.cfg.rms_eps, L.v("attn_norm")), start, states)

    def step(self, x: nn.Tensor, seqs: Sequences) -> nn.Tensor:
        """The layer over the rows of seqs: attention per sequence on its states (updated in seqs),
        the FFN on every row at once."""
        L, eps = self.layer, self.cfg.rms_eps

        def attend(_, rows, start, states):
            out, new, _ = L.dsa(rms(rows, eps, L.v("attn_norm")), start, states, None)
            return rows + out, new

        x = seqs.per_sequence(x, "", attend)
        return x + L.ffn_out(rms(x, eps, L.v("ffn_norm")))


def mtp_states(cfg, bounds) -> list[StateSpec]:
    return [replace(s, group=GROUP) for s in layer_states(cfg, bounds, cfg.n_layers)]


class GLM5NextWithMTP(GLM5Next):
    """The target with `mtp_observe` and `mtp_step` over the nextn layer's state (group "mtp")."""

    def __init__(self, cfg, types: dict, bounds):
        super().__init__(cfg, types, bounds)
        self.nextn = NextN(cfg, types)
        self.outputs = GLM5Next.outputs + ((STREAMS,) if cfg.mtp_input == STREAMS else ())
        prefix = f"blk.{cfg.n_layers}."
        self.mtp_state_keys = [s.name[len(prefix):] for s in mtp_states(cfg, bounds)]

    def _embedded_inputs(self, hidden_prev, tokens):
        return self.nextn.inputs(hidden_prev, self.token_embd.rows(tokens, name="mtp_embedding"))

    def mtp_observe(self, hidden_prev, tokens, start, states):
        """Rows of committed positions start..: token i with the target's hidden before it."""
        named = dict(zip(self.mtp_state_keys, states))
        new = self.nextn.observe(self._embedded_inputs(hidden_prev, tokens), start, named)
        return tuple(new[k] for k in self.mtp_state_keys)

    def mtp_step(self, hidden_prev, tokens, start, states):
        """The target's logits of the token after tokens[0] (at position start)."""
        return self.mtp_step_batch(hidden_prev, tokens, [start], [states])

    def mtp_step_batch(self, hidden_prev, tokens, starts, states):
        """mtp_step of one token of each of len(starts) sequences (row i: sequence i's, at
        starts[i], in states[i]): every row's logits, then every sequence's states."""
        seqs = Sequences(self.mtp_state_keys, list(zip(starts, states)))
        x = self.nextn.step(self._embedded_inputs(hidden_prev, tokens), seqs)
        L = self.nextn.layer
        norm = L.v("nextn.shared_head_norm") if "nextn.shared_head_norm.weight" in L.w else \
            self.output_norm.values(name="mtp_head_norm")
        return (self.output.linear(rms(x, self.cfg.rms_eps, norm), name="mtp_lm_head"), *seqs.outputs())

    def state_specs(self) -> list[StateSpec]:
        return super().state_specs() + mtp_states(self.cfg, self.bounds)

    def functions(self) -> list[Fn]:
        def args(n):
            return Arg("hidden_prev", "float32", (n, self.cfg.mtp_input_width)), tokens(n), START

        step = Fn("mtp_step", args(1), ("logits",), GROUP)
        return super().functions() + [Fn("mtp_observe", args("n"), (), GROUP, per_width=True), step,
                                      *batched_copies(step, args, self.bounds.max_batch, "mtp_step_batch")]

    def drafter_settings(self) -> dict:
        return {"glm_mtp": {"layer": self.cfg.n_layers, "reads": self.cfg.mtp_input}}
