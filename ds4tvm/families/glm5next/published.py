"""GLM-5.3-Flash at its published shapes (ds4-spec §1.4), in ds4's layout."""

from __future__ import annotations

from .config import DS4, DSA, KDA, Config

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
