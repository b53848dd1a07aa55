"""The GPU check behind scripts/device_check.sh, in two phases so that the GPU machine needs only
TVM's runtime:

  prepare DIR --arch sm_90   (any machine with ds4tvm and TVM's compiler)
      builds the demo DeepSeek-V4 + DSpark pair, compiles it for the GPU, records the CPU
      artifact's logits (prefill, decode, verify) and greedy DSpark tokens as the reference, and
      compiles two larger DeepSeek-V4-shaped random models for the GPU with their `--report`:
      "big" (8 layers, width 2048, Q8_0, 0.5 GB read per decode step) and "large" (20 layers of
      the published DeepSeek-V4-Flash shapes with 16 experts, the Q2 recipe types, 4.7 GB read
      per decode step); their GGUFs are written again from the same seeds by `check`, so DIR
      stays small enough to carry;
  check DIR                  (the machine with the NVIDIA GPU)
      compares the GPU's logits and tokens with the reference, then times prefill, decode and
      verify(k) on each larger model and reports the weight bandwidth a decode step reaches as a
      fraction of the device's own copy bandwidth, with the kernels a decode step runs and how
      many of them CUDA graphs replay. Prints a table; JSON goes to --out.
Nothing is fetched from the network."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

PROMPT_IDS_SEED = 0
N_SPEC = 64


def tiny_ids(vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(PROMPT_IDS_SEED).integers(4, min(vocab, 500), 40)]


def all_logits(engine, ids: list[int]) -> dict[str, np.ndarray]:
    """Logits of every token of ids from one prefill, token-by-token decode, and verify blocks of
    every width from 1 to max_verify in turn (on CUDA each width is its own recorded function)."""
    out = {}
    engine.reset()
    out["prefill"] = engine.prefill(ids, all_logits=True).logits
    engine.reset()
    out["decode"] = np.stack([engine.decode(t).logits for t in ids])
    engine.reset()
    parts, i, width = [], 0, 1
    while i < len(ids):
        part = ids[i:i + width]
        parts.append(engine.verify(part).logits)
        engine.commit(len(part))
        i, width = i + len(part), width % engine.max_verify + 1
    out["verify"] = np.concatenate(parts)
    return {k: v.astype(np.float32) for k, v in out.items()}


def speculative_tokens(engine, prompt: list[int]) -> tuple[list[int], dict]:
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    engine.reset()
    toks, stats = generate(engine, prompt, N_SPEC, SamplingParams(temperature=0.0), np.random.default_rng(0),
                           drafter=DSparkDrafter(engine))
    return toks, {"proposed": stats.counters["proposed"], "accepted": stats.counters["accepted_draft"],
                  "tok_s": stats.tok_s}


def big_config():
    from ds4tvm.families.deepseek4.random_model import tiny_config

    return tiny_config(n_layers=8, n_embd=2048, n_vocab=32768, n_head=16, head_dim=512, n_rot=64,
                       q_lora_rank=1024, o_lora_rank=1024, o_groups=4, n_expert=16, n_expert_used=6,
                       n_ff_exp=512, idx_n_head=16, idx_head_dim=128, idx_top_k=64, sliding_window=128,
                       compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), n_hash_layers=1)


def write_big(path: Path) -> Path:
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.deepseek4.random_model import default_type, write_random_deepseek4
    from ds4tvm.gguf.validate import DENSE, EMBED, ROUTED

    def type_of(s):
        return QT.Q8_0 if s.types in (DENSE, ROUTED, EMBED) and s.shape[0] % 32 == 0 else default_type(s)

    return write_random_deepseek4(path, big_config(), seed=9, type_of=type_of)


def large_config():
    """20 layers of the published DeepSeek-V4-Flash shapes, 16 routed experts (the file stays
    7.2 GB), 4.7 GB read per decode step in the Q2 recipe types."""
    from dataclasses import replace

    from ds4tvm.families.deepseek4.published import flash_config

    cfg, n = flash_config(), 20
    return replace(cfg, n_layers=n, n_expert=16, compress_ratios=cfg.compress_ratios[:n],
                   swiglu_clamp=cfg.swiglu_clamp[:n])


def write_large(path: Path) -> Path:
    """Random valid blocks in every quantized tensor (no quantizer run): seconds per gigabyte."""
    from ds4tvm.families.deepseek4.published import q2_recipe_type
    from ds4tvm.families.deepseek4.random_model import write_random_deepseek4

    return write_random_deepseek4(path, large_config(), seed=11, type_of=q2_recipe_type, random_codes=True)


TIMED = {"big": (write_big, big_config), "large": (write_large, large_config)}   # name -> (writer, config)
TIMED_BOUNDS = dict(max_context=1024, max_verify=8, prefill_chunk=256)   # verify(k) timed to k = 8


def prepare(work: Path, arch: str) -> None:
    from ds4tvm.compile.toolchains import prepare as prepare_toolchain

    prepare_toolchain("cuda")   # before TVM is first imported
    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import compile_gguf
    from ds4tvm.demo import BOUNDS, PROMPT, embedded_artifact, embedded_pair
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.tokenizer import Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    model, support = embedded_pair()
    cpu = Engine(embedded_artifact(work / "demo", progress=False))
    prompt = Tokenizer.from_metadata(cpu.tokenizer_data).encode(PROMPT)
    ref = all_logits(cpu, tiny_ids(cpu.n_vocab))
    toks, _ = speculative_tokens(cpu, prompt)
    np.savez(work / "reference.npz", tokens=np.array(toks), prompt=np.array(prompt), **ref)
    compile_gguf(model, f"cuda:{arch}", work / "demo-cuda", Bounds(**BOUNDS), support=support)
    for name, (writer, _) in TIMED.items():
        gguf = writer(work / f"{name}.gguf")
        compile_gguf(gguf, f"cuda:{arch}", work / f"{name}-cuda", Bounds(**TIMED_BOUNDS),
                     report=work / f"{name}-report.json")
        gguf.unlink()   # `check` writes it again from the seed (the manifest's fingerprint must match)


def copy_bandwidth(dev, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling to compare with)."""
    import tvm

    a = tvm.runtime.empty((nbytes // 4,), "float32", dev)
    b = tvm.runtime.empty((nbytes // 4,), "float32", dev)
    a.copyto(b)
    dev.sync()
    t = time.perf_counter()
    for _ in range(repeats):
        a.copyto(b)
    dev.sync()
    return 2 * nbytes * repeats / (time.perf_counter() - t)


def check(work: Path, gen: int) -> dict:
    from ds4tvm.runtime.engine import Engine

    report = {}
    demo = work / "demo"
    gpu = Engine(work / "demo-cuda", weights={"model": demo / "ds4-demo-tiny-deepseek4.gguf",
                                              "support": demo / "ds4-demo-tiny-dspark.gguf"})
    report["device"] = str(gpu.dev)
    ref = np.load(work / "reference.npz")
    got = all_logits(gpu, tiny_ids(gpu.n_vocab))
    report["logits_vs_cpu"] = {
        mode: {"max_abs_diff": float(np.abs(got[mode] - ref[mode]).max()),
               "max_abs_logit": float(np.abs(ref[mode]).max()),
               "argmax_equal": int((got[mode].argmax(-1) == ref[mode].argmax(-1)).sum()),
               "rows": int(ref[mode].shape[0])} for mode in ("prefill", "decode", "verify")}
    toks, stats = speculative_tokens(gpu, [int(t) for t in ref["prompt"]])
    want = [int(t) for t in ref["tokens"]]
    report["dspark_greedy"] = {"tokens": len(want), "equal_prefix": next(
        (i for i, (a, b) in enumerate(zip(toks, want)) if a != b), min(len(toks), len(want))), **stats}

    report["copy_bandwidth_gb_s"] = round(copy_bandwidth(gpu.dev) / 1e9, 1)
    for name in TIMED:
        report[name] = timed(work, name, gen)
    return report


def bytes_per_token(f, cfg) -> tuple[int, int]:
    """(file weight bytes, bytes a decode step reads: every matrix once, the chosen experts' share
    of the routed ones, no embedding table)."""
    weight_bytes = sum(t.n_bytes for t in f.tensors.values())
    expert_bytes = sum(t.n_bytes for n, t in f.tensors.items() if "_exps" in n)
    embd_bytes = f.tensors["token_embd.weight"].n_bytes
    return weight_bytes, int(weight_bytes - embd_bytes - expert_bytes * (1 - cfg.n_expert_used / cfg.n_expert))


def timed(work: Path, name: str, gen: int) -> dict:
    """Prefill, decode and verify(k) speed of one of the TIMED models, with what its decode runs."""
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.speculative import median_seconds, verify_cost

    writer, config = TIMED[name]
    t = time.perf_counter()
    gguf = writer(work / f"{name}.gguf")
    out = {"gguf_seconds": round(time.perf_counter() - t, 1)}
    weight_bytes, per_token = bytes_per_token(open_gguf(gguf), config())
    t = time.perf_counter()
    engine = Engine(work / f"{name}-cuda", weights={"model": gguf})
    out["load_seconds"] = round(time.perf_counter() - t, 1)
    prompt = list(range(4, 260))

    def prefill():
        engine.reset()
        engine.prefill(prompt)

    prefill()
    t_prefill = median_seconds(prefill, 3)
    for _ in range(4):   # warm-up (the first decode captures its CUDA graph)
        engine.decode(7)
    t = time.perf_counter()
    for _ in range(gen):
        engine.decode(7)
    dt = (time.perf_counter() - t) / gen
    copy = copy_bandwidth(engine.dev) / 1e9   # measured beside each model: the device's own ceiling
    functions = json.loads((work / f"{name}-report.json").read_text())["functions"]
    decode, verify6 = functions["decode"], functions.get("verify_w6", {})
    out.update({
        "weights_gib": round(weight_bytes / 2**30, 2), "bytes_per_token_gib": round(per_token / 2**30, 3),
        "prefill_tokens": len(prompt), "prefill_tok_s": round(len(prompt) / t_prefill, 1),
        "decode_tok_s": round(1 / dt, 1), "decode_weight_gb_s": round(per_token / dt / 1e9, 1),
        "bandwidth_fraction": round(per_token / dt / 1e9 / copy, 4),
        "decode_kernels": decode["n_launches"], "decode_calls": decode["n_kernels"], "decode_graph_regions": decode["graph_regions"],
        "decode_kernels_in_graphs": decode["kernels_in_graphs"], "decode_outside_graphs": decode["outside_graphs"],
        "verify6_kernels": verify6.get("n_launches"), "verify6_graph_regions": verify6.get("graph_regions", 0),
        "verify6_outside_graphs": verify6.get("outside_graphs"),
        "verify_cost_vs_decode": {k: round(v, 2) for k, v in verify_cost(engine, max_k=8).items()},
        "decode_profile": decode_profile(engine)})
    del engine
    gguf.unlink()
    return out


def decode_profile(engine, top: int = 20) -> list[list]:
    """Per-kernel time of one decode step (benchmarks/kernel_profile.py): [name, calls, ms], largest first."""
    from kernel_profile import kernel_profile   # benchmarks/ is this script's directory, first on sys.path

    return kernel_profile(engine, lambda: engine.decode(7))[:top + 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("prepare", "check"))
    ap.add_argument("dir", type=Path)
    ap.add_argument("--arch", default="sm_90", help="prepare: the GPU architecture to compile for")
    ap.add_argument("--out", type=Path, default=Path("device_check.json"))
    ap.add_argument("--gen", type=int, default=64)
    a = ap.parse_args()
    if a.phase == "prepare":
        prepare(a.dir, a.arch)
        print(f"device_check: prepared {a.dir}")
        return
    r = check(a.dir, a.gen)
    a.out.write_text(json.dumps(r, indent=1))
    print(f"device {r['device']}: copy bandwidth {r['copy_bandwidth_gb_s']} GB/s")
    for mode, x in r["logits_vs_cpu"].items():
        print(f"demo model {mode:8s} max|d| vs CPU {x['max_abs_diff']:.3e} (logits up to {x['max_abs_logit']:.2f}), "
              f"argmax equal {x['argmax_equal']}/{x['rows']}")
    d = r["dspark_greedy"]
    print(f"DSpark greedy: first {d['equal_prefix']}/{d['tokens']} tokens equal to the CPU's; "
          f"accepted {d['accepted']}/{d['proposed']} drafts; {d['tok_s']:.1f} tok/s")
    for name in TIMED:
        s = r[name]
        print(f"{name} model ({s['weights_gib']} GiB, {s['bytes_per_token_gib']} GiB read per token): prefill "
              f"{s['prefill_tok_s']} tok/s ({s['prefill_tokens']} tokens), decode {s['decode_tok_s']} tok/s, "
              f"{s['decode_weight_gb_s']} GB/s = {s['bandwidth_fraction']:.2%} of copy bandwidth; decode step "
              f"{s['decode_kernels']} kernels ({s['decode_calls']} kernel calls), {s['decode_kernels_in_graphs']} calls in {s['decode_graph_regions']} "
              f"CUDA graph region(s), {s['decode_outside_graphs']} VM instructions outside")
        print(f"  verify of 6 tokens: {s['verify6_kernels']} kernels, {s['verify6_graph_regions']} CUDA graph "
              f"region(s), {s['verify6_outside_graphs']} VM instructions outside")
        print("  verify(k) / decode: " + " ".join(f"k={k}:{v}" for k, v in s["verify_cost_vs_decode"].items()))
        for kernel, n, ms in s["decode_profile"]:
            print(f"  {ms:9.3f} ms {n:6d} calls  {kernel}")

if __name__ == "__main__":
    main()
