"""`ds4 serve` under load, through the real `openai` client from N threads: aggregate tok/s, time
to first token and inter-token latency (p50, p99) for 1, 4 and 8 clients, then the latency of 4
running streams while a 2,000-token prompt arrives among them. Usage:
    python benchmarks/serve_load.py ARTIFACT [--clients 1,4,8] [--parallel 8] [--requests 3]
        [--max-tokens 128] [--prompt-tokens 64] [--long-prompt 2000] [--threads N] [--rounds 1]
        [--serve-args "--mtp ..."]

The server runs in its own process (`ds4 serve -m ARTIFACT --parallel P`); the artifact needs
batched functions of up to P sequences (ds4-compile --max-batch P) for decode steps to share a
call. Prompts are random token ids (/v1/completions takes them), each distinct, so prefix reuse
spares nothing; answers are greedy. Latencies are per streamed chunk (a chunk holds the text of
one token, or of several when a token ends inside a UTF-8 character). Prints one table row per
scenario and the ratios of aggregate tok/s to one client's. With --rounds N the client scenarios
run N times in turn (1, 4, 8, 1, 4, 8, ...: this machine's speed drifts between minutes) and each
row gives the medians, its ratio the median of each round's ratio to that round's first scenario,
with their range. --serve-args: more flags for `ds4 serve` (a drafter's, e.g. "--mtp" or "--dspark":
the requests then speculate, each with its drafter, their drafter steps and verify blocks sharing
calls)."""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import ServerProcess  # noqa: E402


def _stream(client, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: arrival times of its chunks, tokens generated."""
    t0 = time.perf_counter()
    times, usage = [], None
    stream = client.completions.create(model="ds4", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    return {"start": t0, "times": times, "tokens": usage.completion_tokens if usage else len(times)}


def _percentiles(xs) -> tuple[float, float]:
    if not len(xs):
        return float("nan"), float("nan")
    return float(np.percentile(xs, 50)), float(np.percentile(xs, 99))


def _cpu_seconds() -> float:
    """CPU time of this process (the clients), which shares the machine's cores with the server."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _summary(name: str, results: list[dict], wall: float, cpu: float) -> dict:
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in results)
    (t50, t99), (i50, i99) = _percentiles(ttft), _percentiles(itl)
    return {"scenario": name, "requests": len(results), "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "client_cores": cpu / wall,
            "ttft_p50_ms": 1e3 * t50, "ttft_p99_ms": 1e3 * t99, "itl_p50_ms": 1e3 * i50, "itl_p99_ms": 1e3 * i99}


def _clients(client, n: int, requests: int, prompt_tokens: int, max_tokens: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1000, vocab, size=prompt_tokens).tolist() for _ in range(n * requests)]

    def one(i):
        return [_stream(client, prompts[i * requests + r], max_tokens) for r in range(requests)]
    t0, c0 = time.perf_counter(), _cpu_seconds()
    with ThreadPoolExecutor(n) as pool:
        results = [r for rs in pool.map(one, range(n)) for r in rs]
    return _summary(f"{n} client{'s' if n > 1 else ''}", results, time.perf_counter() - t0, _cpu_seconds() - c0)


def _merged(rounds: list[dict], firsts: list[dict]) -> dict:
    """One scenario's rows of several rounds: the median of each number; x_first the median of its
    ratios to the same round's first scenario (the range in x_first_range)."""
    row = {k: (float(np.median([r[k] for r in rounds])) if isinstance(v, (int, float)) else v)
           for k, v in rounds[0].items()}
    ratios = [r["tok_s"] / f["tok_s"] for r, f in zip(rounds, firsts)]
    return {**row, "rounds": len(rounds), "x_first": float(np.median(ratios)),
            "x_first_range": (min(ratios), max(ratios))}


def _long_prompt_midstream(client, streams: int, long_prompt: int, max_tokens: int, vocab: int) -> dict:
    """`streams` clients generating max_tokens each; after a quarter of the expected time one more
    sends a long_prompt-token prompt: the streams' inter-token latency over the whole run."""
    rng = np.random.default_rng(99)
    prompts = [rng.integers(1000, vocab, size=32).tolist() for _ in range(streams)]
    long = rng.integers(1000, vocab, size=long_prompt).tolist()
    out: dict = {}

    def newcomer(delay):
        time.sleep(delay)
        out["long"] = _stream(client, long, 8)
    probe = _stream(client, prompts[0][:16], 16)   # one step's time, to place the newcomer
    step = (probe["times"][-1] - probe["times"][0]) / max(1, len(probe["times"]) - 1)
    t = threading.Thread(target=newcomer, args=(max_tokens * step * streams / 4,))
    t0, c0 = time.perf_counter(), _cpu_seconds()
    t.start()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: _stream(client, p, max_tokens), prompts))
    t.join()
    row = _summary(f"{streams} streams + {long_prompt}-token prompt", results, time.perf_counter() - t0,
                   _cpu_seconds() - c0)
    row["long_ttft_ms"] = 1e3 * (out["long"]["times"][0] - out["long"]["start"]) if out["long"]["times"] else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="the client scenarios this many times, in turn")
    ap.add_argument("--serve-args", default="", help="more flags for ds4 serve, e.g. a drafter's")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import openai

    from ds4tvm.artifact import Manifest

    vocab = Manifest.read(Path(a.artifact)).n_vocab
    server = ServerProcess("-m", a.artifact, "--parallel", a.parallel, "--slots", a.parallel,
                           *(["--threads", a.threads] if a.threads else []), *shlex.split(a.serve_args))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        _stream(client, [1000 + i for i in range(8)], 4)   # warm up
        runs = [[_clients(client, int(n), a.requests, a.prompt_tokens, a.max_tokens, vocab, seed=int(n) + 1000 * r)
                 for n in a.clients.split(",")] for r in range(max(1, a.rounds))]
        rows = [_merged(list(scenario), [run[0] for run in runs]) for scenario in zip(*runs)]
        if a.long_prompt:
            rows.append(_long_prompt_midstream(client, 4, a.long_prompt, a.max_tokens, vocab))
            four = next((r for r in rows if r["scenario"] == "4 clients"), None)
            if four is not None:   # against the streams' pace without a newcomer
                rows[-1]["itl_p99_vs_4_clients_p50"] = rows[-1]["itl_p99_ms"] / four["itl_p50_ms"]
    finally:
        server.stop()
    base = rows[0]["tok_s"]
    for r in rows[len(runs[0]):]:   # the long prompt's row: against the first scenario's medians
        r["x_first"], r["x_first_range"] = r["tok_s"] / base, None
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'scenario':<34} {'tok/s':>8} {'x 1st':>6} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} "
          f"{'p99/p50':>7} {'client cores':>12}")
    for r in rows:
        print(f"{r['scenario']:<34} {r['tok_s']:8.1f} {r['x_first']:6.2f} {r['ttft_p50_ms']:9.1f} "
              f"{r['ttft_p99_ms']:8.1f} {r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f} "
              f"{r['itl_p99_ms'] / r['itl_p50_ms']:7.2f} {r['client_cores']:12.2f}"
              + (f"  (x 1st over {r['rounds']} rounds: {r['x_first_range'][0]:.2f}-{r['x_first_range'][1]:.2f})"
                 if r.get("x_first_range") and r["rounds"] > 1 else "")
              + (f"  (long prompt's TTFT {r['long_ttft_ms']:.0f} ms)" if r.get("long_ttft_ms") else "")
              + (f"  ITL p99 / 4 clients' p50: {r['itl_p99_vs_4_clients_p50']:.2f}"
                 if "itl_p99_vs_4_clients_p50" in r else ""))


if __name__ == "__main__":
    main()
