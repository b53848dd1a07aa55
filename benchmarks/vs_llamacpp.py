"""ds4tvm against llama.cpp (llama-cpp-python 0.3.36) on the same DeepSeek-V4-shaped GGUF, in one run.

    python benchmarks/vs_llamacpp.py [--llama-env DIR] [--types q8_0,q4_k,q2,mxfp4] [--repeats 3]
        [--modes fp32,int8]

--modes: ds4tvm compiled with float inputs to its linears (fp32) and with --int8-activations (int8,
on CPUs with AVX-512 VNNI or AVX2), each a row of the table.

llama-cpp-python compiles llama.cpp from source (~6 minutes), so it lives in its own virtual
environment: DIR (default .bench/llamacpp-env) is created on first use and reused. Both engines
run on the same file, alternately; the table prints prefill and decode tok/s and ours/theirs, the
weight bytes one decode token reads (every matrix once, the chosen experts' share of the routed
ones, one embedding row) with the GB/s each engine's decode reaches over them, and how many of the
first 32 greedy tokens agree (ds4tvm compiled without ds4's FP8/FP4 round trips,
which llama.cpp does not have). On this CPU llama.cpp's AMX path crashes on quantized models unless
use_extra_bufts is off; the llama.cpp side turns it off. llama.cpp keeps its default F16 KV cache:
with type_k/type_v F32 its token-by-token decode of this model departs from its own prefill logits
after one token (seen 2026-11-29), while with F16 it agrees with ds4tvm on all 32 tokens."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [i * 7 % 30000 + 5 for i in range(64)]
GEN = 32

LLAMA_SIDE = r"""
import json, sys, time, numpy as np, llama_cpp
from llama_cpp import Llama
orig = llama_cpp.llama_cpp.llama_model_default_params
def params():
    p = orig(); p.use_extra_bufts = False; return p
llama_cpp.llama_cpp.llama_model_default_params = params
path, prompt, gen = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=512, verbose=False, n_threads=2)
t = time.perf_counter(); llm.eval(prompt); tp = time.perf_counter() - t
toks = []; t = time.perf_counter()
for _ in range(gen):
    nxt = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))))
    toks.append(nxt); llm.eval([nxt])
td = time.perf_counter() - t
print(json.dumps({"prefill": len(prompt) / tp, "decode": gen / td, "tokens": toks}))
"""


def llama_env(d: Path) -> Path:
    py = d / "bin" / "python"
    if not py.exists():
        print(f"building llama-cpp-python 0.3.36 into {d} (compiles llama.cpp, ~6 minutes)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "llama-cpp-python==0.3.36", "numpy"], check=True)
    return py


def bytes_per_token(gguf: Path) -> int:
    from ds4tvm.gguf import open_gguf

    f = open_gguf(gguf)
    share = f.get(f.key("expert_used_count"), "int") / f.get(f.key("expert_count"), "int")
    total = 0
    for t in f.tensors.values():
        if "_exps." in t.name:
            total += t.n_bytes * share
        elif t.name.startswith("token_embd"):
            total += t.n_bytes / t.shape[-1]
        else:
            total += t.n_bytes
    return int(total)


def ours(artifact: Path) -> dict:
    import time

    import numpy as np

    from ds4tvm.runtime.engine import Engine

    e = Engine(artifact)
    t = time.perf_counter()
    logits = e.prefill(PROMPT).logits
    tp = time.perf_counter() - t
    toks = []
    t = time.perf_counter()
    for _ in range(GEN):
        toks.append(int(np.argmax(logits)))
        logits = e.decode(toks[-1]).logits
    return {"prefill": len(PROMPT) / tp, "decode": GEN / (time.perf_counter() - t), "tokens": toks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-env", type=Path, default=ROOT / ".bench" / "llamacpp-env")
    ap.add_argument("--types", default="q8_0,q4_k,q2,mxfp4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="fp32,int8")
    ap.add_argument("--ours", type=Path, help=argparse.SUPPRESS)   # one ds4tvm run (a child process)
    a = ap.parse_args()
    if a.ours is not None:
        print(json.dumps(ours(a.ours)))
        return
    py = llama_env(a.llama_env)
    work = Path(tempfile.mkdtemp(prefix="ds4-vs-llamacpp-"))
    rows = []
    for kind in a.types.split(","):
        gguf = work / f"m-{kind}.gguf"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model50m.py"), str(gguf), kind], check=True)
        modes = a.modes.split(",")
        arts = {m: work / f"art-{kind}-{m}" for m in modes}
        for m, art in arts.items():
            subprocess.run([sys.executable, "-c", "from ds4tvm.cli import compile_main; compile_main()", str(gguf),
                            "--target", "cpu", "-o", str(art), "--no-kv-rounding", "--quiet",
                            *(["--int8-activations"] if m == "int8" else [])], check=True)
        mine, theirs = {m: [] for m in modes}, []
        for _ in range(a.repeats):  # alternate the engines, each in a fresh process (no idle thread pool left)
            for m, art in arts.items():
                out = subprocess.run([sys.executable, __file__, "--ours", str(art)], capture_output=True,
                                     text=True, check=True)
                mine[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
            out = subprocess.run([str(py), "-c", LLAMA_SIDE, str(gguf), json.dumps(PROMPT), str(GEN)],
                                 capture_output=True, text=True, check=True)
            theirs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
        for m in modes:
            same = sum(x == y for x, y in zip(mine[m][0]["tokens"], theirs[0]["tokens"]))
            rows.append((f"{kind} ({m})", med(mine[m], "prefill"), med(theirs, "prefill"), med(mine[m], "decode"),
                         med(theirs, "decode"), bytes_per_token(gguf) / 1e6, same))
    print("| type | prefill ours | prefill llama.cpp | ratio | decode ours | decode llama.cpp | ratio | MB per token "
          f"| GB/s ours | GB/s llama.cpp | greedy tokens equal (of {GEN}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, pm, pt, dm, dt, mb, same in rows:
        print(f"| {kind} | {pm:.0f} | {pt:.0f} | {pm / pt:.2f} | {dm:.0f} | {dt:.0f} | {dm / dt:.2f} | {mb:.1f} "
              f"| {dm * mb / 1e3:.1f} | {dt * mb / 1e3:.1f} | {same} |")


if __name__ == "__main__":
    main()
