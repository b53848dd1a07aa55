"""The DSpark drafter as a TVM module beside its DeepSeek-V4 target (ds4 behaviour,
dspark-crosscheck.md §2).

- main_x = RMSNorm(main_proj · concat(captured target layers)) · main_norm, one row per position;
- one ring per stage of context rows K=V for committed positions: rows from prefill and accepted
  verifies take the stage's HC-pre + attn_norm path, rows of plain decode steps (scheduler skips)
  the direct attn_kv path; both end with kv_a_norm, RoPE (base 1e4, no YaRN) and FP8;
- a proposal after anchor t at P: rows [main_x(P), embed(t), embed(noise) x (B-1)] at positions
  [P, P, P+1, ...]; each stage is a V4 block whose queries are the token rows, attending without a
  causal mask over the 127 ring rows before P and every block row, with sinks; row 0 is rebuilt
  from main_x in every stage; then hc_head and norm give r_i, and the target's output head the
  base logits;
- `dspark_propose` runs the whole proposal in one call: the block, the LM head, then per row the
  Markov head (w1 row of the previous token, rank -> vocab bias through w2, argmax with ties to the
  lower id) and the confidence c_i = conf . [r_i; m_i]. It returns every row's draft and c_i; the
  runtime cuts at the first sigma(c_i) < theta. The chain is unrolled in the graph: one call per
  proposal, not one per draft (each host call costs about a small GEMV on the demo model).
  `dspark_propose_batch<B>` (`--max-batch`): the proposals of B sequences in one call, each on its
  own rings, the weights read once (the scheduler's generations: runtime/scheduler.py).
  `dspark_block`, `dspark_logits` and `dspark_markov` are its pieces, compiled for the checks
  against the PyTorch reference.
"""

from __future__ import annotations

from tvm import te, tirx, topi
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...artifact import StateSpec
from ...nn.functions import START, Arg, Fn, Sequences, batched_copies, tokens
from ...nn.attention import attend_with_sinks
from ...nn.hyper import hc_head, hc_post
from ...nn.norm_rope import rms, rope, rope_inv_freq
from ...nn.state import gather_context, ring_write
from ...nn.qweight import Weights
from ..deepseek4.model import Block
from .config import Config
from .tensors import tensor_specs

WINDOW = 128  # context rows: the 127 positions before the anchor, plus the anchor's own main row


def ring_shapes(cfg: Config) -> list[tuple[str, tuple[int, int]]]:
    return [(f"mtp.{s}.kv_ring", (WINDOW, cfg.block.head_dim)) for s in range(cfg.n_stages)]


def block_attention(q: nn.Tensor, keys: nn.Tensor, sinks: nn.Tensor, start, n_context: int, name: str):
    """q [B, H, D] over keys [n_context + R, D] (the first n_context are ring rows for positions
    start-n_context.., visible when >= 0; the rest are block rows, all visible: no causal mask)."""
    def f(q_te, k_te, sk, s):
        return attend_with_sinks(q_te, lambda t, a, d: k_te[a, d],
                                 lambda t, a: tirx.Or(a >= n_context, s - n_context + a >= 0),
                                 k_te.shape[0], sk, name)

    return op.tensor_expr_op(f, name, [q, keys, sinks, start])


def _rows(x: nn.Tensor, lo: int, hi: int, name: str) -> nn.Tensor:
    def f(t):
        return te.compute((hi - lo, *t.shape[1:]), lambda i, *rest: t[(i + lo, *rest)], name=name)
    return op.tensor_expr_op(f, name, [x])


def _token_rows(x: nn.Tensor, B: int, name: str) -> nn.Tensor:
    """The token rows of blocks of B + 1 rows (each sequence's row 0, then its B token rows)."""
    def f(t):
        S = int(t.shape[0]) // (B + 1)
        return te.compute((S * B, *t.shape[1:]), lambda r, *rest: t[(r // B * (B + 1) + 1 + r % B, *rest)], name=name)
    return op.tensor_expr_op(f, name, [x])


def _row_of_blocks(x: nn.Tensor, B: int, i: int, name: str) -> nn.Tensor:
    """Row i of every block of B rows of x: [S, ...]."""
    def f(t):
        return te.compute((int(t.shape[0]) // B, *t.shape[1:]), lambda j, *rest: t[(j * B + i, *rest)], name=name)
    return op.tensor_expr_op(f, name, [x])


def _argmax_sum(a: nn.Tensor, b: nn.Tensor, name: str) -> nn.Tensor:
    """argmax over the vocabulary of a + b ([1, V] each) as [1] int32, the first maximum on ties."""
    def f(x, y):
        s = te.compute(x.shape, lambda t, v: x[t, v] + y[t, v], name=f"{name}_sum")
        return topi.cast(topi.argmax(s, axis=1), "int32")
    return op.tensor_expr_op(f, name, [a, b])


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: Config, types: dict, kv_rounding: bool):
        self.cfg, self.kv_rounding = cfg, kv_rounding
        b = cfg.block
        specs = {s.name: s for s in tensor_specs(cfg)}
        self.stages = nn.ModuleList([Block(b, s, specs, types, prefix=f"mtp.{s}.") for s in range(cfg.n_stages)])
        last = f"mtp.{cfg.n_stages - 1}."
        top = Weights(self, specs, types, "")
        self.main_proj = top("mtp.0.main_proj.weight")
        self.main_norm = top("mtp.0.main_norm.weight")
        self.norm = top(last + "norm.weight")
        self.hc_head_fn = top(last + "hc_head_fn.weight")
        self.hc_head_base = top(last + "hc_head_base.weight")
        self.hc_head_scale = top(last + "hc_head_scale.weight")
        self.markov_w1 = top(last + "markov_head.markov_w1.weight")
        self.markov_w2 = top(last + "markov_head.markov_w2.weight")
        self.confidence_proj = top(last + "confidence_head.proj.weight")
        self.rope = rope_inv_freq(b.n_rot, 10000.0, None)  # drafter RoPE: plain base 1e4, no YaRN

    def main_x(self, captured: nn.Tensor) -> nn.Tensor:
        n, L, D = captured.shape
        b = self.cfg.block
        h = self.main_proj.linear(op.reshape(captured, (n, L * D)), name="main_proj")
        return rms(h, b.rms_eps, self.main_norm.values(name="main_norm"))

    def _kv(self, stage: Block, n_in: nn.Tensor, start) -> nn.Tensor:
        return stage.kv_rows(n_in, start, self.rope, self.kv_rounding)

    def observe(self, captured, start, rings, direct: bool):
        """Context rows for n committed positions start..: written into every stage's ring."""
        b = self.cfg.block
        mx = self.main_x(captured)
        n = captured.shape[0]
        out = []
        for stage, ring in zip(self.stages, rings):
            if direct:
                kv = self._kv(stage, mx, start)
            else:
                X = op.broadcast_to(op.reshape(mx, (n, 1, b.n_embd)), (n, b.hc, b.n_embd))
                kv = self._kv(stage, stage.attn_input(X)[0], start)
            out.append(ring_write(ring, kv, start, name="dspark_ring_write"))
        return tuple(out)

    def block(self, captured, tokens_embedded, seqs: Sequences):
        """r [S*B, D]: the B token rows of the proposal of each of the S sequences of seqs (sequence
        i's anchored at its start, on its rings), one block after another."""
        b, S = self.cfg.block, len(seqs)
        B, D = int(tokens_embedded.shape[0]) // S, b.n_embd
        mx = self.main_x(captured)                                        # [S, D]
        row0 = op.broadcast_to(op.reshape(mx, (S, 1, 1, D)), (S, 1, b.hc, D))
        T = op.broadcast_to(op.reshape(tokens_embedded, (S * B, 1, D)), (S * B, b.hc, D))
        H, Dh = b.n_head, b.head_dim
        for (ring, _), stage in zip(ring_shapes(self.cfg), self.stages):
            # each sequence's row 0, then its token rows
            X = op.reshape(op.concat([row0, op.reshape(T, (S, B, b.hc, D))], dim=1), (S * (B + 1), b.hc, D))
            N, post, comb = stage.attn_input(X)
            QR = rms(stage.w["attn_q_a.weight"].linear(_token_rows(N, B, "token_rows_q")), b.rms_eps,
                     stage.v("attn_q_a_norm"))
            Q = rms(op.reshape(stage.w["attn_q_b.weight"].linear(QR), (S * B, H, Dh)), b.rms_eps)
            attn = seqs.per_sequence([N, Q], "", lambda _, parts, start, states, ring=ring, stage=stage: (
                self._attend(stage, parts, start, states[ring]), {}))
            g = b.o_groups
            low = stage.w["attn_output_a.weight"].grouped_linear(op.reshape(attn, (S * B, g, H // g * Dh)), g)
            out = stage.w["attn_output_b.weight"].linear(op.reshape(low, (S * B, g * b.o_lora_rank)))
            T = hc_post(out, T, _token_rows(post, B, "post_t"), _token_rows(comb, B, "comb_t"), forms=self.forms)
            T = stage.moe(T, None)
        return hc_head(T, self.hc_head_fn, self.hc_head_scale.values(name="dspark_hc_scale"),
                       self.hc_head_base.values(name="dspark_hc_base"), b.rms_eps, b.hc_eps,
                       self.norm.values(name="dspark_norm"), forms=self.forms)

    def _attend(self, stage: Block, parts: list, start, ring: nn.Tensor) -> nn.Tensor:
        """One sequence's block attention: from its rows after attn_input, N [B + 1, D] (row 0, then
        the token rows), and its queries Q [B, H, Dh], over its ring."""
        N, Q = parts
        B = int(Q.shape[0])
        kv0 = self._kv(stage, _rows(N, 0, 1, "row0"), start)          # row 0 at P
        kvt = self._kv(stage, _rows(N, 1, B + 1, "token_rows"), start)  # token rows at P..P+B-1
        keys = gather_context(ring, op.concat([kv0, kvt], dim=0), start, WINDOW - 1, name="dspark_keys")
        Q = rope(Q, start, self.rope, forms=self.forms)
        attn = block_attention(Q, keys, stage.v("attn_sinks"), start, WINDOW - 1,
                               name="dspark_attention")
        return rope(attn, start, self.rope, inverse=True, forms=self.forms)

    def markov(self, prev: nn.Tensor):
        """m = w1[prev] (rank values) and its vocabulary bias w2 · m."""
        m = self.markov_w1.rows(prev, name="markov_w1")
        return m, self.markov_w2.linear(m, name="markov_w2")

    def propose(self, r: nn.Tensor, logits: nn.Tensor, anchors: nn.Tensor):
        """(drafts [S*B] int32, confidence logits [S*B]) of the block rows r [S*B, D] of S sequences
        (B rows each, one block after another) with base logits [S*B, V] after each one's anchor
        token (anchors [S] int32): row i's Markov head reads draft i-1 of its sequence; the S
        sequences' row i in one step."""
        S = int(anchors.shape[0])
        B = int(r.shape[0]) // S
        prev, drafts, confidences = anchors, [], []
        for i in range(B):
            m, bias = self.markov(prev)
            rm = op.concat([_row_of_blocks(r, B, i, "r_row"), m], dim=1)
            confidences.append(op.reshape(self.confidence_proj.linear(rm, name="confidence_head"), (S, 1)))
            prev = _argmax_sum(_row_of_blocks(logits, B, i, "logits_row"), bias, name="markov_argmax")
            drafts.append(op.reshape(prev, (S, 1)))
        return op.reshape(op.concat(drafts, dim=1), (S * B,)), op.reshape(op.concat(confidences, dim=1), (S * B,))


def extend(target_cls):
    """The target module class extended with the drafter's functions (one artifact, shared
    embedding and output head); its rings are the state group "dspark"."""

    class TargetWithDSpark(target_cls):
        def __init__(self, cfg, types: dict, bounds, kv_rounding: bool, draft_cfg: Config, draft_types: dict):
            super().__init__(cfg, types, bounds, kv_rounding=kv_rounding, capture_layers=draft_cfg.target_layer_ids)
            self.draft_cfg = draft_cfg
            self.drafter = DSparkDrafter(draft_cfg, draft_types, kv_rounding)

        def dspark_observe(self, captured, start, rings):
            return self.drafter.observe(captured, start, rings, direct=False)

        def dspark_observe_direct(self, captured, start, rings):
            return self.drafter.observe(captured, start, rings, direct=True)

        def dspark_block(self, captured, tokens, start, rings):
            return self._block(captured, tokens, [start], [rings])

        def _block(self, captured, tokens, starts, rings):
            seqs = Sequences([name for name, _ in ring_shapes(self.draft_cfg)], list(zip(starts, map(list, rings))))
            return self.drafter.block(captured, self.token_embd.rows(tokens, name="dspark_embedding"), seqs)

        def dspark_logits(self, r):
            return self.output.linear(r, name="dspark_lm_head")

        def dspark_markov(self, prev):
            return self.drafter.markov(prev)

        def dspark_propose(self, captured, tokens, start, rings):
            return self.dspark_propose_batch(captured, tokens, [start], [rings])

        def dspark_propose_batch(self, captured, tokens, starts, rings):
            """dspark_propose of each of len(starts) sequences: their blocks of tokens one after another."""
            r = self._block(captured, tokens, starts, rings)
            B = self.draft_cfg.block_size
            anchors = op.tensor_expr_op(lambda t: te.compute((len(starts),), lambda i: t[i * B], name="anchor"),
                                        "anchor", [tokens])
            return self.drafter.propose(r, self.dspark_logits(r), anchors)

        def state_specs(self):
            # a block reads the WINDOW - 1 rows before its anchor: one position can be rewound
            rings = [StateSpec(n, s, group="dspark", ring=WINDOW, rewind=1) for n, s in ring_shapes(self.draft_cfg)]
            return super().state_specs() + rings

        def functions(self):
            d, b = self.draft_cfg, self.draft_cfg.block
            L = len(d.target_layer_ids)
            observed = Arg("captured", "float32", ("n", L, b.n_embd))

            def block(n):   # the proposals of n sequences
                return Arg("captured", "float32", (n, L, b.n_embd)), tokens(n * d.block_size), START

            propose = Fn("dspark_propose", block(1), ("drafts", "confidence"), "dspark", state_arg="rings")
            return super().functions() + [
                Fn("dspark_observe", (observed, START), (), "dspark", per_width=True, state_arg="rings"),
                Fn("dspark_observe_direct", (observed, START), (), "dspark", state_arg="rings"),
                Fn("dspark_block", block(1), ("r",), "dspark", state_arg="rings"),
                Fn("dspark_logits", (Arg("r", "float32", ("m", b.n_embd)),), ("logits",)),
                Fn("dspark_markov", (tokens(1, "prev"),), ("m", "bias")),
                propose, *batched_copies(propose, block, self.bounds.max_batch, "dspark_propose_batch"),
            ]

        def drafter_settings(self) -> dict:
            d = self.draft_cfg
            return {"dspark": {"block_size": d.block_size, "markov_rank": d.markov_rank,
                               "noise_token_id": d.noise_token_id, "target_layer_ids": list(d.target_layer_ids),
                               "n_stages": d.n_stages, "confidence_threshold": d.confidence_threshold}}

    return TargetWithDSpark
