"""DeepSeek-V4-Flash hyper-parameters, read from GGUF metadata (ds4-spec §1.1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...errors import Ds4Error
from ...gguf.reader import GGUFFile
from ...gguf.validate import check_ranges

ARCH = "deepseek4"
SQRT_SOFTPLUS_GATING = 4  # llama.cpp's expert_gating_func value for sqrt(softplus)


@dataclass(frozen=True)
class Config:
    n_layers: int
    n_embd: int
    n_vocab: int
    n_head: int
    head_dim: int                   # one shared K=V row per token (key_length == value_length)
    n_rot: int                      # RoPE'd tail of each head
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_hash_layers: int              # the first n_hash_layers layers route through tid2eid
    sliding_window: int
    idx_n_head: int
    idx_head_dim: int
    idx_top_k: int
    hc: int                         # hyper-connection streams
    hc_sinkhorn_iters: int
    hc_eps: float
    rope_base: float
    compress_rope_base: float
    yarn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_orig_ctx: int
    expert_weights_scale: float
    expert_weights_norm: bool
    rms_eps: float
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...]
    # The trained context; informational here (ds4tvm's bound is --max-context), but llama.cpp
    # requires the key, so GGUFs we write carry it. Flash: 1048576.
    context_length: int = 1048576

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    # GGUF keys of each field (after the `deepseek4.` prefix), with aliases the reference accepts.
    KEYS = {
        "n_layers": ("block_count", "int"),
        "n_embd": ("embedding_length", "int"),
        "n_vocab": ("vocab_size", "int"),
        "n_head": ("attention.head_count", "int"),
        "head_dim": ("attention.key_length", "int"),
        "n_rot": ("rope.dimension_count", "int"),
        "q_lora_rank": ("attention.q_lora_rank", "int"),
        "o_lora_rank": ("attention.output_lora_rank", "int"),
        "o_groups": ("attention.output_group_count", "int"),
        "n_expert": ("expert_count", "int"),
        "n_expert_used": ("expert_used_count", "int"),
        "n_ff_exp": ("expert_feed_forward_length", "int"),
        "n_expert_shared": ("expert_shared_count", "int"),
        "n_hash_layers": ("hash_layer_count", "int"),
        "sliding_window": ("attention.sliding_window", "int"),
        "idx_n_head": ("attention.indexer.head_count", "int"),
        "idx_head_dim": ("attention.indexer.key_length", "int"),
        "idx_top_k": ("attention.indexer.top_k", "int"),
        "hc": ("hyper_connection.count", "int"),
        "hc_sinkhorn_iters": ("hyper_connection.sinkhorn_iterations", "int"),
        "hc_eps": ("hyper_connection.epsilon", "float"),
        "rope_base": ("rope.freq_base", "float"),
        "compress_rope_base": ("attention.compress_rope_freq_base", "float"),
        "yarn_factor": ("rope.scaling.factor", "float"),
        "yarn_beta_fast": ("rope.scaling.yarn_beta_fast", "float"),
        "yarn_beta_slow": ("rope.scaling.yarn_beta_slow", "float"),
        "yarn_orig_ctx": ("rope.scaling.original_context_length", "int"),
        "expert_weights_scale": ("expert_weights_scale", "float"),
        "expert_weights_norm": ("expert_weights_norm", "bool"),
        "rms_eps": ("attention.layer_norm_rms_epsilon", "float"),
        "compress_ratios": ("attention.compress_ratios", "ints"),
        "swiglu_clamp": ("swiglu_clamp_exp", "floats"),
    }

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        values = {}
        for field, (key, kind) in cls.KEYS.items():
            if field == "n_vocab" and not f.has(f.key(key)):
                # Absent in some converters' output; the embedding's row count is the vocabulary.
                emb = f.tensors.get("token_embd.weight")
                if emb is not None and len(emb.shape) == 2:
                    values[field] = emb.shape[1]
                    continue
            values[field] = f.get(f.key(key), kind)
        values["context_length"] = f.get(f.key("context_length"), "int", default=cls.context_length)
        values["compress_ratios"] = tuple(values["compress_ratios"])
        values["swiglu_clamp"] = tuple(values["swiglu_clamp"])
        cfg = cls(**values)
        cfg.validate(f, _check_extra_keys=True)
        return cfg

    def validate(self, f: GGUFFile | None = None, _check_extra_keys: bool = False) -> None:
        where = f"{f.name}: " if f is not None else ""
        p = f"{ARCH}."

        def bad(key: str, msg: str):
            raise Ds4Error(f"{where}metadata key {p}{key} {msg}")

        if f is not None and _check_extra_keys:
            v = f.get(f.key("attention.head_count_kv"), "int", default=1)
            if v != 1:
                bad("attention.head_count_kv", f"is {v}; DeepSeek-V4 has one shared KV head")
            v = f.get(f.key("attention.value_length"), "int", default=self.head_dim)
            if v != self.head_dim:
                bad("attention.value_length", f"is {v}; it must equal key_length {self.head_dim} (K = V)")
            v = f.get(f.key("expert_gating_func"), "int", default=SQRT_SOFTPLUS_GATING)
            if v != SQRT_SOFTPLUS_GATING:
                bad("expert_gating_func", f"is {v}; DeepSeek-V4 routes with sqrt(softplus) (4)")
            for key in ("expert_group_count", "expert_group_used_count"):
                v = f.get(f.key(key), "int", default=0)
                if v not in (0, 1):
                    bad(key, f"is {v}; grouped routing is not part of DeepSeek-V4")
        check_ranges(self, lambda field: p + self.KEYS.get(field, (field,))[0], where)
        for field in ("n_layers", "n_embd", "n_vocab", "n_head", "head_dim", "q_lora_rank",
                      "o_lora_rank", "o_groups", "n_expert", "n_expert_used", "n_ff_exp", "hc",
                      "sliding_window"):
            if getattr(self, field) <= 0:
                bad(self.KEYS[field][0], f"is {getattr(self, field)}; expected a positive integer")
        if len(self.compress_ratios) != self.n_layers:
            bad("attention.compress_ratios", f"has {len(self.compress_ratios)} entries for "
                f"{self.n_layers} layers")
        if any(r not in (0, 4, 128) for r in self.compress_ratios):
            bad("attention.compress_ratios", f"holds {sorted(set(self.compress_ratios))}; "
                "expected 0, 4 or 128 per layer")
        if len(self.swiglu_clamp) != self.n_layers:
            bad("swiglu_clamp_exp", f"has {len(self.swiglu_clamp)} entries for {self.n_layers} layers")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            bad("rope.dimension_count", f"is {self.n_rot}; expected an even count <= key_length {self.head_dim}")
        if self.n_head % self.o_groups:
            bad("attention.output_group_count", f"{self.o_groups} does not divide the {self.n_head} heads")
        if self.n_expert_used > self.n_expert:
            bad("expert_used_count", f"{self.n_expert_used} exceeds expert_count {self.n_expert}")
        if not 0 <= self.n_hash_layers <= self.n_layers:
            bad("hash_layer_count", f"is {self.n_hash_layers}; expected 0..{self.n_layers}")
        if any(self.compress_ratios) and (self.idx_n_head <= 0 or self.idx_head_dim <= 0 or self.idx_top_k <= 0):
            bad("attention.indexer.head_count", "and the indexer key_length/top_k must be positive "
                "when layers are compressed")
        if self.idx_head_dim % 2 or self.n_rot > self.idx_head_dim:
            bad("attention.indexer.key_length", f"is {self.idx_head_dim}; expected an even size >= "
                f"rope.dimension_count {self.n_rot}")

    def to_metadata(self) -> dict:
        """GGUF metadata (full key names) for this config, the inverse of `from_gguf`."""
        d = asdict(self)
        meta = {f"{ARCH}.{key}": d[field] for field, (key, _) in self.KEYS.items()}
        meta[f"{ARCH}.context_length"] = self.context_length
        # ds4 implies YaRN on the compressed layers; llama.cpp needs the type spelled out.
        meta[f"{ARCH}.rope.scaling.type"] = "yarn" if self.yarn_factor != 1.0 else "none"
        meta[f"{ARCH}.attention.head_count_kv"] = 1
        meta[f"{ARCH}.attention.value_length"] = self.head_dim
        meta[f"{ARCH}.expert_gating_func"] = SQRT_SOFTPLUS_GATING
        meta[f"{ARCH}.attention.compress_ratios"] = list(self.compress_ratios)
        meta[f"{ARCH}.swiglu_clamp_exp"] = [float(x) for x in self.swiglu_clamp]
        for k in ("hc_eps", "rope_base", "compress_rope_base", "yarn_factor", "yarn_beta_fast",
                  "yarn_beta_slow", "expert_weights_scale", "rms_eps"):
            meta[f"{ARCH}.{self.KEYS[k][0]}"] = float(d[k])
        return meta
