"""ds4tvm against ik_llama.cpp, the fastest CPU engine, on the same DeepSeek-V4-shaped GGUFs, in one run.

    python benchmarks/vs_ik_llama.py --ik-src DIR [--types q8_0,q4_k,q2,mxfp4] [--repeats 3]
        [--modes default,float] [--threads 2] [--skip-ppl]

DIR: a source checkout of ik_llama.cpp (github.com/ikawrakow/ik_llama.cpp; nothing is fetched
here). It is built once with CMake (CPU only, -DGGML_NATIVE=ON) into .bench/ik_llama-<commit> and
reused. For each type the benchmark model of benchmarks/model50m.py is written (154M parameters,
every DeepSeek-V4 layer kind) and compiled by ds4-compile for this CPU in each --modes
(`default`: as ds4-compile builds it, int8 activations on a CPU with an int8 dot instruction;
`float`: with --float-activations; `int8`: with --int8-activations); then, alternated
--repeats times, each engine in a fresh process: `llama-bench -p 64,512 -n 32 -t THREADS` for
ik_llama.cpp, and for ds4tvm a prefill of 64 and of 512 tokens and a decode of 32 (one token at a
time, greedy), the medians side by side with the ratio ours / theirs. A perplexity cross-check
(unless --skip-ppl) runs ik_llama.cpp's llama-perplexity and ds4tvm's logits over the same text,
per chunk of 128 tokens, so that both are seen to compute the same model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from ds4tvm.kernels.cpu import source_digest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / ".bench"
GEN = 32
MODES = {"default": [], "int8": ["--int8-activations"], "float": ["--float-activations"]}   # ds4-compile flags
PPL_CHUNK = 512   # ik_llama.cpp asserts in its DeepSeek-V4 flash attention with a context of 128


def build_ik(src: Path) -> Path:
    """llama-bench and llama-perplexity of the checkout at src, built once per commit."""
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=9", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unversioned"
    out = BENCH / f"ik_llama-{commit}"
    bins = out / "bin"
    if not (bins / "llama-bench").exists() or not (bins / "llama-perplexity").exists():
        print(f"building ik_llama.cpp {commit} into {out} (CPU only, about 10 minutes on 2 cores)", file=sys.stderr)
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(out), "--target", "llama-bench", "llama-perplexity", "-j"],
                       check=True, stdout=subprocess.DEVNULL)
    return bins


def ik_bench(bins: Path, gguf: Path, threads: int) -> dict:
    out = subprocess.run([str(bins / "llama-bench"), "-m", str(gguf), "-p", "64,512", "-n", str(GEN), "-t",
                          str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    rate = {}
    for r in rows:
        key = f"prefill{r['n_prompt']}" if r["n_prompt"] else "decode"
        rate[key] = float(r["avg_ts"])
    return rate


OURS = r"""
import json, sys, time
import numpy as np
from ds4tvm.runtime.loader import open_engine
e = open_engine(sys.argv[1], progress=False, lean=True)   # as ds4 run and ds4 bench load it
prompt = [i * 7 % 30000 + 5 for i in range(512)]
out = {}
for n in (64, 512):
    e.reset(); e.prefill(prompt[:8])   # warm-up
    e.reset(); t = time.perf_counter(); logits = e.prefill(prompt[:n]).logits; out[f"prefill{n}"] = n / (time.perf_counter() - t)
toks = []
t = time.perf_counter()
for _ in range(int(sys.argv[2])):
    toks.append(int(np.argmax(logits))); logits = e.decode(toks[-1]).logits
out["decode"] = len(toks) / (time.perf_counter() - t)
print(json.dumps(out))
"""


def our_bench(art: Path, threads: int) -> dict:
    env = {**__import__("os").environ, "TVM_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", OURS, str(art), str(GEN)], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def perplexities(bins: Path, gguf: Path, art: Path, text: Path, threads: int) -> tuple[list, list]:
    """Per-chunk perplexity from ik_llama.cpp's llama-perplexity (its [i]x.xx lines) and from ds4tvm's
    logits of the same tokens (llama.cpp scores the second half of each chunk)."""
    out = subprocess.run([str(bins / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(PPL_CHUNK),
                          "-t", str(threads), "--chunks", "2"], capture_output=True, text=True, errors="replace",
                         cwd=BENCH)   # its llama.log lands there, not in the checkout
    import re

    theirs = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+)", out.stdout + out.stderr)]
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.tokenizer import Tokenizer

    e = Engine(art)
    tok = Tokenizer.from_metadata(e.tokenizer_data)
    ids = tok.encode(text.read_text(), add_bos=False)
    ours, running = [], []
    for c in range(min(2, len(ids) // PPL_CHUNK)):
        chunk = ([tok.bos_id] if tok.bos_id is not None else []) + ids[c * PPL_CHUNK:(c + 1) * PPL_CHUNK - 1]
        e.reset()
        logits = e.prefill(chunk, all_logits=True).logits.astype(np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        first = len(chunk) // 2
        running += [-lp[i, chunk[i + 1]] for i in range(first, len(chunk) - 1)]
        ours.append(float(np.exp(np.mean(running))))
    return ours, theirs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ik-src", type=Path, required=True, help="ik_llama.cpp source checkout")
    ap.add_argument("--types", default="q8_0,q4_k,q2,mxfp4")
    ap.add_argument("--modes", default="default,float", help=f"of {', '.join(MODES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-ppl", action="store_true")
    a = ap.parse_args()
    bins = build_ik(a.ik_src)
    print("| type | mode | prefill 64 ours / ik | ratio | prefill 512 ours / ik | ratio | decode ours / ik | ratio "
          "| decode ratio over runs |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for kind in a.types.split(","):
        gguf = BENCH / f"model50m-{kind}.gguf"
        if not gguf.exists():
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model50m.py"), str(gguf), kind], check=True,
                           stdout=subprocess.DEVNULL)
        # named by the digest of the kernels' sources: a change to them compiles afresh
        arts = {m: BENCH / f"model50m-{kind}-{m}-{source_digest()[:8]}.ds4tvm" for m in a.modes.split(",")}
        for m, art in arts.items():
            if not (art / "manifest.json").exists():
                subprocess.run([sys.executable, "-c", "from ds4tvm.cli import compile_main; compile_main()",
                                str(gguf), "--target", "cpu", "-o", str(art), "--quiet", "--max-context", "1024",
                                *MODES[m]], check=True,
                               stdout=subprocess.DEVNULL)
        mine, theirs = {m: [] for m in arts}, []
        for _ in range(a.repeats):   # alternated, each in a fresh process
            theirs.append(ik_bench(bins, gguf, a.threads))
            for m, art in arts.items():
                mine[m].append(our_bench(art, a.threads))
        for m in arts:
            print_row(kind, m, mine[m], theirs)
        if not a.skip_ppl:
            text = BENCH / "ppl.txt"
            text.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ds4tvm" / "runtime").glob("*.py"))[:4]))
            ours, ik = perplexities(bins, gguf, next(iter(arts.values())), text, a.threads)
            print(f"  {kind}: perplexity per chunk of {PPL_CHUNK}, ds4tvm {['%.2f' % x for x in ours]} vs "
                  f"ik_llama.cpp {['%.2f' % x for x in ik]}", flush=True)


def print_row(kind: str, mode: str, ours: list[dict], ik: list[dict]) -> None:
    med = {k: (statistics.median(r[k] for r in ours), statistics.median(r[k] for r in ik))
           for k in ("prefill64", "prefill512", "decode")}
    spread = [o["decode"] / i["decode"] for o, i in zip(ours, ik)]
    print(f"| {kind} | {mode} | " + " | ".join(f"{o:.0f} / {i:.0f} | {o / i:.2f}" for o, i in med.values())
          + f" | {min(spread):.2f}-{max(spread):.2f} |", flush=True)


if __name__ == "__main__":
    main()
