"""A DeepSeek-V4-shaped random model of >= 50M parameters (all layer kinds), for compile-time,
memory and speed measurements, in the formats the real models ship in; or a GLM-5.3-shaped one
(`glm`: 8 trunk layers KKKD KKKD with the MTP layer, width 512, 16 experts top-4, Q2 recipe), or a
Qwen3.8-shaped one (`qwen`: 8 trunk layers GGGA GGGA + the MTP layer, width 512, 16 experts top-4, PLE on layer 1
with 16 heads of 32 over an 800k-row BF16 n-gram table, the Q4K recipe: Q4_K gate/up, MXFP4 down,
BF16 embeddings, Q8_0 elsewhere, F16/F32 HC mixers). Usage:
    python benchmarks/model50m.py OUT.gguf [q8_0|f16|q4_k|q2|mxfp4|glm|qwen] [--layers N]

--layers N (DeepSeek-V4 kinds): N layers instead of 8 (two uncompressed, then ratios 4 and 128 in
turn), a larger model of the same shapes: 32 layers make 517M parameters, 555 MB in Q8_0, past
what this machine's last-level cache holds (its decode reads memory; BENCHMARKS.md).

Expert width 512, so that every variant holds the same matrices (K-quants need rows of 256):
  q8_0, f16  the dense, routed and embedding matrices in that type;
  q4_k       dense and routed Q4_K (quantized from the random values, so the model stays sane);
  q2         the published Q2 recipe (published.q2_recipe_type: IQ2_XXS gate/up experts, Q2_K
             down experts, Q8_0 attention, shared experts and output; random valid IQ2/Q2 blocks);
  mxfp4      routed experts MXFP4, the rest as q8_0."""

import sys

from gguf import GGMLQuantizationType as QT

from ds4tvm.families.deepseek4.published import q2_recipe_type
from ds4tvm.families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
from ds4tvm.gguf.validate import DENSE, EMBED, ROUTED

KINDS = ("q8_0", "f16", "q4_k", "q2", "mxfp4", "glm", "qwen")


def config(**overrides):
    return tiny_config(**{**dict(n_layers=8, n_embd=512, n_vocab=32768, n_head=8, head_dim=128, n_rot=64,
                                 q_lora_rank=256, o_lora_rank=256, o_groups=4, n_expert=16, n_expert_used=4,
                                 n_ff_exp=512, n_hash_layers=2, sliding_window=128, idx_n_head=16, idx_head_dim=64,
                                 idx_top_k=64, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128)), **overrides})


def type_of(spec, kind: str) -> QT:
    if kind == "q2":
        return q2_recipe_type(spec)
    big = spec.types in (DENSE, ROUTED, EMBED) and spec.shape[0] % 32 == 0
    if kind == "mxfp4" and spec.types == ROUTED:
        return QT.MXFP4
    if kind == "q4_k" and spec.types in (DENSE, ROUTED) and spec.shape[0] % 256 == 0:
        return QT.Q4_K
    if big:
        return QT.F16 if kind == "f16" else QT.Q8_0
    return default_type(spec)


def glm_config():
    from ds4tvm.families.glm5next.random_model import tiny_config as glm_tiny

    types = (0, 0, 0, 1) * 2 + (1,)
    return glm_tiny(n_layers=8, n_embd=512, n_vocab=32768, n_ff=1024, n_ff_exp=512, n_expert=16, n_expert_used=4,
                    n_head=8, key_length=64, value_length=64, q_lora_rank=256, kv_lora_rank=256, idx_n_head=16,
                    idx_head_dim=64, idx_top_k=64, kda_n_head=8, kda_head_dim=64, layer_types=types,
                    swiglu_exp=(10.0,) * 9, swiglu_shexp=(10.0,) * 9, idx_full=(True,) * 8)


def qwen_config():
    from ds4tvm.families.qwen4exp.random_model import hash_constants
    from ds4tvm.families.qwen4exp.random_model import tiny_config as qwen_tiny

    return qwen_tiny(n_embd=512, n_vocab=32768, n_head=8, n_head_kv=2, head_dim=64, n_rot=32, n_expert=16,
                     n_expert_used=4, n_ff_exp=512, n_ff_shexp=512, gdn_head_dim=64, gdn_k_heads=4, gdn_v_heads=8,
                     hc_rank=64, idx_n_head=8, idx_head_dim=64, idx_top_k=64, heads_per_ngram=8, ple_width=32, eos=2,
                     ple_table_rows=0, n_nextn=1, **hash_constants(32768, 3, 16, 50000))


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("kind", nargs="?", default="q8_0", choices=KINDS)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    out, kind = a.out, a.kind
    if a.layers < 2 or a.layers % 2 or (a.layers != 8 and kind in ("glm", "qwen")):
        sys.exit("model50m.py: --layers takes an even count >= 2, for the DeepSeek-V4 kinds")
    if kind == "glm":
        from ds4tvm.families.glm5next.published import q2_recipe_type as glm_q2
        from ds4tvm.families.glm5next.random_model import write_random_glm5next

        path = write_random_glm5next(out, glm_config(), seed=50, type_of=glm_q2)
    elif kind == "qwen":
        from ds4tvm.families.qwen4exp.published import q4k_recipe_type
        from ds4tvm.families.qwen4exp.random_model import write_random_qwen4exp

        path = write_random_qwen4exp(out, qwen_config(), seed=50, type_of=q4k_recipe_type)
    else:
        cfg = config(n_layers=a.layers, compress_ratios=(0, 0) + (4, 128) * (a.layers // 2 - 1))
        path = write_random_deepseek4(out, cfg, seed=50, type_of=lambda s: type_of(s, kind), progress=True)
    from ds4tvm.gguf import open_gguf
    print(f"{path}: {open_gguf(path).n_params() / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
