"""Legacy one-stage MTP beside its DeepSeek-V4 target (ds4-spec §7), one artifact.

For a token t at position p and the target's final HC streams H of position p - 1 (the streams
whose output head chose t):
  X = broadcast(e_proj · (RMSNorm(embed(t)) · enorm)) + h_proj · (RMSNorm(H_s) · hnorm) per stream s;
  X' = one V4 block (ratio 0: sliding window over its own ring of K=V rows, RoPE as the target's
       uncompressed layers, MoE with the selection bias) applied to X at position p;
  draft = argmax of the target's output head over RMSNorm(hc_head(X')) · norm.
Drafting continues from X' and the draft (the HC buffers ping-pong). The ring holds one row per
position: rows of committed positions are written from the target's own streams (`mtp_observe`:
only the K=V projection, no attention or MoE), so the ring is a function of the committed text;
rows written while drafting lie past the committed length and are rewritten when their position
is committed.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import StateSpec
from ...nn.functions import START, Arg, Fn, Sequences, batched_copies, tokens
from ...nn.norm_rope import rms, rope_inv_freq
from ...nn.state import ring_write
from ...nn.qweight import Weights
from ..deepseek4.model import Block
from .config import Config
from .tensors import tensor_specs


class MTPBlock(nn.Module):
    def __init__(self, cfg: Config, types: dict, kv_rounding: bool):
        self.cfg, self.kv_rounding = cfg, kv_rounding
        b = cfg.block
        specs = {s.name: s for s in tensor_specs(cfg)}
        self.block = Block(b, 0, specs, types, prefix="mtp.0.")
        top = Weights(self, specs, types, "mtp.0.")
        self.e_proj, self.h_proj = top("e_proj.weight"), top("h_proj.weight")
        self.enorm, self.hnorm, self.norm = top("enorm.weight"), top("hnorm.weight"), top("norm.weight")
        self.hc_head_fn, self.hc_head_base = top("hc_head_fn.weight"), top("hc_head_base.weight")
        self.hc_head_scale = top("hc_head_scale.weight")
        self.rope = rope_inv_freq(b.n_rot, b.rope_base, None)   # as the target's uncompressed layers

    def inputs(self, hc_prev: nn.Tensor, embedded: nn.Tensor) -> nn.Tensor:
        """X [n, hc, D] from the previous streams [n, hc, D] and the token rows [n, D]."""
        b = self.cfg.block
        n, hc, D = hc_prev.shape
        e = self.e_proj.linear(rms(embedded, b.rms_eps, self.enorm.values(name="mtp_enorm")), name="mtp_e_proj")
        h = rms(op.reshape(hc_prev, (n * hc, D)), b.rms_eps, self.hnorm.values(name="mtp_hnorm"))
        h = op.reshape(self.h_proj.linear(h, name="mtp_h_proj"), (n, hc, D))
        return op.reshape(e, (n, 1, D)) + h

    def observe(self, X: nn.Tensor, start, ring: nn.Tensor) -> nn.Tensor:
        N, _, _ = self.block.attn_input(X)
        return ring_write(ring, self.block.kv_rows(N, start, self.rope, self.kv_rounding), start, name="mtp_ring_write")

    def step(self, X: nn.Tensor, seqs: Sequences) -> nn.Tensor:
        """The block over the rows of seqs: attention per sequence on its ring (updated in seqs), the
        MoE on every row at once."""
        X = self.block.attention_rows(X, seqs, "", self.rope, None, self.kv_rounding)
        return self.block.moe(X, None)


def ring_shape(cfg: Config, max_verify: int) -> tuple[int, int]:
    return (cfg.block.sliding_window + max_verify, cfg.block.head_dim)


def extend(target_cls):
    """The target class with `hc_state` outputs and the MTP functions; the ring is state group "mtp"."""

    class TargetWithMTP(target_cls):
        def __init__(self, cfg, types: dict, bounds, kv_rounding: bool, draft_cfg: Config, draft_types: dict):
            super().__init__(cfg, types, bounds, kv_rounding=kv_rounding, hc_state=True)
            self.draft_cfg = draft_cfg
            self.drafter = MTPBlock(draft_cfg, draft_types, kv_rounding)

        def mtp_observe(self, hc_prev, tokens, start, rings):
            """Ring rows of committed positions start..: token i with the target's streams before it."""
            X = self.drafter.inputs(hc_prev, self.token_embd.rows(tokens, name="mtp_embedding"))
            return (self.drafter.observe(X, start, rings[0]),)

        def mtp_step(self, hc_prev, tokens, start, rings):
            """One draft after tokens[0] at position start: the target's logits of it and X'."""
            return self.mtp_step_batch(hc_prev, tokens, [start], [rings])

        def mtp_step_batch(self, hc_prev, tokens, starts, rings):
            """mtp_step of one token of each of len(starts) sequences (row i: sequence i's, at
            starts[i], with rings[i]): every row's logits and X', then every sequence's ring."""
            seqs = Sequences(["kv_ring"], [(start, list(r)) for start, r in zip(starts, rings)])
            embedded = self.token_embd.rows(tokens, name="mtp_embedding")
            X = self.drafter.step(self.drafter.inputs(hc_prev, embedded), seqs)
            d = self.drafter
            logits = self.logits_of(X, d.hc_head_fn, d.hc_head_scale, d.hc_head_base, d.norm, "mtp")
            return (logits, X, *seqs.outputs())

        def state_specs(self):
            shape = ring_shape(self.draft_cfg, self.bounds.max_verify)
            rewind = shape[0] - (self.draft_cfg.block.sliding_window - 1)
            return super().state_specs() + [StateSpec("mtp.0.kv_ring", shape, group="mtp", ring=shape[0],
                                                      rewind=rewind)]

        def functions(self):
            b = self.draft_cfg.block

            def args(n):
                return Arg("hc_prev", "float32", (n, b.hc, b.n_embd)), tokens(n), START

            step = Fn("mtp_step", args(1), ("logits", "hc_state"), "mtp", state_arg="rings")
            return super().functions() + [Fn("mtp_observe", args("n"), (), "mtp", per_width=True, state_arg="rings"),
                                          step, *batched_copies(step, args, self.bounds.max_batch, "mtp_step_batch")]

        def drafter_settings(self) -> dict:
            return {"mtp": {"window": self.draft_cfg.block.sliding_window}}

    return TargetWithMTP
