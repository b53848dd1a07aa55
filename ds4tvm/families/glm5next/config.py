"""GLM-5.3-Flash hyper-parameters (ds4-spec §1.4 and its Errata), read from either GGUF layout of
the same model:

- ds4's own: `layer_types` (0 = KDA, 1 = DSA), `trunk_block_count`, `linear_attention.*`,
  `attention.indexer.pool_size`, one `swiglu_limit`;
- llama.cpp's `glm5-next`: the schedule in the `attention.head_count_kv` array (0 = KDA, 1 = DSA,
  the MTP layers included), `nextn_predict_layers`, `ssm.conv_kernel`, `kda.head_dim`,
  `kda.gate_lower_bound`, `attention.indexer.kpool` / `kpool_select_tail` / `types`,
  `attention.key_length_mla` / `value_length_mla`, `swiglu_clamp_exp` / `swiglu_clamp_shexp`
  (per layer or one value), one head count for KDA and MLA.

`Config.layout` says which one a file uses (its tensor names differ too: tensors.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...errors import Ds4Error
from ...gguf.reader import GGUFFile
from ...gguf.validate import check_ranges

ARCH = "glm5-next"
KDA, DSA = 0, 1
DS4, LLAMA = "ds4", "llama.cpp"
LAYOUTS = (DS4, LLAMA)
# what the MTP layer reads of the target's row before its token, told by the file's eh_proj width:
# the output head's input (post output_norm, one vector: llama.cpp's t_h_nextn; eh_proj [2E -> E]) or
# the trunk's hc residual streams before they collapse (ds4-spec §4: HC-shaped; eh_proj [(1 + hc) E -> E])
HIDDEN, STREAMS = "hidden", "streams"


@dataclass(frozen=True)
class Config:
    layout: str
    n_layers: int                   # trunk layers; the MTP (nextn) layers follow them
    n_nextn: int
    n_embd: int
    n_vocab: int
    n_ff: int                       # the dense leading layers
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_dense_lead: int
    expert_weights_scale: float
    expert_weights_norm: bool
    rms_eps: float
    n_head: int                     # MLA heads; KDA has its own key in the ds4 layout (equal here)
    key_length: int                 # per MLA head (no RoPE part)
    value_length: int
    q_lora_rank: int
    kv_lora_rank: int
    idx_n_head: int
    idx_head_dim: int
    idx_top_k: int                  # tokens: top_k // idx_pool whole pools
    idx_pool: int
    kda_n_head: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None  # None: the -exp(A_log) * softplus decay
    layer_types: tuple[int, ...]    # every layer, MTP included
    swiglu_exp: tuple[float, ...]   # routed experts' clamp, per layer
    swiglu_shexp: tuple[float, ...]  # the shared expert's and the dense layers' clamp, per layer
    hc: int
    hc_sinkhorn_iters: int
    hc_eps: float
    idx_norm_eps: float = 1e-6      # the indexer keys' LayerNorm
    idx_select_tail: bool = True    # the unfinished pool is always attended
    idx_full: tuple[bool, ...] = ()  # per trunk layer: its own indexer, or the previous selection
    context_length: int = 1048576
    mtp_input: str = HIDDEN         # HIDDEN or STREAMS: see above

    @property
    def mtp_input_width(self) -> int:
        """The width of the row the MTP layer reads (mtp_input): D, or hc * D for the streams."""
        return self.n_embd * (self.hc if self.mtp_input == STREAMS else 1)

    @property
    def n_all(self) -> int:
        return self.n_layers + self.n_nextn

    def is_dsa(self, layer: int) -> bool:
        return self.layer_types[layer] == DSA

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_lead

    def has_indexer(self, layer: int) -> bool:
        return layer >= self.n_layers or self.idx_full[layer]

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        if f.has(f.key("layer_types")):
            cfg = cls(**_read_ds4(f))
        elif f.has(f.key("attention.head_count_kv")):
            cfg = cls(**_read_llama(f))
        else:
            raise Ds4Error(f"{f.name}: missing metadata key {ARCH}.layer_types (ds4's layout) or "
                           f"{ARCH}.attention.head_count_kv (llama.cpp's) giving the KDA/DSA layer schedule")
        eh_proj = f.tensors.get(f"blk.{cfg.n_layers}.nextn.eh_proj.weight")
        cfg = replace(cfg, mtp_input=mtp_input_of(eh_proj.shape[0] if eh_proj else None, cfg.n_embd, cfg.hc))
        cfg.validate(f.name)
        return cfg

    def validate(self, where: str = "") -> None:
        where = f"{where}: " if where else ""

        def bad(key: str, msg: str):
            raise Ds4Error(f"{where}metadata key {ARCH}.{key} {msg}")

        check_ranges(self, lambda field: f"{ARCH}.{_COMMON[field][0] if field in _COMMON else _KEY_OF.get(field, field)}",
                     where)
        for name in ("n_layers", "n_embd", "n_vocab", "n_head", "key_length", "value_length", "q_lora_rank",
                     "kv_lora_rank", "kda_n_head", "kda_head_dim", "conv_kernel", "n_expert", "n_expert_used",
                     "n_ff_exp", "idx_n_head", "idx_head_dim", "idx_top_k", "hc"):
            if getattr(self, name) <= 0:
                bad(_KEY_OF.get(name, name), f"is {getattr(self, name)}; expected a positive integer")
        if len(self.layer_types) != self.n_all or any(t not in (KDA, DSA) for t in self.layer_types):
            key = "layer_types" if self.layout == DS4 else "attention.head_count_kv"
            bad(key, f"must hold {self.n_all} values of 0 (KDA) or 1 (DSA), one per layer "
                f"({self.n_layers} trunk + {self.n_nextn} MTP); got {list(self.layer_types)}")
        if any(t != DSA for t in self.layer_types[self.n_layers:]):
            bad("layer_types", "marks an MTP layer as KDA; the nextn block is a DSA layer")
        for name, values in (("swiglu_clamp_exp", self.swiglu_exp), ("swiglu_clamp_shexp", self.swiglu_shexp)):
            if len(values) != self.n_all:
                bad(name, f"has {len(values)} entries for {self.n_all} layers")
        if len(self.idx_full) != self.n_layers:
            bad("attention.indexer.types", f"has {len(self.idx_full)} entries for {self.n_layers} trunk layers")
        first_dsa = next((i for i in range(self.n_layers) if self.is_dsa(i)), None)
        if first_dsa is not None and not self.idx_full[first_dsa]:
            bad("attention.indexer.types", f"makes the first DSA layer ({first_dsa}) reuse a selection no layer made")
        if self.kda_n_head != self.n_head:
            bad("linear_attention.head_count", f"is {self.kda_n_head}; this engine needs the MLA head count {self.n_head}")
        if self.idx_pool < 2 or self.idx_top_k % self.idx_pool:
            bad("attention.indexer.pool_size" if self.layout == DS4 else "attention.indexer.kpool",
                f"is {self.idx_pool}; expected a pool of >= 2 tokens dividing top_k {self.idx_top_k}")
        if self.n_expert_used > self.n_expert:
            bad("expert_used_count", f"{self.n_expert_used} exceeds expert_count {self.n_expert}")
        if not 0 <= self.n_dense_lead <= self.n_all:
            bad("leading_dense_block_count", f"is {self.n_dense_lead}; expected 0..{self.n_all}")
        if self.n_dense_lead and self.n_ff <= 0:
            bad("feed_forward_length", f"is {self.n_ff}; the dense leading layers need a width")
        if self.hc != 4:
            bad("hyper_connection.count", f"is {self.hc}; GLM-5.3 has 4 streams")
        if self.n_nextn not in (0, 1):
            bad("nextn_predict_layers", f"is {self.n_nextn}; expected 0 or 1")
        if self.mtp_input not in _READS:
            raise Ds4Error(f"{where}MTP input {self.mtp_input!r}: expected one of {', '.join(_READS)}")

    def describe(self) -> dict:
        """What `ds4 inspect` prints of this config: layout, layer schedule, MTP layer."""
        kinds = "".join("D" if self.is_dsa(i) else "K" for i in range(self.n_layers))
        return {"layout": f"{self.layout} GGUF layout",
                "schedule": f"{kinds} (K = KDA, D = DSA; {self.n_dense_lead} dense leading layers)",
                "mtp layer": f"{self.n_layers} (nextn, DSA + MoE; reads {_READS[self.mtp_input]})"
                if self.n_nextn else "none"}

    def to_metadata(self, layout: str | None = None) -> dict:
        """GGUF metadata (full key names) in `layout` (default: the config's own), the inverse of
        `from_gguf`."""
        return (_write_ds4 if (layout or self.layout) == DS4 else _write_llama)(self)


_READS = {HIDDEN: "the output head's input, as llama.cpp's t_h_nextn",
          STREAMS: "the trunk's hc streams before they collapse, as ds4-spec §4"}


def mtp_input_of(eh_proj_width: int | None, n_embd: int, hc: int) -> str:
    """The MTP input an eh_proj of this input width reads (its shape is checked against it later)."""
    return STREAMS if eh_proj_width == (1 + hc) * n_embd else HIDDEN


# keys named in messages for fields whose key is the same in both layouts
_KEY_OF = {"n_layers": "block_count", "n_embd": "embedding_length", "n_vocab": "vocab_size",
           "n_head": "attention.head_count", "q_lora_rank": "attention.q_lora_rank",
           "kv_lora_rank": "attention.kv_lora_rank", "n_expert": "expert_count", "n_expert_used": "expert_used_count",
           "n_ff_exp": "expert_feed_forward_length", "idx_n_head": "attention.indexer.head_count",
           "idx_head_dim": "attention.indexer.key_length", "idx_top_k": "attention.indexer.top_k",
           "hc": "hyper_connection.count", "key_length": "attention.key_length",
           "value_length": "attention.value_length", "kda_n_head": "linear_attention.head_count",
           "kda_head_dim": "kda.head_dim", "conv_kernel": "ssm.conv_kernel"}

# the keys both layouts spell alike: field -> (key after the prefix, kind, default or None if required)
_COMMON = {
    "n_embd": ("embedding_length", "int", None),
    "n_vocab": ("vocab_size", "int", None),
    "n_ff": ("feed_forward_length", "int", 0),
    "n_ff_exp": ("expert_feed_forward_length", "int", None),
    "n_expert": ("expert_count", "int", None),
    "n_expert_used": ("expert_used_count", "int", None),
    "n_expert_shared": ("expert_shared_count", "int", None),
    "n_dense_lead": ("leading_dense_block_count", "int", 0),
    "expert_weights_scale": ("expert_weights_scale", "float", 1.0),
    "expert_weights_norm": ("expert_weights_norm", "bool", False),
    "rms_eps": ("attention.layer_norm_rms_epsilon", "float", None),
    "n_head": ("attention.head_count", "int", None),
    "q_lora_rank": ("attention.q_lora_rank", "int", None),
    "kv_lora_rank": ("attention.kv_lora_rank", "int", None),
    "idx_n_head": ("attention.indexer.head_count", "int", None),
    "idx_head_dim": ("attention.indexer.key_length", "int", None),
    "idx_top_k": ("attention.indexer.top_k", "int", None),
    "hc": ("hyper_connection.count", "int", None),
    "hc_sinkhorn_iters": ("hyper_connection.sinkhorn_iterations", "int", None),
    "hc_eps": ("hyper_connection.epsilon", "float", None),
    "context_length": ("context_length", "int", 1048576),
}


def _f32(v: float) -> float:
    """A float32 from the file as the shortest decimal that reads back to it (1e-5, not
    9.99999975e-06): the value its writer meant."""
    return float(str(np.float32(v)))


def _get(f: GGUFFile, key: str, kind: str, default=None):
    v = f.get(f.key(key), kind) if default is None else f.get(f.key(key), kind, default=default)
    return _f32(v) if kind == "float" and v is not None else v


def _optional_float(f: GGUFFile, key: str) -> float | None:
    return _get(f, key, "float") if f.has(f.key(key)) else None


def _common(f: GGUFFile) -> dict:
    return {field: _get(f, key, kind, default) for field, (key, kind, default) in _COMMON.items()}


def _no_rope(f: GGUFFile, *keys: str) -> None:
    for key in keys:
        v = f.get(f.key(key), "int", default=0)
        if v != 0:
            raise Ds4Error(f"{f.name}: metadata key {ARCH}.{key} is {v}; GLM-5.3's MLA has no RoPE part (0)")


def _per_layer(f: GGUFFile, key: str, n: int, default: float | None) -> tuple[float, ...]:
    """A float per layer: an array of n values, or one value for every layer."""
    full = f.key(key)
    if not f.has(full):
        if default is None:
            raise Ds4Error(f"{f.name}: missing required metadata key {full}")
        return (default,) * n
    try:
        values = f.get(full, "floats")
    except Ds4Error:
        values = [f.get(full, "float")] * n
    return tuple(_f32(v) for v in values)


def _read_ds4(f: GGUFFile) -> dict:
    _no_rope(f, "attention.rope_dimension_count", "rope.dimension_count")
    n_all, n_trunk = _get(f, "block_count", "int"), _get(f, "trunk_block_count", "int")
    limit = _get(f, "swiglu_limit", "float", 0.0)
    return dict(_common(f), layout=DS4, n_layers=n_trunk, n_nextn=n_all - n_trunk,
                key_length=_get(f, "attention.key_length", "int"), value_length=_get(f, "attention.value_length", "int"),
                idx_pool=_get(f, "attention.indexer.pool_size", "int"),
                kda_n_head=_get(f, "linear_attention.head_count", "int"),
                kda_head_dim=_get(f, "linear_attention.head_dimension", "int"),
                conv_kernel=_get(f, "linear_attention.conv_kernel", "int"),
                gate_lower_bound=_optional_float(f, "linear_attention.gate_lower_bound"),
                layer_types=tuple(_get(f, "layer_types", "ints")),
                swiglu_exp=(limit,) * n_all, swiglu_shexp=(limit,) * n_all, idx_full=(True,) * n_trunk)


def _read_llama(f: GGUFFile) -> dict:
    _no_rope(f, "rope.dimension_count")
    n_all = _get(f, "block_count", "int")
    n_nextn = _get(f, "nextn_predict_layers", "int", 0)
    schedule = f.get(f.key("attention.head_count_kv"), "ints")
    kv_lora = _get(f, "attention.kv_lora_rank", "int")
    key_length = f.get(f.key("attention.key_length"), "int", default=kv_lora)
    if key_length != kv_lora:
        raise Ds4Error(f"{f.name}: metadata key {ARCH}.attention.key_length is {key_length}; llama.cpp's layout "
                       f"caches the {kv_lora}-wide latent (kv_lora_rank)")
    exp = _per_layer(f, "swiglu_clamp_exp", n_all, 0.0)
    types = f.get(f.key("attention.indexer.types"), "bools", default=None)
    common = _common(f)
    return dict(common, layout=LLAMA, n_layers=n_all - n_nextn, n_nextn=n_nextn,
                key_length=_get(f, "attention.key_length_mla", "int"),
                value_length=_get(f, "attention.value_length_mla", "int"),
                idx_pool=_get(f, "attention.indexer.kpool", "int"),
                idx_select_tail=bool(f.get(f.key("attention.indexer.kpool_select_tail"), "bool", default=True)),
                idx_full=tuple(bool(t) for t in types) if types is not None else (True,) * (n_all - n_nextn),
                idx_norm_eps=_get(f, "attention.layer_norm_epsilon", "float", 1e-6),
                kda_n_head=common["n_head"], kda_head_dim=_get(f, "kda.head_dim", "int"),
                conv_kernel=_get(f, "ssm.conv_kernel", "int"),
                gate_lower_bound=_optional_float(f, "kda.gate_lower_bound"),
                layer_types=tuple(schedule), swiglu_exp=exp,
                swiglu_shexp=_per_layer(f, "swiglu_clamp_shexp", n_all, None) if f.has(f.key("swiglu_clamp_shexp"))
                else exp)


def _common_meta(c: Config) -> dict:
    meta = {f"{ARCH}.{key}": getattr(c, field) for field, (key, _, _) in _COMMON.items()}
    for field, (key, kind, _) in _COMMON.items():
        if kind == "float":
            meta[f"{ARCH}.{key}"] = float(getattr(c, field))
    meta[f"{ARCH}.block_count"] = c.n_all
    return meta


def _write_ds4(c: Config) -> dict:
    if len(set(c.swiglu_exp + c.swiglu_shexp)) > 1 or not all(c.idx_full) or not c.idx_select_tail:
        raise Ds4Error("this GLM config needs llama.cpp's layout: ds4's has one SwiGLU limit, every DSA layer "
                       "with its own indexer and the unfinished pool always selected")
    p = f"{ARCH}."
    meta = _common_meta(c)
    meta.update({p + "trunk_block_count": c.n_layers, p + "nextn_predict_layers": c.n_nextn,
                 p + "attention.key_length": c.key_length, p + "attention.value_length": c.value_length,
                 p + "attention.rope_dimension_count": 0, p + "attention.indexer.pool_size": c.idx_pool,
                 p + "linear_attention.head_count": c.kda_n_head, p + "linear_attention.head_dimension": c.kda_head_dim,
                 p + "linear_attention.conv_kernel": c.conv_kernel, p + "layer_types": list(c.layer_types),
                 p + "swiglu_limit": float(c.swiglu_exp[0] if c.swiglu_exp else 0.0)})
    if c.gate_lower_bound is not None:
        meta[p + "linear_attention.gate_lower_bound"] = float(c.gate_lower_bound)
    return meta


def _write_llama(c: Config) -> dict:
    p = f"{ARCH}."
    meta = _common_meta(c)
    meta.update({p + "nextn_predict_layers": c.n_nextn, p + "attention.head_count_kv": list(c.layer_types),
                 p + "attention.key_length": c.kv_lora_rank, p + "attention.value_length": c.kv_lora_rank,
                 p + "attention.key_length_mla": c.key_length, p + "attention.value_length_mla": c.value_length,
                 p + "rope.dimension_count": 0, p + "attention.indexer.kpool": c.idx_pool,
                 p + "attention.indexer.kpool_select_tail": c.idx_select_tail,
                 p + "attention.indexer.types": list(c.idx_full), p + "attention.layer_norm_epsilon": float(c.idx_norm_eps),
                 p + "kda.head_dim": c.kda_head_dim, p + "ssm.conv_kernel": c.conv_kernel,
                 p + "swiglu_clamp_exp": [float(x) for x in c.swiglu_exp],
                 p + "swiglu_clamp_shexp": [float(x) for x in c.swiglu_shexp],
                 p + "expert_gating_func": 2})   # sigmoid
    if c.gate_lower_bound is not None:
        meta[p + "kda.gate_lower_bound"] = float(c.gate_lower_bound)
    return meta
