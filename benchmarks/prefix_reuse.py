"""Time to first token of a conversation's 4th turn through `ds4 serve` (the real openai client,
streamed): on the server that served turns 1-3 (prefix reuse) against a fresh server warmed up with
an unrelated request (cold), side by side, repeated; medians and their ratio.

Usage: python benchmarks/prefix_reuse.py ARTIFACT [--system-words 1500] [--repeats 3] [--max-tokens 32]
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def start(art: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ds4tvm.cli", "serve", "-m", art, "--alias", "bench", "--port",
                             str(port), "--temp", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"ds4 serve {art} did not come up")


def ask(url: str, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
    """(answer, seconds to the first content chunk, prompt tokens, cached tokens)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0, first, text, usage = time.perf_counter(), None, "", None
    for chunk in client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    return text, first or time.perf_counter() - t0, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("artifact")
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    words = ("tool definitions and house rules for the assistant, " * (a.system_words // 8 + 1)).split()
    system = {"role": "system", "content": " ".join(words[:a.system_words])}
    users = [{"role": "user", "content": f"Turn {i}: summarise what we said so far and add one idea."}
             for i in range(4)]
    warm, cold = [], []
    for r in range(a.repeats):
        proc, url = start(a.artifact)
        try:
            messages = [system]
            for user in users[:3]:
                messages.append(user)
                messages.append({"role": "assistant", "content": ask(url, messages, a.max_tokens)[0]})
            answer, ttft, n_prompt, cached = ask(url, messages + [users[3]], a.max_tokens)
            warm.append(ttft)
        finally:
            proc.terminate()
            proc.wait()
        proc, url = start(a.artifact)
        try:
            ask(url, [{"role": "user", "content": "warm up"}], 2)
            cold_answer, ttft_cold, _, cold_cached = ask(url, messages + [users[3]], a.max_tokens)
            cold.append(ttft_cold)
        finally:
            proc.terminate()
            proc.wait()
        same = "same answer" if answer == cold_answer else "ANSWERS DIFFER"
        print(f"repeat {r}: turn 4 prompt {n_prompt} tokens, reused {cached} (cold {cold_cached}); "
              f"TTFT cold {ttft_cold * 1000:.0f} ms, reuse {ttft * 1000:.0f} ms; {same}", flush=True)
    mc, mw = statistics.median(cold), statistics.median(warm)
    print(f"median TTFT of turn 4: cold {mc * 1000:.0f} ms, with reuse {mw * 1000:.0f} ms, {mc / mw:.1f}x faster")


if __name__ == "__main__":
    main()
