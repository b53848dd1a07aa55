"""`ds4 convert` for transformers' `Qwen4ExpForCausalLM` checkpoints (and the text model of
`Qwen4ExpForConditionalGeneration`): a GGUF in the layout of llama.cpp's `qwen4exp` converter, which
ds4's files share. Checkpoints store [out, in] (ggml order reversed) under `model.` (or
`model.language_model.`). Besides renames:

- zero-centred gammas become 1 + w (the HC norms, q/k norms, the indexer's and PLE's norms; not
  the GDN gated norm);
- with more GDN value heads than key heads, the value heads go from grouped order (value head
  g * r + j reads key head g) to tiled order (head j * Hk + g), in every tensor that has them (the
  v rows of in_proj_qkv and its conv channels, z, alpha, beta, dt_bias, A_log, out_proj's columns);
- A_log becomes ssm_a = -exp(A_log); conv weights lose their singleton axis;
- packed experts split into gate and up; the indexer's q/k projection splits;
- the n-gram table's shards are concatenated in index order; the hash constants become metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...errors import Ds4Error
from ...gguf.convert import TextCheckpoint, choose_type, read_hf_checkpoint
from ...gguf.quant import quantize
from ...gguf.safetensors_io import SafetensorsDir
from ...gguf.vocab import hf_vocab, synthetic_vocab
from ...gguf.writer import TensorOut, write_gguf
from .config import ARCH, Config
from .ple import TABLE
from .tensors import tensor_specs

_PLUS_ONE = ("hc_attn_norm.weight", "hc_ffn_norm.weight", "output_hc_norm.weight", "attn_q_norm.weight",
             "attn_k_norm.weight", "indexer.q_norm.weight", "indexer.k_norm.weight", "ple_norm_key.weight",
             "ple_norm_query.weight", "ple_norm_conv.weight")
_RENAMES = {   # GGUF suffix -> checkpoint suffix (after layers.N.)
    **{f"hc_{g}_{p}.weight": f"{h}_hyper_connection.{q}.weight" for g, h in (("attn", "attn"), ("ffn", "mlp"))
       for p, q in (("norm", "hc_norm"), ("down", "input_mix_weight_down"), ("up", "input_mix_weight_up"),
                    ("inject", "block_inject_weight"))},
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "indexer.q_norm.weight": "self_attn.indexer.q_layernorm.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_layernorm.weight",
    "ple_key.weight": "ple.key_proj.weight", "ple_value.weight": "ple.value_proj.weight",
    "ple_norm_key.weight": "ple.norm_key.weight", "ple_norm_query.weight": "ple.norm_query.weight",
    "ple_norm_conv.weight": "ple.norm_conv.weight", "ple_conv1d.weight": "ple.conv1d.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_HEAD = {"output_hc_norm.weight": "hc_norm.weight", "output_hc_down.weight": "input_mix_weight_down.weight",
         "output_hc_up.weight": "input_mix_weight_up.weight"}
_ATTENTION = ("indexed_attention", "full_attention")


def config_from_hf(t: dict, where: str, ple: dict) -> Config:
    """The config of a text config dict; ple: the PLE constants read from the checkpoint."""
    def need(key):
        if t.get(key) is None:
            raise Ds4Error(f"{where}: missing field {key}")
        return t[key]

    n = need("num_hidden_layers")
    kinds = t.get("layer_types") or ["indexed_attention" if (i + 1) % t.get("full_attention_interval", 4) == 0
                                     else "linear_attention" for i in range(n)]
    if len(kinds) != n or any(k not in ("linear_attention", *_ATTENTION) for k in kinds):
        raise Ds4Error(f"{where}: layer_types must hold {n} of linear_attention, indexed_attention; got {kinds}")
    if need("linear_key_head_dim") != need("linear_value_head_dim"):
        raise Ds4Error(f"{where}: linear_key_head_dim {t['linear_key_head_dim']} differs from linear_value_head_dim "
                       f"{t['linear_value_head_dim']}; the qwen4exp GGUF has one GDN head width (ssm.state_size)")
    rope = t.get("rope_parameters") or {}
    head_dim = need("head_dim")
    ratio = need("indexer_compress_ratio")
    eos = t.get("eos_token_id")
    return Config(
        n_layers=n, n_nextn=0, n_embd=need("hidden_size"), n_vocab=need("vocab_size"),
        rms_eps=float(t.get("rms_norm_eps", 1e-6)), n_head=need("num_attention_heads"),
        n_head_kv=need("num_key_value_heads"), head_dim=head_dim,
        n_rot=int(head_dim * rope.get("partial_rotary_factor", 1.0)), rope_base=float(rope.get("rope_theta", 1e7)),
        rope_sections=tuple(rope.get("mrope_section", [11, 11, 10])) + (0,),
        n_expert=need("num_experts"), n_expert_used=need("num_experts_per_tok"), n_ff_exp=need("moe_intermediate_size"),
        n_ff_shexp=need("shared_expert_intermediate_size"), conv_kernel=t.get("linear_conv_kernel_dim", 4),
        gdn_head_dim=t["linear_key_head_dim"], gdn_k_heads=need("linear_num_key_heads"),
        gdn_v_heads=need("linear_num_value_heads"),
        layer_ratios=tuple(ratio if k in _ATTENTION else 0 for k in kinds), hc=t.get("hc_count", 4),
        hc_rank=t.get("hc_lowrank", 320), idx_n_head=need("indexer_n_heads"), idx_head_dim=need("indexer_head_dim"),
        idx_top_k=need("indexer_budget"), gate_type=t.get("output_gate_type") or t.get("hidden_act", "silu"),
        context_length=t.get("max_position_embeddings", 262144),
        **(dict(ple_layers=tuple(i - 1 for i in t["ple_layer_ids"]), ngram=t.get("ngram_size", 3),
                heads_per_ngram=t.get("heads_per_ngram", 8), ple_conv_kernel=t.get("ple_conv_kernel_size", 4),
                eos=int(eos[0] if isinstance(eos, list) else eos), **ple) if t.get("ple_layer_ids") else {}))


class Checkpoint(TextCheckpoint):
    """GGUF tensor names -> arrays (numpy order) from the checkpoint."""

    def ple_layer(self, layer: int) -> str:
        return f"{self.root}layers.{layer}.ple.ple_embedding."

    def _table_parts(self, layer: int) -> list[str]:
        """The n-gram table's tensor, or its shards in index order."""
        p = self.ple_layer(layer)
        if p + "ngram_embedding.weight" in self.st:
            return [p + "ngram_embedding.weight"]
        shards = sorted((int(k[len(p) + len("ngram_embedding.shard_"):].split(".")[0]), k) for k in self.st.names()
                        if k.startswith(p + "ngram_embedding.shard_"))
        if not shards:
            raise Ds4Error(f"{self.where}: checkpoint has no tensor {p}ngram_embedding.weight (nor its shards)")
        return [k for _, k in shards]

    def table_shape(self, layer: int) -> tuple[int, int]:
        """(rows, width) from the tensors' headers, without reading them."""
        shapes = [self.st.shape(k) for k in self._table_parts(layer)]
        return sum(s[0] for s in shapes), shapes[0][1]

    def table(self, layer: int) -> np.ndarray:
        return np.concatenate([self.raw(k) for k in self._table_parts(layer)])

    def _experts(self, p: str, part: str, n_expert: int) -> np.ndarray:
        """[X, out, in] of gate, up or down: packed (gate_up_proj, gate first; down_proj) or one
        tensor per expert (as save_pretrained writes them)."""
        if f"{p}mlp.experts.0.{part}_proj.weight" in self.st:
            return np.stack([self.raw(f"{p}mlp.experts.{j}.{part}_proj.weight") for j in range(n_expert)])
        if part == "down":
            return self.raw(p + "mlp.experts.down_proj")
        gate_up = self.raw(p + "mlp.experts.gate_up_proj")
        half = gate_up.shape[1] // 2
        return gate_up[:, :half] if part == "gate" else gate_up[:, half:]

    def get(self, name: str, cfg: Config) -> np.ndarray:
        r = self.root
        if name == "token_embd.weight":
            return self.raw(r + "embed_tokens.weight")
        if name == "output.weight":
            return self.raw("lm_head.weight" if "lm_head.weight" in self.st else r + "embed_tokens.weight")
        if name == TABLE:
            return self.table(cfg.ple_layers[0])
        if name in _HEAD:
            return _folded(name, self.raw(r + "hyper_connection_mixer." + _HEAD[name]))
        _, layer, suffix = name.split(".", 2)
        p = f"{r}layers.{layer}."
        if suffix.startswith("indexer.") and suffix.endswith("_proj.weight"):
            qk = self.raw(p + "self_attn.indexer.index_qk_proj.weight")
            n_q = cfg.idx_n_head * cfg.idx_head_dim
            return qk[:n_q] if suffix == "indexer.q_proj.weight" else qk[n_q:]
        if suffix.endswith("_exps.weight"):
            return self._experts(p, suffix.split("_")[1], cfg.n_expert)
        x = self.raw(p + _RENAMES[suffix])
        if suffix in ("ssm_conv1d.weight", "ple_conv1d.weight", "ffn_gate_inp_shexp.weight"):
            x = x.reshape(x.shape[0], -1) if suffix != "ffn_gate_inp_shexp.weight" else x.reshape(-1)
        if suffix == "ssm_a":
            x = -np.exp(np.asarray(x, np.float32))
        return _tiled_value_heads(suffix, _folded(suffix, x), cfg)


def _folded(suffix: str, x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32) + 1.0 if suffix in _PLUS_ONE else x


def _tiled(x: np.ndarray, axis: int, k_heads: int, per_k: int, width: int) -> np.ndarray:
    """Value heads along `axis` from grouped (g * per_k + j) to tiled (j * k_heads + g) order."""
    shape = list(x.shape)
    x = x.reshape(shape[:axis] + [k_heads, per_k, width] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(x, axis, axis + 1)).reshape(shape)


def _tiled_value_heads(suffix: str, x: np.ndarray, cfg: Config) -> np.ndarray:
    Hk, Hv, D = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_head_dim
    if Hv == Hk:
        return x
    r = Hv // Hk
    if suffix in ("attn_qkv.weight", "ssm_conv1d.weight"):
        return np.concatenate([x[:2 * Hk * D], _tiled(x[2 * Hk * D:], 0, Hk, r, D)])
    if suffix == "attn_gate.weight":
        return _tiled(x, 0, Hk, r, D)
    if suffix in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
        return _tiled(x, 0, Hk, r, 1)
    if suffix == "ssm_out.weight":
        return _tiled(x, 1, Hk, r, D)
    return x


def _ple_constants(ckpt: Checkpoint, text: dict) -> dict:
    """The PLE config fields the checkpoint holds: the hash constants (int64 buffers, exact) and the
    table's shape."""
    if not text.get("ple_layer_ids"):
        return {}
    layer = text["ple_layer_ids"][0] - 1
    p = ckpt.ple_layer(layer)
    ints = {k: tuple(int(v) for v in ckpt.raw(p + k).reshape(-1))
            for k in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")}
    rows, width = ckpt.table_shape(layer)
    return dict(multipliers=ints["layer_multipliers"], head_offsets=ints["ngram_heads_offsets"],
                head_vocab_sizes=ints["ngram_heads_vocab_sizes"], ple_width=int(width), ple_table_rows=int(rows))


def convert_hf(hf_dir: Path, out: Path, dense_type: str = "f16", experts_type: str | None = None,
               progress: bool = True, type_of=None) -> Path:
    """type_of(spec) -> GGML type, when given, chooses each tensor's type (a recipe such as
    published.q4k_recipe_type) in place of --type / --experts-type."""
    hf_dir, cfg_path = Path(hf_dir), Path(hf_dir) / "config.json"
    hf, dense, experts = read_hf_checkpoint(hf_dir, out, dense_type, experts_type)
    text = hf.get("text_config") or hf
    ckpt = Checkpoint(SafetensorsDir(hf_dir), str(hf_dir))
    cfg = config_from_hf(text, str(cfg_path), _ple_constants(ckpt, text))
    cfg.validate(str(cfg_path))
    tensors = []
    for spec in tensor_specs(cfg):
        qtype = type_of(spec) if type_of is not None else choose_type(spec, dense, experts)

        def produce(name=spec.name, want=tuple(reversed(spec.shape)), qtype=qtype):
            x = ckpt.get(name, cfg)
            if x.shape != want:
                raise Ds4Error(f"{hf_dir}: the checkpoint's tensor for {name} has shape {list(x.shape)}, "
                               f"expected {list(want)}")
            return quantize(np.asarray(x, np.float32), qtype)

        tensors.append(TensorOut(spec.name, qtype, tuple(reversed(spec.shape)), produce))
    meta = {"general.architecture": ARCH, "general.name": hf_dir.name, **cfg.to_metadata()}
    meta.update(hf_vocab(hf_dir, cfg.n_vocab, pre="qwen35") or synthetic_vocab(cfg.n_vocab))
    return write_gguf(Path(out), ARCH, meta, tensors, progress=progress, description="converting")
