"""GLM-5.3-Flash at its published shapes (ds4-spec §1.4), in ds4's layout, and the tensor types of
its Q2 recipe: what `ds4-compile --shapes-only` compiles, without weights."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QT

from ...gguf.validate import NORM, PLAIN, TensorSpec
from .config import DS4, DSA, KDA, Config
from .tensors import suffix_of

N_TRUNK = 45


def published_config() -> Config:
    types = tuple(DSA if layer % 4 == 3 else KDA for layer in range(N_TRUNK)) + (DSA,)   # + the MTP layer 45
    return Config(layout=DS4, n_layers=N_TRUNK, n_nextn=1, n_embd=4096, n_vocab=154880, n_ff=12288, n_ff_exp=2048,
                  n_expert=288, n_expert_used=8, n_expert_shared=1, n_dense_lead=3, expert_weights_scale=2.5,
                  expert_weights_norm=True, rms_eps=1e-5, n_head=64, key_length=256, value_length=256,
                  q_lora_rank=1536, kv_lora_rank=512, idx_n_head=32, idx_head_dim=128, idx_top_k=2048, idx_pool=4,
                  kda_n_head=64, kda_head_dim=128, conv_kernel=4, gate_lower_bound=-5.0, layer_types=types,
                  swiglu_exp=(10.0,) * len(types), swiglu_shexp=(10.0,) * len(types), hc=4, hc_sinkhorn_iters=20,
                  hc_eps=1e-6, idx_full=(True,) * N_TRUNK)


def q2_recipe_type(spec: TensorSpec) -> QT:
    """The Q2 recipe of ds4-spec §1.4: embedding, output, DSA projections, the other KDA projections,
    shared and dense FFNs Q8_0; KDA q/k Q4_K; HC fn, indexer and eh_proj BF16; router, convs and
    norms F32; routed gate/up IQ2_XXS and down Q2_K."""
    s = suffix_of(spec.name)
    if s in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
        return QT.IQ2_XXS
    if s == "ffn_down_exps.weight":
        return QT.Q2_K
    if s in ("kda_q.weight", "kda_k.weight"):
        return QT.Q4_K
    if s.startswith(("hc_", "indexer.", "nextn.eh_proj")) and spec.types != NORM:
        return QT.BF16
    if spec.types in (NORM, PLAIN):   # norms, biases, convs, A_log, ape, the router
        return QT.F32
    return QT.Q8_0
