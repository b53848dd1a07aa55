"""Qwen3.8 Flash Next hyper-parameters (`qwen4exp`, ds4-spec §1.5 and its Errata), under the key
names llama.cpp's loader reads (src/models/qwen4exp.cpp), which ds4's files share.

Layer kinds: `attention.compress_ratios` (0 = Gated DeltaNet, the QSA ratio for gated attention),
else every `full_attention_interval`-th layer is attention. The GDN output gate is a sigmoid (the
real checkpoint and llama.cpp); `ssm.output_gate_type` = "silu" switches it (transformers' fallback
when a config names none)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import Ds4Error
from ...gguf.reader import GGUFFile
from ...gguf.validate import check_ranges

ARCH = "qwen4exp"
GATE_TYPES = ("sigmoid", "silu")


@dataclass(frozen=True)
class Config:
    n_layers: int                   # trunk layers; the MTP (nextn) layer follows them
    n_nextn: int
    n_embd: int
    n_vocab: int
    rms_eps: float
    n_head: int
    n_head_kv: int
    head_dim: int                   # key_length == value_length
    n_rot: int                      # NEOX RoPE on the first n_rot channels of each head
    rope_base: float
    rope_sections: tuple[int, ...]
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    conv_kernel: int
    gdn_head_dim: int               # ssm.state_size: key and value head width
    gdn_k_heads: int                # ssm.group_count
    gdn_v_heads: int                # ssm.time_step_rank
    layer_ratios: tuple[int, ...]   # per layer (MTP included): 0 GDN, else the QSA pool ratio
    hc: int
    hc_rank: int
    idx_n_head: int
    idx_head_dim: int
    idx_top_k: int                  # tokens: top_k // ratio whole blocks
    ple_layers: tuple[int, ...] = ()
    ngram: int = 3
    heads_per_ngram: int = 8
    ple_conv_kernel: int = 4
    eos: int = 0
    multipliers: tuple[int, ...] = ()
    head_offsets: tuple[int, ...] = ()
    head_vocab_sizes: tuple[int, ...] = ()
    ple_width: int = 0              # embedding_length_per_layer_input: one table row
    ple_table_rows: int = 0         # the file's table (padded past the head ranges); 0: exactly those
    gate_type: str = "sigmoid"
    context_length: int = 262144

    @property
    def n_all(self) -> int:
        return self.n_layers + self.n_nextn

    @property
    def ple_heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    @property
    def ple_rows(self) -> int:
        """The table rows the head ranges address."""
        return max((o + v for o, v in zip(self.head_offsets, self.head_vocab_sizes)), default=0)

    def is_gdn(self, layer: int) -> bool:
        return self.layer_ratios[layer] == 0

    def ratio(self, layer: int) -> int:
        return self.layer_ratios[layer]

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        cfg = cls(**_read(f))
        cfg.validate(f.name)
        return cfg

    def validate(self, where: str = "") -> None:
        where = f"{where}: " if where else ""

        def bad(key: str, msg: str):
            raise Ds4Error(f"{where}metadata key {ARCH}.{key} {msg}")

        check_ranges(self, lambda field: f"{ARCH}.{_KEYS.get(field, (field,))[0]}", where)
        for field, key in _POSITIVE.items():
            if getattr(self, field) <= 0:
                bad(key, f"is {getattr(self, field)}; expected a positive integer")
        if len(self.layer_ratios) != self.n_all:
            bad("attention.compress_ratios", f"has {len(self.layer_ratios)} entries for {self.n_all} layers")
        if any(not self.ratio(i) for i in range(self.n_layers, self.n_all)):
            bad("attention.compress_ratios", "marks the MTP layer as GDN; the nextn block is an attention layer")
        if self.n_head % self.n_head_kv or self.gdn_v_heads % self.gdn_k_heads:
            bad("attention.head_count_kv" if self.n_head % self.n_head_kv else "ssm.group_count",
                "must divide the head count (attention heads by KV heads, GDN value heads by key heads)")
        if self.n_rot > self.head_dim or self.n_rot % 2 or self.n_rot > self.idx_head_dim:
            bad("rope.dimension_count", f"is {self.n_rot}; expected an even count <= the head width "
                f"{self.head_dim} and the index head width {self.idx_head_dim}")
        for i in range(self.n_all):
            if self.ratio(i) and self.idx_top_k % self.ratio(i):
                bad("attention.indexer.top_k", f"{self.idx_top_k} is not a multiple of layer {i}'s ratio {self.ratio(i)}")
        if self.n_expert_used > self.n_expert:
            bad("expert_used_count", f"{self.n_expert_used} exceeds expert_count {self.n_expert}")
        if self.gate_type not in GATE_TYPES:
            bad("ssm.output_gate_type", f"is {self.gate_type!r}; expected one of {', '.join(GATE_TYPES)}")
        if self.n_nextn not in (0, 1):
            bad("nextn_predict_layers", f"is {self.n_nextn}; expected 0 or 1")
        self._validate_ple(bad)

    def _validate_ple(self, bad) -> None:
        if not self.ple_layers:
            return
        if len(self.ple_layers) != 1 or not 0 <= self.ple_layers[0] < self.n_layers \
                or not self.is_gdn(self.ple_layers[0]):
            bad("ple.layers", f"is {list(self.ple_layers)}; expected one trunk GDN layer")
        if self.ngram < 2 or self.heads_per_ngram <= 0 or self.ple_conv_kernel <= 0 or self.ple_width <= 0:
            bad("ple.ngram_size", f"{self.ngram}, heads_per_ngram {self.heads_per_ngram}, conv_kernel "
                f"{self.ple_conv_kernel}, embedding_length_per_layer_input {self.ple_width}: expected n-grams "
                f">= 2 and positive counts")
        if self.ple_heads * self.ple_width != self.n_embd:
            bad("embedding_length_per_layer_input", f"is {self.ple_width}; {self.ple_heads} heads of it must "
                f"make the embedding width {self.n_embd}")
        for key, values, n in (("ple.layer_multipliers", self.multipliers, self.ngram),
                               ("ple.head_offsets", self.head_offsets, self.ple_heads),
                               ("ple.head_vocab_sizes", self.head_vocab_sizes, self.ple_heads)):
            if len(values) < n:
                bad(key, f"has {len(values)} entries; expected {n}")
        if any(v <= 0 for v in self.head_vocab_sizes) or any(o < 0 for o in self.head_offsets):
            bad("ple.head_vocab_sizes", "must be positive (and ple.head_offsets non-negative)")
        if any(m <= 0 or m * self.n_vocab >= 2 ** 63 for m in self.multipliers):
            bad("ple.layer_multipliers", f"must be positive and below 2^63 / vocab ({self.n_vocab}); got "
                f"{list(self.multipliers)}")
        if self.ple_table_rows and self.ple_table_rows < self.ple_rows:
            bad("ple.head_offsets", f"+ head_vocab_sizes address {self.ple_rows} table rows, but tensor "
                f"per_layer_token_embd.weight has {self.ple_table_rows}")
        if not 0 <= self.eos < self.n_vocab:
            bad("ple.eos_token_id", f"is {self.eos}; expected a token id below {self.n_vocab}")

    def describe(self) -> dict:
        """`ds4 inspect`'s lines: the layer pattern, the PLE table, the MTP layer."""
        kinds = "".join("G" if self.is_gdn(i) else "A" for i in range(self.n_layers))
        out = {"schedule": f"{kinds} (G = Gated DeltaNet, A = gated attention with the QSA indexer)"}
        if self.ple_layers:
            out["ple"] = (f"layer {self.ple_layers[0]}: {self.ple_heads} heads x {self.ple_width}, "
                          f"{self.ple_rows} table rows")
        out["mtp layer"] = f"{self.n_layers} (nextn, attention + MoE)" if self.n_nextn else "none"
        return out

    def to_metadata(self) -> dict:
        p = f"{ARCH}."
        meta = {p + key: getattr(self, field) for field, (key, _, _) in _KEYS.items()}
        meta.update({p + "block_count": self.n_all, p + "attention.key_length": self.head_dim,
                     p + "attention.value_length": self.head_dim, p + "ssm.inner_size": self.gdn_v_heads * self.gdn_head_dim,
                     p + "attention.compress_ratios": list(self.layer_ratios),
                     p + "rope.dimension_sections": list(self.rope_sections),
                     p + "ssm.output_gate_type": self.gate_type})
        for field, (key, kind, _) in _KEYS.items():
            if kind == "float":
                meta[p + key] = float(getattr(self, field))
        if self.ple_layers:
            meta.update({p + "ple.layers": list(self.ple_layers), p + "ple.ngram_size": self.ngram,
                         p + "ple.heads_per_ngram": self.heads_per_ngram, p + "ple.conv_kernel": self.ple_conv_kernel,
                         p + "ple.eos_token_id": self.eos, p + "ple.layer_multipliers": list(self.multipliers),
                         p + "ple.head_offsets": list(self.head_offsets),
                         p + "ple.head_vocab_sizes": list(self.head_vocab_sizes),
                         p + "embedding_length_per_layer_input": self.ple_width})
        return meta


_POSITIVE = {"n_layers": "block_count", "n_embd": "embedding_length", "n_vocab": "vocab_size",
             "n_head": "attention.head_count", "n_head_kv": "attention.head_count_kv",
             "head_dim": "attention.key_length", "n_expert": "expert_count", "n_expert_used": "expert_used_count",
             "n_ff_exp": "expert_feed_forward_length", "n_ff_shexp": "expert_shared_feed_forward_length",
             "conv_kernel": "ssm.conv_kernel", "gdn_head_dim": "ssm.state_size", "gdn_k_heads": "ssm.group_count",
             "gdn_v_heads": "ssm.time_step_rank", "hc": "hyper_connection.count", "hc_rank": "hyper_connection.low_rank",
             "idx_n_head": "attention.indexer.head_count", "idx_head_dim": "attention.indexer.key_length",
             "idx_top_k": "attention.indexer.top_k", "n_rot": "rope.dimension_count"}

# field -> (key after the prefix, kind, default or None if required)
_KEYS = {
    "n_embd": ("embedding_length", "int", None), "n_vocab": ("vocab_size", "int", None),
    "rms_eps": ("attention.layer_norm_rms_epsilon", "float", None),
    "n_head": ("attention.head_count", "int", None), "n_head_kv": ("attention.head_count_kv", "int", None),
    "n_rot": ("rope.dimension_count", "int", None), "rope_base": ("rope.freq_base", "float", None),
    "n_expert": ("expert_count", "int", None), "n_expert_used": ("expert_used_count", "int", None),
    "n_ff_exp": ("expert_feed_forward_length", "int", None),
    "n_ff_shexp": ("expert_shared_feed_forward_length", "int", None),
    "conv_kernel": ("ssm.conv_kernel", "int", None), "gdn_head_dim": ("ssm.state_size", "int", None),
    "gdn_k_heads": ("ssm.group_count", "int", None), "gdn_v_heads": ("ssm.time_step_rank", "int", None),
    "hc": ("hyper_connection.count", "int", None), "hc_rank": ("hyper_connection.low_rank", "int", None),
    "idx_n_head": ("attention.indexer.head_count", "int", None),
    "idx_head_dim": ("attention.indexer.key_length", "int", None),
    "idx_top_k": ("attention.indexer.top_k", "int", None),
    "n_nextn": ("nextn_predict_layers", "int", 0), "context_length": ("context_length", "int", 262144),
}


def _f32(v: float) -> float:
    return float(str(np.float32(v)))


def _get(f: GGUFFile, key: str, kind: str, default=None):
    v = f.get(f.key(key), kind) if default is None else f.get(f.key(key), kind, default=default)
    return _f32(v) if kind == "float" else v


def _read(f: GGUFFile) -> dict:
    out = {field: _get(f, key, kind, default) for field, (key, kind, default) in _KEYS.items()}
    n_all = _get(f, "block_count", "int")
    out["n_layers"] = n_all - out["n_nextn"]
    head_dim = _get(f, "attention.key_length", "int")
    if f.get(f.key("attention.value_length"), "int", default=head_dim) != head_dim:
        raise Ds4Error(f"{f.name}: metadata key {ARCH}.attention.value_length differs from attention.key_length "
                       f"{head_dim}; Qwen3.8's attention heads have one width")
    inner = _get(f, "ssm.inner_size", "int")
    if inner != out["gdn_v_heads"] * out["gdn_head_dim"]:
        raise Ds4Error(f"{f.name}: metadata key {ARCH}.ssm.inner_size is {inner}; expected time_step_rank x "
                       f"state_size = {out['gdn_v_heads'] * out['gdn_head_dim']}")
    out["head_dim"] = head_dim
    out["rope_sections"] = tuple(f.get(f.key("rope.dimension_sections"), "ints", default=[]))
    out["gate_type"] = f.get(f.key("ssm.output_gate_type"), "str", default="sigmoid")
    out["layer_ratios"] = _layer_ratios(f, n_all, out["n_layers"])
    if f.has(f.key("ple.layers")):
        out.update(ple_layers=tuple(_get(f, "ple.layers", "ints")), ngram=_get(f, "ple.ngram_size", "int"),
                   heads_per_ngram=_get(f, "ple.heads_per_ngram", "int"), ple_conv_kernel=_get(f, "ple.conv_kernel", "int"),
                   eos=_get(f, "ple.eos_token_id", "int"), multipliers=tuple(_get(f, "ple.layer_multipliers", "ints")),
                   head_offsets=tuple(_get(f, "ple.head_offsets", "ints")),
                   head_vocab_sizes=tuple(_get(f, "ple.head_vocab_sizes", "ints")),
                   ple_width=_get(f, "embedding_length_per_layer_input", "int"))
        table = f.tensors.get("per_layer_token_embd.weight")
        out["ple_table_rows"] = table.shape[1] if table is not None and len(table.shape) == 2 else 0
    return out


def _layer_ratios(f: GGUFFile, n_all: int, n_trunk: int) -> tuple[int, ...]:
    if f.has(f.key("attention.compress_ratios")):
        return tuple(_get(f, "attention.compress_ratios", "ints"))
    interval = _get(f, "full_attention_interval", "int", 4)
    if interval <= 0:
        raise Ds4Error(f"{f.name}: metadata key {ARCH}.full_attention_interval is {interval}; expected a positive integer")
    return tuple(0 if i < n_trunk and (i + 1) % interval else 4 for i in range(n_all))
