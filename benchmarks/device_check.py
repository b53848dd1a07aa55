"""The GPU check behind scripts/device_check.sh (run that): on a machine with an NVIDIA GPU,
compile for the GPU found, compare the tiny model's logits with the CPU artifact's, then time
decode and verify(k) on a DeepSeek-V4-shaped random model large enough to keep the GPU busy, and
report tokens/s and the weight bandwidth reached as a fraction of the device's own copy bandwidth.
Nothing is fetched from the network. Prints a table and writes JSON to --out."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def run_cli(*args: str, compile_: bool = False) -> subprocess.CompletedProcess:
    entry = "compile_main" if compile_ else "main"
    r = subprocess.run([sys.executable, "-c", f"from ds4tvm.cli import {entry}; {entry}()", *map(str, args)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"device_check: {' '.join(map(str, args))} failed:\n{r.stderr[-2000:]}")
    return r


def gpu_arch() -> str:
    import tvm

    dev = tvm.cuda(0)
    if not dev.exist:
        raise SystemExit("device_check: TVM sees no CUDA device")
    return "sm_" + dev.compute_version.replace(".", "")


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling to compare with)."""
    import tvm

    dev = tvm.cuda(0)
    a = tvm.runtime.empty((nbytes // 4,), "float32", dev)
    b = tvm.runtime.empty((nbytes // 4,), "float32", dev)
    a.copyto(b)
    dev.sync()
    t = time.perf_counter()
    for _ in range(repeats):
        a.copyto(b)
    dev.sync()
    return 2 * nbytes * repeats / (time.perf_counter() - t)


def logits_check(work: Path, arch: str) -> dict:
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    model = write_random_deepseek4(work / "tiny.gguf", tiny_config(), seed=5)
    tokens = ",".join(str(t) for t in np.random.default_rng(0).integers(4, 500, 40))
    out = {}
    for name, target in (("cpu", "cpu"), ("gpu", f"cuda:{arch}")):
        run_cli(model, "--target", target, "-o", work / f"tiny-{name}", "--max-context", "512", "--quiet",
                compile_=True)
        for mode in ("prefill", "decode", "verify"):
            run_cli("logits", "-m", work / f"tiny-{name}", "--tokens", tokens, "--mode", mode, "--out",
                    work / f"{name}-{mode}.npy")
    for mode in ("prefill", "decode", "verify"):
        a, b = np.load(work / f"cpu-{mode}.npy"), np.load(work / f"gpu-{mode}.npy")
        out[mode] = {"max_abs_diff": float(np.abs(a - b).max()),
                     "argmax_equal": int((a.argmax(-1) == b.argmax(-1)).sum()), "rows": int(a.shape[0])}
    return out


def speed_check(work: Path, arch: str, n_layers: int, gen: int) -> dict:
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4
    from ds4tvm.gguf import open_gguf
    from ds4tvm.gguf.validate import DENSE
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.speculative import verify_cost

    cfg = tiny_config(n_layers=n_layers, n_embd=2048, n_vocab=32768, n_head=16, head_dim=512, n_rot=64,
                      q_lora_rank=1024, o_lora_rank=1024, o_groups=4, n_expert=64, n_expert_used=6,
                      n_ff_exp=1024, idx_n_head=16, idx_head_dim=128, idx_top_k=64, sliding_window=128,
                      compress_ratios=(0, 0, 4, 128), n_hash_layers=1)
    q8 = lambda s: QT.Q8_0 if s.types == DENSE and s.shape[0] % 32 == 0 else None  # noqa: E731
    from ds4tvm.families.deepseek4.random_model import default_type

    model = write_random_deepseek4(work / "big.gguf", cfg, seed=9,
                                   type_of=lambda s: q8(s) or (QT.Q8_0 if "exps" in s.name else default_type(s)))
    f = open_gguf(model)
    weight_bytes = sum(t.n_bytes for t in f.tensors.values())
    expert_bytes = sum(t.n_bytes for n, t in f.tensors.items() if "_exps" in n)
    per_token = weight_bytes - expert_bytes * (1 - cfg.n_expert_used / cfg.n_expert)
    run_cli(model, "--target", f"cuda:{arch}", "-o", work / "big-gpu", "--max-context", "1024", "--quiet",
            compile_=True)
    engine = Engine(work / "big-gpu")
    engine.prefill(list(range(4, 132)))
    tok = 7
    for _ in range(4):   # warm-up
        engine.decode(tok)
    t = time.perf_counter()
    for _ in range(gen):
        engine.decode(tok)
    dt = (time.perf_counter() - t) / gen
    return {"weights_gib": round(weight_bytes / 2**30, 2), "bytes_per_token_gib": round(per_token / 2**30, 3),
            "decode_tok_s": round(1 / dt, 1), "decode_weight_gb_s": round(per_token / dt / 1e9, 1),
            "verify_cost_vs_decode": {k: round(v, 2) for k, v in verify_cost(engine, max_k=8).items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("device_check.json"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gen", type=int, default=64)
    a = ap.parse_args()
    arch = gpu_arch()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        report = {"arch": arch, "copy_bandwidth_gb_s": round(copy_bandwidth() / 1e9, 1)}
        report["logits_vs_cpu"] = logits_check(work, arch)
        report["speed"] = speed_check(work, arch, a.layers, a.gen)
    s = report["speed"]
    s["bandwidth_fraction"] = round(s["decode_weight_gb_s"] / report["copy_bandwidth_gb_s"], 3)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"GPU {arch}: copy bandwidth {report['copy_bandwidth_gb_s']} GB/s")
    for mode, r in report["logits_vs_cpu"].items():
        print(f"tiny model {mode:8s} max|Δ| vs CPU {r['max_abs_diff']:.3e}, argmax equal {r['argmax_equal']}/{r['rows']}")
    print(f"random DeepSeek-V4-shaped model ({s['weights_gib']} GiB): decode {s['decode_tok_s']} tok/s, "
          f"{s['decode_weight_gb_s']} GB/s of weights = {s['bandwidth_fraction']:.1%} of copy bandwidth")
    print("verify(k) / decode: " + " ".join(f"k={k}:{v}" for k, v in s["verify_cost_vs_decode"].items()))


if __name__ == "__main__":
    main()
