"""A PyTorch reference of ds4's DSpark drafter (dspark-crosscheck.md §2), for tests and training,
written from the spec's text and gguf's dequantizer; no code of the TVM graph is used. float64 (float32
for training).

Given the target's captured rows h (per position: the mean over the HC streams of each target
layer's output, concatenated in layer order):
- main_x = RMSNorm(main_proj · h) · main_norm;
- per stage, context rows K=V for committed positions: prefill/verify rows through HC-pre(attn) and
  attn_norm on main_x repeated over the streams, "direct" rows (plain decode steps) from main_x
  itself; both then attn_kv, kv_a_norm, RoPE (base 1e4, no YaRN) — FP8 rounding is left out
  (compare with an artifact compiled with --no-kv-rounding);
- a proposal after anchor t at P: rows [main_x(P) x hc @P, embed(t) x hc @P, embed(noise) x hc
  @P+1..]; each stage: HC-pre + attn_norm of every row, K/V of every row, queries from the token
  rows (per-head RMSNorm, RoPE), attention over the 127 ring rows before P (those at positions >= 0)
  and every block row with sinks, no causal mask, inverse RoPE, grouped output projection, HC-post,
  then the MoE (sqrt-softplus router, bias for selection only, shared expert, clamped SwiGLU) on the
  token rows; row 0 is main_x again in every stage; r_i = RMSNorm(hc_head(x_i)) · norm;
- Markov head m = w1[prev], bias = w2 · m; confidence c_i = conf · [r_i; m]; the chain of §2.6.

The support file's tensors are torch Parameters (`parameters()`, for training); `save(path)` writes
them back as a support GGUF in their original types. The target's embedding and output head are
read, never trained.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from gguf import quants

WINDOW = 128


class _File:
    """A GGUF read with gguf-py alone (the reference reads the file format, not ds4tvm's parser):
    `tensors` by name, each with `data`, `ggml_type` and its ggml `shape`; `key(name)`: a
    metadata value."""

    def __init__(self, path):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.tensors = {t.name: SimpleNamespace(data=t.data, ggml_type=t.tensor_type,
                                                shape=tuple(int(d) for d in t.shape)) for t in self.reader.tensors}

    def key(self, name: str):
        return self.reader.fields[name].contents()


def read_config(target_path, support_path) -> SimpleNamespace:
    """What the reference needs, read from the two files with gguf-py (dspark-crosscheck.md §2;
    the block's shapes from the support file's tensors, its hyper-parameters from the target's
    keys): the same fields as ds4tvm's paired config, which training passes instead."""
    t, s = _File(target_path), _File(support_path)
    k = lambda name: t.key(f"deepseek4.{name}")  # noqa: E731
    H = s.tensors["mtp.0.attn_sinks.weight"].shape[0]
    D = s.tensors["mtp.0.attn_kv.weight"].shape[1]
    group_in, group_out = s.tensors["mtp.0.attn_output_a.weight"].shape
    groups = H // (group_in // D)
    block = SimpleNamespace(hc=k("hyper_connection.count"), rms_eps=k("attention.layer_norm_rms_epsilon"),
                            hc_eps=k("hyper_connection.epsilon"), hc_sinkhorn_iters=k("hyper_connection.sinkhorn_iterations"),
                            n_rot=k("rope.dimension_count"), n_head=H, head_dim=D, o_groups=groups,
                            o_lora_rank=group_out // groups, swiglu_clamp=tuple(k("swiglu_clamp_exp")),
                            n_expert_used=k("expert_used_count"), expert_weights_scale=k("expert_weights_scale"))
    stages = len({name.split(".")[1] for name in s.tensors if name.startswith("mtp.")})
    return SimpleNamespace(n_stages=stages, block_size=s.key("deepseek4.dspark.block_size"),
                           noise_token_id=s.key("deepseek4.dspark.noise_token_id"),
                           target_layer_ids=tuple(s.key("deepseek4.dspark.target_layer_ids")),
                           n_embd=k("embedding_length"), block=block)


class Weights:
    """Dequantized tensors of a GGUF as float64 torch tensors in numpy order ([out, in]), read on
    first use; with `trainable`, as Parameters in `cache` (shared by every prefix view). gguf_file:
    a path (read with gguf-py) or an object with `tensors` by name (ds4tvm's GGUFFile)."""

    def __init__(self, gguf_file, prefix: str = "", trainable: bool = False, cache: dict | None = None,
                 dtype=torch.float64):
        gguf_file = _File(gguf_file) if isinstance(gguf_file, (str, Path)) else gguf_file
        self.f, self.prefix, self.trainable, self.dtype = gguf_file, prefix, trainable, dtype
        self.cache = {} if cache is None else cache

    def view(self, prefix: str) -> "Weights":
        return Weights(self.f, self.prefix + prefix, self.trainable, self.cache, self.dtype)

    def __call__(self, name: str) -> torch.Tensor:
        name = self.prefix + name
        if name not in self.cache:
            t = self.f.tensors[name]
            w = quants.dequantize(np.asarray(t.data), t.ggml_type).reshape(tuple(reversed(t.shape)))
            w = torch.from_numpy(np.array(w, np.float64)).to(self.dtype)
            self.cache[name] = torch.nn.Parameter(w) if self.trainable else w
        return self.cache[name]


def rms(x, eps, w=None):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def hc_pre(X, fn, scale, base, eps, hc_eps, iters):
    """X [n, hc, D] -> (x [n, D], post [n, hc], comb [n, hc, hc] with comb[dst, src])."""
    n, hc, _ = X.shape
    mix = rms(X.reshape(n, -1), eps) @ fn.T
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(n, hc, hc)
    c = torch.softmax(c, dim=2) + hc_eps
    c = c / (c.sum(1, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdim=True) + hc_eps)
        c = c / (c.sum(1, keepdim=True) + hc_eps)
    return torch.einsum("nh,nhd->nd", pre, X), post, c


def hc_post(out, X, post, c):
    """X'_dst = post_dst * out + sum_src c[src, dst] X_src (ds4 reads comb[dst + hc * src])."""
    return post[:, :, None] * out[:, None] + torch.einsum("nsd,nsk->ndk", c, X)


def rope(x, positions, n_rot, base=10000.0, inverse=False):
    """Interleaved pairs over the last n_rot values; x [n, ..., D], positions [n]."""
    x = x.clone()
    j = torch.arange(n_rot // 2, dtype=torch.float64)
    theta = positions.to(torch.float64)[:, None] * base ** (-2.0 * j / n_rot) * (-1 if inverse else 1)
    theta = theta.reshape(theta.shape[0], *([1] * (x.dim() - 2)), -1).to(x.dtype)
    a, b = x[..., -n_rot::2].clone(), x[..., -n_rot + 1::2].clone()
    x[..., -n_rot::2] = a * torch.cos(theta) - b * torch.sin(theta)
    x[..., -n_rot + 1::2] = a * torch.sin(theta) + b * torch.cos(theta)
    return x


class Stage:
    """One V4 block with ratio 0 and no hash routing: a DSpark stage (RoPE base 1e4, no YaRN)."""

    ROPE_BASE = 10000.0

    def __init__(self, w: Weights, b):
        self.w, self.b = w, b

    def attn_input(self, X):
        b, w = self.b, self.w
        x, post, comb = hc_pre(X, w("hc_attn_fn.weight"), w("hc_attn_scale.weight"), w("hc_attn_base.weight"),
                               b.rms_eps, b.hc_eps, b.hc_sinkhorn_iters)
        return rms(x, b.rms_eps, w("attn_norm.weight")), post, comb

    def kv(self, n_in, positions):
        b, w = self.b, self.w
        return rope(rms(n_in @ w("attn_kv.weight").T, b.rms_eps, w("attn_kv_a_norm.weight")), positions, b.n_rot,
                    self.ROPE_BASE)

    def attention(self, N, keys, visible, positions):
        """Token rows N [B, D] over keys [R, Dh] (visible [R] bool); the output projection."""
        return self.attention_batch(N[None], keys[None], visible[None], positions[None])[0]

    def attention_batch(self, N, keys, visible, positions):
        """A proposals at once: N [A, B, D] over keys [A, R, Dh] (visible [A, R]), positions [A, B]."""
        b, w = self.b, self.w
        H, Dh, (A, B) = b.n_head, b.head_dim, N.shape[:2]
        q = rms(N @ w("attn_q_a.weight").T, b.rms_eps, w("attn_q_a_norm.weight")) @ w("attn_q_b.weight").T
        flat = positions.reshape(-1)
        q = rope(rms(q.reshape(A * B, H, Dh), b.rms_eps), flat, b.n_rot, self.ROPE_BASE).reshape(A, B, H, Dh)
        scores = torch.einsum("abhd,ard->abhr", q, keys) / Dh ** 0.5
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        sinks = w("attn_sinks.weight")[None, None, :, None].expand(A, B, H, 1)
        p = torch.softmax(torch.cat([scores, sinks], dim=3), dim=3)[..., :-1]   # sinks: denominator only
        attn = torch.einsum("abhr,ard->abhd", p, keys).reshape(A * B, H, Dh)
        attn = rope(attn, flat, b.n_rot, self.ROPE_BASE, inverse=True)
        g = b.o_groups
        wa = w("attn_output_a.weight").reshape(g, b.o_lora_rank, -1)
        low = torch.einsum("gkc,ngc->ngk", wa, attn.reshape(A * B, g, -1)).reshape(A * B, -1)
        return (low @ w("attn_output_b.weight").T).reshape(A, B, -1)

    def moe(self, X):
        b, w = self.b, self.w
        x, post, comb = hc_pre(X, w("hc_ffn_fn.weight"), w("hc_ffn_scale.weight"), w("hc_ffn_base.weight"),
                               b.rms_eps, b.hc_eps, b.hc_sinkhorn_iters)
        h = rms(x, b.rms_eps, w("ffn_norm.weight"))
        p = torch.sqrt(torch.nn.functional.softplus(h @ w("ffn_gate_inp.weight").T))
        lim = b.swiglu_clamp[0]

        def swiglu(gate, up):
            return torch.nn.functional.silu(gate.clamp(max=lim)) * up.clamp(-lim, lim)

        gate, up, down = w("ffn_gate_exps.weight"), w("ffn_up_exps.weight"), w("ffn_down_exps.weight")
        chosen = torch.topk(p + w("exp_probs_b.bias"), b.n_expert_used, dim=1).indices          # [n, k]
        picked = torch.gather(p, 1, chosen)
        weights = picked / picked.sum(1, keepdim=True).clamp(min=6.1e-5) * b.expert_weights_scale
        y = w("ffn_down_shexp.weight") @ swiglu(w("ffn_gate_shexp.weight") @ h.T, w("ffn_up_shexp.weight") @ h.T)
        y = y.T
        for e in range(gate.shape[0]):   # each expert over the rows that chose it
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if len(rows):
                he = h[rows]
                ye = swiglu(he @ gate[e].T, he @ up[e].T) @ down[e].T
                y = y.index_add(0, rows, ye * weights[rows, slot][:, None])
        return hc_post(y, X, post, comb)


class DSparkReference:
    def __init__(self, target_gguf, support_gguf, cfg, dtype=torch.float64):
        """target_gguf, support_gguf: paths (read with gguf-py) or ds4tvm's GGUFFiles; cfg: the
        support file's Config paired with the target (families.dspark.config), or read_config's;
        dtype: float64 for the tests, float32 for training."""
        self.cfg, b, self.dtype = cfg, cfg.block, dtype
        self.t, self.w = Weights(target_gguf, dtype=dtype), Weights(support_gguf, trainable=True, dtype=dtype)
        self.stages = [Stage(self.w.view(f"mtp.{s}."), b) for s in range(cfg.n_stages)]
        self.last = f"mtp.{cfg.n_stages - 1}."
        self.rings: list[dict[int, torch.Tensor]] = [{} for _ in self.stages]   # position -> K=V row

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every tensor of the support file, as a Parameter."""
        return [self.w(name) for name in self.w.f.tensors]

    def save(self, path, name: str = "ds4tvm dspark"):
        """The support file with the current values, each tensor in its original GGML type."""
        from ..families.dspark.random_model import support_metadata
        from ..gguf.quant import quantize
        from ..gguf.writer import TensorOut, write_gguf

        def out(key):
            t = self.w.f.tensors[key]
            values = self.w(key).detach().numpy()
            return TensorOut(key, t.ggml_type, values.shape, lambda: quantize(values, t.ggml_type))

        meta = support_metadata(self.cfg, name)
        return write_gguf(path, meta["general.architecture"], meta, [out(key) for key in self.w.f.tensors])

    def main_x(self, captured) -> torch.Tensor:
        h = torch.as_tensor(np.asarray(captured, np.float64)).to(self.dtype).reshape(len(captured), -1)
        b = self.cfg.block
        return rms(h @ self.w("mtp.0.main_proj.weight").T, b.rms_eps, self.w("mtp.0.main_norm.weight"))

    def observe(self, captured, start: int, direct: bool = False) -> None:
        """Ring rows for the committed positions start.. (captured: one row per position)."""
        mx, hc = self.main_x(captured), self.cfg.block.hc
        positions = torch.arange(start, start + len(mx))
        for stage, ring in zip(self.stages, self.rings):
            n_in = mx if direct else stage.attn_input(mx[:, None].expand(-1, hc, -1))[0]
            for p, row in zip(positions.tolist(), stage.kv(n_in, positions)):
                ring[p] = row

    def block(self, anchor_captured, anchor: int, P: int) -> torch.Tensor:
        """r [B, D] of the proposal after anchor token `anchor` at position P."""
        cfg, b = self.cfg, self.cfg.block
        B, hc = cfg.block_size, b.hc
        embd = self.t("token_embd.weight")
        row0 = self.main_x(anchor_captured[None])[:, None].expand(1, hc, -1)
        T = embd[[anchor] + [cfg.noise_token_id] * (B - 1)][:, None].expand(B, hc, -1)
        token_pos = torch.arange(P, P + B)
        context = list(range(P - WINDOW + 1, P))
        for stage, ring in zip(self.stages, self.rings):
            N, post, comb = stage.attn_input(torch.cat([row0, T]))
            kv = torch.cat([stage.kv(N[:1], torch.tensor([P])), stage.kv(N[1:], token_pos)])
            ctx = torch.stack([ring[p] if p >= 0 else torch.zeros(b.head_dim, dtype=self.dtype)
                               for p in context])
            visible = torch.tensor([p >= 0 for p in context] + [True] * (B + 1))
            out = stage.attention(N[1:], torch.cat([ctx, kv]), visible, token_pos)
            T = stage.moe(hc_post(out, T, post[1:], comb[1:]))
        return self.head(T)

    def head(self, T) -> torch.Tensor:
        """The output HC head and norm of the last stage: token rows [n, hc, D] -> r [n, D]."""
        b, w, n = self.cfg.block, self.w, T.shape[0]
        pre = rms(T.reshape(n, -1), b.rms_eps) @ w(self.last + "hc_head_fn.weight").T
        wts = torch.sigmoid(pre * w(self.last + "hc_head_scale.weight")[0] + w(self.last + "hc_head_base.weight"))
        x = torch.einsum("bh,bhd->bd", wts + b.hc_eps, T)
        return rms(x, b.rms_eps, w(self.last + "norm.weight"))

    def blocks(self, captured, tokens, anchors, direct=None) -> torch.Tensor:
        """Training's batched form of observe + block: r [A, B, D] of the proposals after each
        anchor position P of one sequence (tokens [L], captured rows [L, ...]) whose positions
        before P were committed by prefill or verify, or by a plain decode step where `direct`
        ([L] bool) says so."""
        cfg, b = self.cfg, self.cfg.block
        B, hc, A = cfg.block_size, b.hc, len(anchors)
        mx = self.main_x(captured)
        P = torch.as_tensor(np.asarray(anchors))
        ids = torch.full((A, B), cfg.noise_token_id)
        ids[:, 0] = torch.as_tensor(np.asarray(tokens))[P]
        T = self.t("token_embd.weight")[ids][:, :, None].expand(A, B, hc, -1)
        row0 = mx[P][:, None, None].expand(A, 1, hc, -1)
        token_pos = P[:, None] + torch.arange(B)
        block_pos = torch.cat([P[:, None], token_pos], 1)
        ctx_pos = P[:, None] + torch.arange(1 - WINDOW, 0)
        visible = torch.cat([ctx_pos >= 0, torch.ones(A, B + 1, dtype=torch.bool)], 1)
        every = torch.arange(len(mx))
        for stage in self.stages:
            ring_in = stage.attn_input(mx[:, None].expand(-1, hc, -1))[0]
            if direct is not None:
                ring_in = torch.where(torch.as_tensor(np.asarray(direct))[:, None], mx, ring_in)
            ring = stage.kv(ring_in, every)
            N, post, comb = stage.attn_input(torch.cat([row0, T], 1).reshape(A * (B + 1), hc, -1))
            kv = stage.kv(N, block_pos.reshape(-1)).reshape(A, B + 1, -1)
            N = N.reshape(A, B + 1, -1)[:, 1:]
            out = stage.attention_batch(N, torch.cat([ring[ctx_pos.clamp(min=0)], kv], 1), visible, token_pos)
            post, comb = post.reshape(A, B + 1, hc)[:, 1:], comb.reshape(A, B + 1, hc, hc)[:, 1:]
            X = hc_post(out.reshape(A * B, -1), T.reshape(A * B, hc, -1), post.reshape(A * B, hc),
                        comb.reshape(A * B, hc, hc))
            T = stage.moe(X).reshape(A, B, hc, -1)
        return self.head(T.reshape(A * B, hc, -1)).reshape(A, B, -1)

    def logits(self, r) -> torch.Tensor:
        return r @ self.t("output.weight").T

    def markov(self, prev) -> tuple[torch.Tensor, torch.Tensor]:
        """(m = w1[prev], its vocabulary bias w2 · m); prev an id, or ids of any shape."""
        m = self.w(self.last + "markov_head.markov_w1.weight")[prev]
        return m, m @ self.w(self.last + "markov_head.markov_w2.weight").T

    def confidence(self, r_i, m) -> torch.Tensor:
        """c = conf · [r_i; m], over the last axis (one row, or any batch of rows)."""
        conf = self.w(self.last + "confidence_head.proj.weight").reshape(-1)
        return torch.cat([r_i, m], -1) @ conf

    @torch.no_grad()
    def propose(self, anchor_captured, anchor: int, P: int, theta: float):
        """The drafts of §2.6 (cut at the first sigma(c_i) < theta), with each row's confidence."""
        r = self.block(anchor_captured, anchor, P)
        logits, prev, drafts, confidences = self.logits(r), anchor, [], []
        for i in range(self.cfg.block_size):
            m, bias = self.markov(prev)
            c = float(self.confidence(r[i], m))
            confidences.append(c)
            if theta > 0 and 1 / (1 + np.exp(-c)) < theta:
                break
            prev = int(torch.argmax(logits[i] + bias))   # torch.argmax: the first maximum, the lowest id
            drafts.append(prev)
        return drafts, confidences
