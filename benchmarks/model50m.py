"""A DeepSeek-V4-shaped random model of >= 50M parameters (all layer kinds), for compile-time,
memory and speed measurements. Usage: python benchmarks/model50m.py OUT.gguf [q8_0|f16]"""

import sys

from gguf import GGMLQuantizationType as QT

from ds4tvm.families.deepseek4.random_model import default_type, tiny_config, write_random_deepseek4
from ds4tvm.gguf.validate import DENSE, EMBED, ROUTED


def config():
    return tiny_config(n_layers=8, n_embd=512, n_vocab=32768, n_head=8, head_dim=128, n_rot=64, q_lora_rank=256,
                       o_lora_rank=256, o_groups=4, n_expert=16, n_expert_used=4, n_ff_exp=384, n_hash_layers=2,
                       sliding_window=128, idx_n_head=16, idx_head_dim=64, idx_top_k=64,
                       compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128))


def type_of(spec, kind: str):
    """Q8_0 or F16 for the dense, routed and embedding matrices; the rest as the demo has them."""
    if spec.types in (DENSE, ROUTED, EMBED) and spec.shape[0] % 32 == 0:
        return QT.Q8_0 if kind == "q8_0" else QT.F16
    return default_type(spec)


def main():
    out, kind = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "q8_0")
    path = write_random_deepseek4(out, config(), seed=50, type_of=lambda s: type_of(s, kind), progress=True)
    from ds4tvm.gguf import open_gguf
    print(f"{path}: {open_gguf(path).n_params() / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
