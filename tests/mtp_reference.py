"""A reference of DeepSeek-V4's legacy one-stage MTP draft (ds4-spec §7), written from the spec's
text (§2 for the V4 block, hyper-connections and output head) and gguf's dequantizer; no code of the
TVM graph is used. Its V4 block is the one of the DSpark reference (ds4tvm/training/
dspark_reference.py: the same ratio-0 block without hash routing), with the target's RoPE base.
FP8 rounding of the cached rows is left out: compare with an artifact compiled with --no-kv-rounding."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ds4tvm.training.dspark_reference import Stage, Weights, hc_post, rms


def _t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, np.float64))


def read_config(target_path) -> SimpleNamespace:
    """The target's hyper-parameters the block shares (ratio 0), read with gguf-py (ds4-spec §1.1 keys)."""
    from gguf import GGUFReader

    fields = GGUFReader(target_path).fields
    k = lambda name: fields[f"deepseek4.{name}"].contents()  # noqa: E731
    return SimpleNamespace(
        hc=k("hyper_connection.count"), rms_eps=k("attention.layer_norm_rms_epsilon"), hc_eps=k("hyper_connection.epsilon"),
        hc_sinkhorn_iters=k("hyper_connection.sinkhorn_iterations"), n_rot=k("rope.dimension_count"),
        n_head=k("attention.head_count"), head_dim=k("attention.key_length"), o_groups=k("attention.output_group_count"),
        o_lora_rank=k("attention.output_lora_rank"), swiglu_clamp=tuple(k("swiglu_clamp_exp")),
        n_expert_used=k("expert_used_count"), expert_weights_scale=k("expert_weights_scale"),
        sliding_window=k("attention.sliding_window"), rope_base=k("rope.freq_base"))


class MTPReference:
    def __init__(self, target_gguf, support_gguf, cfg):
        """target_gguf, support_gguf: paths (read with gguf-py) or ds4tvm's GGUFFiles; cfg: the
        target's hyper-parameters (read_config; the block shares them, ratio 0)."""
        self.c, self.t, self.w = cfg, Weights(target_gguf), Weights(support_gguf, "mtp.0.")
        self.block = Stage(self.w, cfg, cfg.rope_base)
        self.rows: dict[int, torch.Tensor] = {}

    def inputs(self, hc_prev, token) -> torch.Tensor:
        """X [hc, D]: e_proj(enorm(embed(token))) added to h_proj(hnorm(each stream of hc_prev))."""
        c, w = self.c, self.w
        e = w("e_proj.weight") @ rms(self.t("token_embd.weight")[token], c.rms_eps, w("enorm.weight"))
        h = rms(_t(hc_prev), c.rms_eps, w("hnorm.weight")) @ w("h_proj.weight").T
        return e[None] + h

    def _row(self, X, pos) -> torch.Tensor:
        return self.block.kv(self.block.attn_input(X[None])[0], torch.tensor([pos]))[0]

    def observe(self, hc_prev, token, pos):
        self.rows[pos] = self._row(self.inputs(hc_prev, token), pos)

    def step(self, hc_prev, token, pos):
        """(logits [V], X' [hc, D]) of one draft step, as numpy; writes the row of pos."""
        c, b = self.c, self.block
        X = self.inputs(hc_prev, token)
        self.rows[pos] = self._row(X, pos)
        N, post, comb = b.attn_input(X[None])
        keys = torch.stack([self.rows[p] for p in range(max(0, pos - c.sliding_window + 1), pos + 1)])
        out = b.attention(N, keys, torch.ones(len(keys), dtype=torch.bool), torch.tensor([pos]))
        X = b.moe(hc_post(out, X[None], post, comb))[0]
        return self._head(X).numpy(), X.numpy()

    def _head(self, X):
        c, w = self.c, self.w
        pre = w("hc_head_fn.weight") @ rms(X.reshape(-1), c.rms_eps)
        wts = torch.sigmoid(pre * w("hc_head_scale.weight")[0] + w("hc_head_base.weight")) + c.hc_eps
        return self.t("output.weight") @ rms(wts @ X, c.rms_eps, w("norm.weight"))
