"""What a real model needs in memory, from the published shapes (no file): the GGUF's weight bytes
for each family's recipe (what stays mapped: RAM on a CPU, GPU memory on a GPU) and the state one
sequence holds at a given context (rings, snapshot slots, tables), as the compiled module declares
it. Prints the README's table.

    .venv/bin/python scripts/model_sizes.py [--ctx 4096 32768]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGML_QUANT_SIZES

from ds4tvm.artifact import Bounds
from ds4tvm.families import family_named, load_attr

MODELS = (("deepseek4", "DeepSeek-V4-Flash + DSpark", "Q2 recipe"), ("glm5next", "GLM-5.3-Flash + MTP", "Q2 recipe"),
          ("qwen4exp", "Qwen3.8 Flash Next + MTP", "Q4K recipe"))


def weight_bytes(specs, types: dict, keep) -> int:
    total = 0
    for s in specs:
        if keep(s.name):
            block, size = GGML_QUANT_SIZES[types[s.name]]
            total += int(np.prod(s.shape)) // block * size
    return total


def model_bytes(family: str, ctx: int) -> tuple[int, int, int]:
    """(bytes of the weights the compiled module binds, of tensors read from the file as needed (a
    host input's table), and of one sequence's state at ctx)."""
    fam = family_named(family)
    req = load_attr(fam.published)()
    bounds = Bounds(max_context=ctx, max_verify=fam.default_bounds.max_verify)
    build = load_attr(fam.build)(type(req)(**{**req.__dict__, "bounds": bounds}))
    bound = {name for name, _, _ in build.sources.values()}
    files = [(fam.tensor_specs(req.config), req.types)]
    if req.support is not None:
        files.append((req.support.tensor_specs(req.support_config), req.support_types))
    resident = sum(weight_bytes(specs, types, bound.__contains__) for specs, types in files)
    lazy = sum(weight_bytes(specs, types, lambda n: n not in bound) for specs, types in files)
    state = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in build.states)
    return resident, lazy, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    args = ap.parse_args()
    gb = 1e9
    print("| model | recipe | weights mapped | read from the file as needed | "
          + " | ".join(f"state at {c // 1024}k context" for c in args.ctx) + " |")
    print("|---|---|---|---|" + "---|" * len(args.ctx))
    for family, title, recipe in MODELS:
        sizes = [model_bytes(family, c) for c in args.ctx]
        states = " | ".join(f"{s / gb:.2f} GB" for _, _, s in sizes)
        lazy = f"{sizes[0][1] / gb:.1f} GB" if sizes[0][1] else "-"
        print(f"| {title} | {recipe} | {sizes[0][0] / gb:.1f} GB | {lazy} | {states} |")


if __name__ == "__main__":
    main()
