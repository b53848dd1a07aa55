"""A reference of DeepSeek-V4's legacy one-stage MTP draft (ds4-spec §7) around transformers' own
DeepSeek-V4 layers: its block is a one-layer DeepseekV4 model (a sliding-window layer, ratio 0,
routed without hashing, the target's main RoPE) holding the support file's `mtp.0.` tensors, its
head transformers' HC head and norm, with the target's embedding and output. Only the MTP input is
written here from the spec. Files are read with gguf-py. FP8 rounding of the cached rows is left
out: compare with an artifact compiled with --no-kv-rounding."""

from __future__ import annotations

import numpy as np
import torch

from hf_models import gguf_values, hf_config_from_gguf, hf_load

# the support file's tensors outside the block: the MTP input and the head
_INPUT = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")
_HEAD = {"hc_head_fn.weight": "output_hc_fn.weight", "hc_head_base.weight": "output_hc_base.weight",
         "hc_head_scale.weight": "output_hc_scale.weight", "norm.weight": "output_norm.weight"}


def _rms(x, eps, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


class MTPReference:
    """Rows are kept as the block's inputs X [hc, D] by position; a step runs the block over every
    row up to its own (the layer's sliding window does the rest) and reads its last one."""

    def __init__(self, target_path, support_path):
        from gguf import GGUFReader
        from transformers import DeepseekV4ForCausalLM

        target, support = GGUFReader(target_path), GGUFReader(support_path)
        config = hf_config_from_gguf(target, num_hidden_layers=1, layer_types=["sliding_attention"],
                                     mlp_layer_types=["moe"])
        self.model = DeepseekV4ForCausalLM(config).eval()
        t, s = gguf_values(target), {k[len("mtp.0."):]: v for k, v in gguf_values(support).items()}
        block = {f"blk.0.{k}": v for k, v in s.items() if k not in _INPUT and k not in _HEAD}
        hf_load(self.model, {**block, **{_HEAD[k]: s[k] for k in _HEAD},
                             "token_embd.weight": t["token_embd.weight"], "output.weight": t["output.weight"]})
        self.model = self.model.double()
        self.model.set_experts_implementation("eager")
        self.w = {k: torch.from_numpy(np.asarray(s[k], np.float64)) for k in _INPUT}
        self.eps = config.rms_norm_eps
        self.rows: dict[int, torch.Tensor] = {}

    def inputs(self, hc_prev, token) -> torch.Tensor:
        """X [hc, D]: e_proj(enorm(embed(token))) added to h_proj(hnorm(each stream of hc_prev))."""
        w, embed = self.w, self.model.model.embed_tokens.weight
        e = w["e_proj.weight"] @ _rms(embed[token], self.eps, w["enorm.weight"])
        h = _rms(torch.as_tensor(np.asarray(hc_prev, np.float64)), self.eps, w["hnorm.weight"]) @ w["h_proj.weight"].T
        return e[None] + h

    def observe(self, hc_prev, token, pos):
        self.rows[pos] = self.inputs(hc_prev, token)

    def step(self, hc_prev, token, pos):
        """(logits [V], X' [hc, D]) of one draft step, as numpy; keeps the row of pos."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        self.rows[pos] = self.inputs(hc_prev, token)
        m = self.model.model
        X = torch.stack([self.rows[p] for p in range(pos + 1)])[None]            # [1, S, hc, D]
        positions = torch.arange(pos + 1)[None]
        flat = X[:, :, 0]
        mask = create_sliding_window_causal_mask(config=m.config, inputs_embeds=flat, attention_mask=None,
                                                 past_key_values=None, position_ids=positions)
        with torch.no_grad():
            out = m.layers[0](X, position_embeddings={"main": m.rotary_emb(flat, positions, layer_type="main")},
                              position_ids=positions, attention_mask=mask)
            logits = self.model.lm_head(m.norm(m.hc_head(out[:, -1:])))[0, 0]
        return logits.numpy(), out[0, -1].numpy()
