"""A batched decode of B sequences (one token each) against one decode, ds4tvm and llama.cpp
(llama-cpp-python 0.3.36, its own batch API: one llama_decode of B rows, one per sequence id) on
the same GGUF, alternated. Usage:
    python benchmarks/batch_vs_llamacpp.py ARTIFACT GGUF [--batches 1,4,8] [--steps 40] [--rounds 3]
        [--llama-env DIR]

ARTIFACT is GGUF compiled with --max-batch of at least the largest B. Each round, each engine:
WARM_S seconds of untimed decode, then for each B, B sequences prefilled with 64 tokens of their
own, WARM untimed batched decodes and `steps` timed one by one (the same token ids in both
engines, positions growing from 64), their median; llama.cpp runs 2 threads and its default F16 KV
cache, ds4tvm its default threads. Prints per B the medians over the rounds of a step's ms, the
step against the same engine's one decode (its "decode steps": what B sequences cost in the time
of one, which bounds a server's tok/s with B clients over one client's) and ours against theirs.
The llama side runs in the environment benchmarks/vs_llamacpp.py builds (DIR, default
.bench/llamacpp-env)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from vs_llamacpp import ROOT, llama_env

PROMPT_TOKENS = 64
WARM = 10   # untimed steps after each prefill: the first ones after a prefill run slower
# untimed decode seconds at the start of each engine's round: this machine's last-level cache (480 MB,
# shared) holds the benchmark model, and after the other engine has run, a decode reads from memory
# for the next ~50 steps (2.4 -> 4.8 ms a step here)
WARM_S = 1.5

LLAMA_SIDE = r"""
import json, statistics, sys, time, numpy as np, llama_cpp as lc
orig = lc.llama_cpp.llama_model_default_params
def params():   # llama.cpp's AMX buffers crash on quantized models on this CPU (vs_llamacpp.py)
    p = orig(); p.use_extra_bufts = False; return p
lc.llama_cpp.llama_model_default_params = params
path, batches, steps, n_prompt, warm, warm_s = (sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                                int(sys.argv[5]), float(sys.argv[6]))
llm = lc.Llama(model_path=path, n_ctx=512, verbose=False, n_threads=2)
cp = lc.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 8192, 512, 512, max(batches), 2, 2
ctx = lc.llama_init_from_model(llm._model.model, cp)
batch = lc.llama_batch_init(512, 0, max(batches))
def decode(rows):   # (token, position, sequence id, logits?)
    for i, (t, p, s, out) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, out
        batch.seq_id[i][0] = s
    batch.n_tokens = len(rows)
    if lc.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
t0 = time.perf_counter()
lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
decode([(1000, i, 0, False) for i in range(n_prompt)])
position = n_prompt
while time.perf_counter() - t0 < warm_s and position < cp.n_ctx // 2:
    decode([(1000, position, 0, True)])
    position += 1
result = {}
for B in batches:
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    rng = np.random.default_rng(0)
    for s in range(B):
        decode([(int(t), i, s, i == n_prompt - 1) for i, t in enumerate(rng.integers(1000, 30000, n_prompt))])
    times = []
    for step in range(warm + steps):
        t = time.perf_counter()
        decode([((1000 + 977 * i) % llm.n_vocab(), n_prompt + step, i, True) for i in range(B)])
        times.append(time.perf_counter() - t)
    result[B] = statistics.median(times[warm:])
print(json.dumps(result))
"""


def ours(engine, seqs, batches: list[int], steps: int) -> dict:
    from batch_ab import distinct_tokens

    engine.attach(seqs[0])
    engine.reset()
    engine.prefill(np.full(PROMPT_TOKENS, 1000))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < WARM_S:
        engine.decode(1000)
        engine.rewind(1)
    out = {}
    for B in batches:
        rng = np.random.default_rng(0)
        for s in seqs[:B]:
            engine.attach(s)
            engine.reset()
            engine.prefill(rng.integers(1000, 30000, PROMPT_TOKENS))
        ids, times = distinct_tokens(engine, B), []
        for _ in range(WARM + steps):
            t = time.perf_counter()
            if B == 1:
                engine.attach(seqs[0])
                engine.decode(ids[0])
            else:
                engine.decode_batch(seqs[:B], ids)
            times.append(time.perf_counter() - t)
        out[B] = statistics.median(times[WARM:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("gguf")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-env", type=Path, default=ROOT / ".bench" / "llamacpp-env")
    a = ap.parse_args()
    batches = sorted({1, *(int(b) for b in a.batches.split(","))})
    from ds4tvm.runtime.engine import Engine

    py = llama_env(a.llama_env)
    engine = Engine(a.artifact)
    seqs = [engine.new_sequence() for _ in range(max(batches))]
    mine: dict = {b: [] for b in batches}
    theirs: dict = {b: [] for b in batches}
    for _ in range(a.rounds):
        run = subprocess.run([str(py), "-c", LLAMA_SIDE, a.gguf, json.dumps(batches), str(a.steps),
                              str(PROMPT_TOKENS), str(WARM), str(WARM_S)], capture_output=True, text=True, check=True)
        for b, s in json.loads(run.stdout.strip().splitlines()[-1]).items():
            theirs[int(b)].append(s)
        for b, s in ours(engine, seqs, batches, a.steps).items():
            mine[b].append(s)
    med = {name: {b: statistics.median(v) for b, v in d.items()} for name, d in (("ours", mine), ("llama", theirs))}
    print(f"medians of {a.rounds} rounds, {a.steps} steps each")
    print(f"{'B':>3} {'ours ms':>9} {'decode steps':>13} {'llama.cpp ms':>13} {'decode steps':>13} {'ours x faster':>14}")
    for b in batches:
        o, t = med["ours"][b], med["llama"][b]
        print(f"{b:>3} {1e3 * o:9.2f} {o / med['ours'][1]:13.2f} {1e3 * t:13.2f} {t / med['llama'][1]:13.2f} {t / o:14.2f}")


if __name__ == "__main__":
    main()
