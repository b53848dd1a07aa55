"""The structural hash of every PrimFunc the compile pipelines produce for the tiny models of each
family and drafter, on the CPU (llvm, with and without int8 activations, and the GPU forms built
for llvm) and for cuda:sm_90 (lowering only: no GPU needed). A restructuring that means to leave
the kernels alone shows it by printing the same JSON before and after:

    python scripts/primfunc_hashes.py > before.json   # on the old commit
    python scripts/primfunc_hashes.py > after.json
    diff before.json after.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

CASES = [   # (name, writer, target, compile options)
    ("deepseek4+dspark", "dspark", "llvm", {}),
    ("deepseek4+dspark", "dspark", "llvm", {"gpu_forms": True}),
    ("deepseek4+dspark", "dspark", "cuda:sm_90", {}),
    ("deepseek4+mtp", "mtp", "llvm", {}),
    ("deepseek4", "k_quant", "cpu", {"int8_activations": True}),
    ("glm5next+mtp", "glm", "llvm", {}),
    ("glm5next+mtp", "glm", "cuda:sm_90", {}),
    ("qwen4exp+mtp", "qwen", "llvm", {}),
    ("qwen4exp+mtp", "qwen", "cuda:sm_90", {}),
]


class _Lowered(Exception):
    def __init__(self, mod):
        self.mod = mod


def write_model(kind: str, d: Path) -> tuple[Path, Path | None]:
    from ds4tvm.families.deepseek4.random_model import k_quant_config, tiny_config, write_random_deepseek4

    if kind in ("dspark", "mtp"):
        cfg = tiny_config()
        target = write_random_deepseek4(d / "ds4.gguf", cfg, seed=1)
        if kind == "dspark":
            from ds4tvm.families.dspark.random_model import write_random_dspark
            return target, write_random_dspark(d / "dspark.gguf", cfg, seed=2)
        from ds4tvm.families.deepseek4_mtp.random_model import write_random_mtp
        return target, write_random_mtp(d / "mtp.gguf", cfg, seed=2)
    if kind == "k_quant":
        from ds4tvm.families.deepseek4.random_model import published_recipe_type
        return write_random_deepseek4(d / "kq.gguf", k_quant_config(), seed=3, type_of=published_recipe_type), None
    if kind == "glm":
        from ds4tvm.families.glm5next.random_model import tiny_config as glm_config, write_random_glm5next
        return write_random_glm5next(d / "glm.gguf", glm_config(), seed=4), None
    from ds4tvm.families.qwen4exp.random_model import tiny_config as qwen_config, write_random_qwen4exp
    return write_random_qwen4exp(d / "qwen.gguf", qwen_config(), seed=5), None


def lowered_hashes(gguf: Path, support: Path | None, target: str, options: dict, out: Path) -> dict:
    """{PrimFunc name: structural hash} of the module the pipeline hands to tvm.compile; not the VM's
    shape functions (VMShapeLower's bookkeeping of symbolic shapes, whose names and hashes change
    from run to run)."""
    import tvm
    import tvm_ffi

    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import CompileRequest, compile_gguf

    real = tvm.compile

    def capture(mod, *args, **kwargs):
        raise _Lowered(mod)

    tvm.compile = capture
    try:
        compile_gguf(gguf, out, CompileRequest(target, Bounds(max_context=256, max_verify=4, prefill_chunk=32), support=support,
                                                    **options))
    except _Lowered as lowered:
        mod = lowered.mod
    finally:
        tvm.compile = real
    return {gv.name_hint: f"{tvm_ffi.structural_hash(f):x}" for gv, f in sorted(mod.functions.items(),
                                                                                 key=lambda kv: kv[0].name_hint)
            if isinstance(f, tvm.tirx.PrimFunc) and not gv.name_hint.startswith("shape_func")}


def main() -> None:
    from ds4tvm.compile.toolchains import prepare

    prepare("cuda")   # before TVM is imported, as ds4-compile does
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        models = {}
        for name, kind, target, options in CASES:
            if kind not in models:
                models[kind] = write_model(kind, d)
            key = f"{name} {target} {' '.join(sorted(options))}".strip()
            result[key] = lowered_hashes(*models[kind], target, options, d / "art")
            print(f"{key}: {len(result[key])} PrimFuncs", file=sys.stderr)
    print(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
