"""Qwen3.8 Flash Next at its published shapes (ds4-spec §1.5) and the tensor types of its Q4K-imatrix
recipe: what `ds4-compile --shapes-only --family qwen4exp` compiles, without weights, with the MTP
layer (block 48) of the integrated GGUFs."""

from __future__ import annotations

from gguf import GGMLQuantizationType as QT

from ...gguf.validate import NORM, PLAIN, ROUTED, TensorSpec
from .config import Config
from .ple import TABLE
from .random_model import hash_constants

N_TRUNK = 48


def published_config() -> Config:
    return Config(n_layers=N_TRUNK, n_nextn=1, n_embd=2560, n_vocab=248320, rms_eps=1e-6, n_head=24, n_head_kv=2,
                  head_dim=256, n_rot=64, rope_base=1e7, rope_sections=(11, 11, 10, 0), n_expert=512, n_expert_used=10,
                  n_ff_exp=640, n_ff_shexp=640, conv_kernel=4, gdn_head_dim=128, gdn_k_heads=16, gdn_v_heads=48,
                  layer_ratios=tuple(4 if (i + 1) % 4 == 0 or i == N_TRUNK else 0 for i in range(N_TRUNK + 1)),
                  hc=4, hc_rank=320, idx_n_head=4, idx_head_dim=128, idx_top_k=2048, ple_layers=(1,), ngram=3,
                  heads_per_ngram=8, ple_conv_kernel=4, eos=248044, ple_width=160, context_length=262144,
                  **hash_constants(248320, 3, 16, 20_000_000))


def q4k_recipe_type(spec: TensorSpec) -> QT:
    """The Q4K-imatrix recipe of ds4-spec §1.5: routed gate/up Q4_K and down MXFP4 (640 is not a
    multiple of 256), BF16 embeddings (token and n-gram), F16 HC mixers and router, F32 norms and
    vectors, Q8_0 for the GDN, QSA, shared-expert and output matrices."""
    if spec.types == ROUTED:
        return QT.MXFP4 if "down" in spec.name else QT.Q4_K
    if spec.name in ("token_embd.weight", TABLE):
        return QT.BF16
    if spec.types == NORM:
        return QT.F32
    if spec.types == PLAIN or spec.shape[0] % 32:
        return QT.F16
    return QT.Q8_0
