"""`ds4 serve` through the real `openai` and `anthropic` clients: at temperature 0 the streamed
text equals the non-streamed text and equals `ds4 run` on the same prompt, with and without
DSpark; tool calls come back in each API's form; bad requests get 4xx JSON errors."""

import json
import urllib.error
import urllib.request

import pytest
from conftest import run_ds4
from serving import ServerProcess

from random_demo import PROMPT

pytestmark = pytest.mark.compile

N = 40


@pytest.fixture(scope="module")
def servers(demo_pair):
    """`ds4 serve` on the demo artifact, with DSpark and target-only."""
    art = demo_pair[2]
    spec, plain = ServerProcess("-m", art, "--dspark", "--alias", "demo"), ServerProcess("-m", art, "--alias", "demo")
    yield {"dspark": spec, "plain": plain}
    for s in (spec, plain):
        s.stop()


@pytest.fixture(scope="module")
def run_text(demo_pair):
    """What `ds4 run` prints (--json text) for the demo prompt: chat-rendered and raw."""
    art = demo_pair[2]
    out = {}
    for mode, extra in (("plain", []), ("dspark", ["--dspark"])):
        r = run_ds4("run", "-m", art, "-p", PROMPT, "-n", N, "--temp", 0, "--json", *extra)
        assert r.returncode == 0, r.stderr
        out[mode] = json.loads(r.stdout)["text"]
        r = run_ds4("run", "-m", art, "-p", "Once upon a time", "--raw", "-n", N, "--temp", 0, "--json", *extra)
        assert r.returncode == 0, r.stderr
        out[mode + "-raw"] = json.loads(r.stdout)["text"]
    assert out["plain"] == out["dspark"] and out["plain"]  # the identity property, at the CLI
    return out


def _openai(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _anthropic(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_chat_stream_equals_non_stream_equals_ds4_run(servers, run_text, mode):
    client = _openai(servers[mode])
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=N, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= N
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model="demo", messages=messages, max_tokens=N, temperature=0,
                                                stream=True):
        delta = chunk.choices[0].delta
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == text == run_text[mode]
    assert finish == r.choices[0].finish_reason


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_completions_stream_equals_non_stream_equals_ds4_run(servers, run_text, mode):
    client = _openai(servers[mode])
    r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=N, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(model="demo", prompt="Once upon a time",
                                                                   max_tokens=N, temperature=0, stream=True)
              if c.choices]
    assert "".join(pieces) == r.choices[0].text == run_text[mode + "-raw"]


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_anthropic_messages_stream_equals_non_stream_equals_ds4_run(servers, run_text, mode):
    client = _anthropic(servers[mode])
    messages = [{"role": "user", "content": PROMPT}]
    # this client has no sampling fields (the 2026 Messages API dropped them): send ours as extra body
    greedy = {"temperature": 0}
    m = client.messages.create(model="demo", max_tokens=N, messages=messages, extra_body=greedy)
    text = "".join(b.text for b in m.content if b.type == "text")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= N
    with client.messages.stream(model="demo", max_tokens=N, messages=messages, extra_body=greedy) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text == run_text[mode]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_stop_strings_and_usage_chunk(servers, run_text):
    client = _openai(servers["dspark"])
    full = run_text["dspark"]
    stop = full[10:14]
    want = full[:full.index(stop)]
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=N, temperature=0, stop=stop, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_seeded_sampling_is_reproducible(servers):
    client = _openai(servers["dspark"])
    kw = dict(model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=1.5,
              seed=7, extra_body={"min_p": 0.0})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    c = client.chat.completions.create(**dict(kw, seed=8)).choices[0].message.content
    assert a == b and a != c


def _post(server, path, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/chat/completions", None, b"{not json", 400, None),
    ("/v1/chat/completions", None, b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"messages": MSG}, None, 400, "model"),
    ("/v1/chat/completions", {"model": "demo"}, None, 400, "messages"),
    ("/v1/chat/completions", {"model": "demo", "messages": []}, None, 400, "messages"),
    ("/v1/chat/completions", {"model": "demo", "messages": "hi"}, None, 400, "messages"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "temperature": -0.5}, None, 400, "temperature"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "temperature": "hot"}, None, 400, "temperature"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "top_p": 0}, None, 400, "top_p"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "max_tokens": 0}, None, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "max_tokens": 2.5}, None, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "stream": "yes"}, None, 400, "stream"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "stop": [1]}, None, 400, "stop"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "n": 3}, None, 400, "n"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "seed": -1}, None, 400, "seed"),
    ("/v1/chat/completions", {"model": "demo", "messages": MSG, "tools": [{"type": "function"}]}, None, 400, "tools"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, "messages[0]"),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "long " * 600}]}, None, 400,
     "messages"),
    ("/v1/completions", {"model": "demo", "prompt": [1, 2, 99999]}, None, 400, "prompt"),
    ("/v1/completions", {"model": "demo", "prompt": [-1]}, None, 400, "prompt"),
    ("/v1/completions", {"model": "demo", "prompt": 5}, None, 400, "prompt"),
    ("/v1/completions", {"model": "demo", "prompt": []}, None, 400, "prompt"),
    ("/v1/messages", {"model": "demo", "messages": MSG}, None, 400, None),
    ("/v1/messages", {"model": "demo", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, None,
     400, None),
    ("/v1/messages", {"model": "demo", "max_tokens": 5, "messages": MSG, "temperature": -1}, None, 400, None),
]


def test_bad_requests_get_4xx_json_errors(servers):
    server = servers["dspark"]
    for path, body, raw, status, param in BAD:
        code, err = _post(server, path, body, raw)
        assert code == status, (path, body, raw, code, err)
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["message"], err
        else:
            assert err["error"]["message"] and err["error"]["type"], err
            if param is not None:
                assert err["error"]["param"] == param, err
    assert _post(server, "/v1/chat/completions", {"model": "demo", "messages": MSG, "max_tokens": 2,
                                                  "temperature": 0})[0] == 200
    with urllib.request.urlopen(server.url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "demo"
    try:
        urllib.request.urlopen(server.url + "/v1/nothing")
        raise AssertionError("expected 404")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and "error" in json.loads(e.read())
    assert server.alive()


def _request(server, path, body=None, raw=None, stream=False, disconnect_after=None, timeout=120):
    """One HTTP request over its own connection: (status, JSON body or streamed text). With
    disconnect_after, reads that many bytes of the stream and drops the connection."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", path, body=raw if raw is not None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if disconnect_after is not None:
            r.read(disconnect_after)
            conn.sock.close()
            return r.status, None
        data = r.read()
        if not stream or r.status != 200:
            return r.status, json.loads(data)
        text = []
        for line in data.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    c = ev["choices"][0]
                    text.append(c.get("text") if "text" in c else c["delta"].get("content") or "")
                elif ev.get("type") == "content_block_delta":
                    text.append(ev["delta"]["text"])
        return r.status, "".join(text)
    finally:
        conn.close()


def _answer_text(path, body):
    if path == "/v1/messages":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def test_two_hundred_mixed_requests_four_at_a_time(servers):
    """Valid (streamed and not, three endpoints), malformed, oversized and mid-stream disconnects,
    four clients at once: no crash, every malformed request gets its 4xx JSON, every valid answer
    equals what a lone client gets."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    server = servers["dspark"]
    valid = [
        ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
                                  "max_tokens": 30, "temperature": 0}),
        ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Speculative decoding"}],
                                  "max_tokens": 24, "temperature": 0, "stop": ["and"]}),
        ("/v1/completions", {"model": "demo", "prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0}),
        ("/v1/messages", {"model": "demo", "max_tokens": 16, "temperature": 0,
                          "messages": [{"role": "user", "content": "Once upon a time"}]}),
    ]
    lone = []
    for path, body in valid:
        status, out = _request(server, path, body)
        assert status == 200, out
        lone.append(_answer_text(path, out))
    huge = b'{"model": "demo", "messages": [{"role": "user", "content": "' + b"x" * (17 << 20) + b'"}]}'
    jobs = []
    rng = random.Random(0)
    for i in range(210):
        kind = rng.choices(["valid", "stream", "bad", "oversized", "disconnect"], [35, 25, 25, 5, 10])[0]
        if kind in ("valid", "stream"):
            v = rng.randrange(len(valid))
            path, body = valid[v]
            jobs.append((kind, v, path, dict(body, stream=kind == "stream"), None, None))
        elif kind == "bad":
            path, body, raw, status, _ = BAD[rng.randrange(len(BAD))]
            jobs.append((kind, status, path, body, raw, None))
        elif kind == "oversized":
            jobs.append((kind, 413, "/v1/chat/completions", None, huge, None) if i % 2 else
                        (kind, 400, "/v1/chat/completions",
                         {"model": "demo", "messages": [{"role": "user", "content": "long " * 900}]}, None, None))
        else:
            jobs.append((kind, None, "/v1/chat/completions",
                         {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 400,
                          "stream": True}, None, rng.choice([1, 200, 700])))

    def one(job):
        kind, want, path, body, raw, cut = job
        return job, _request(server, path, body, raw, stream=kind == "stream", disconnect_after=cut)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, jobs))
    counts = {}
    for (kind, want, path, body, raw, cut), (status, out) in results:
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "valid":
            assert status == 200 and _answer_text(path, out) == lone[want], (path, body, out)
        elif kind == "stream":
            assert status == 200 and out == lone[want], (path, body, out)
        elif kind in ("bad", "oversized"):
            assert status == want, (path, body, status, out)
            assert ("error" in out) and (out["type"] == "error" if path == "/v1/messages" else True), out
        else:
            assert status == 200
    assert sum(counts.values()) >= 200 and all(counts.get(k) for k in ("valid", "stream", "bad", "oversized",
                                                                      "disconnect")), counts
    assert server.alive()
    status, out = _request(server, *valid[0])   # the state is not left dirty by anything above
    assert status == 200 and _answer_text(valid[0][0], out) == lone[0]


def _metrics(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


@pytest.mark.parametrize("mode", ["plain", "dspark"])
def test_concurrent_requests_share_decode_calls_and_answer_as_alone(servers, mode):
    """Six clients at once (the server's 4 workers, two waiting): every answer (temperature 0, and
    seeded sampling) equals what the request gets alone; /metrics counts decode calls of several
    sequences, and the prompt tokens that prefix reuse spared."""
    from concurrent.futures import ThreadPoolExecutor

    server = servers[mode]
    topics = ["Hello", "Once upon a time", "The quick brown fox", "Speculative decoding", "ds4tvm", PROMPT]
    bodies = [{"model": "demo", "messages": [{"role": "user", "content": t}], "max_tokens": 60,
               "temperature": 0 if i % 2 == 0 else 1, "seed": i} for i, t in enumerate(topics)]
    alone = [_request(server, "/v1/chat/completions", b) for b in bodies]
    before = _metrics(server)
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: _request(server, "/v1/chat/completions", b), bodies))
    assert [(s, _answer_text("/v1/chat/completions", o)) for s, o in together] == \
        [(s, _answer_text("/v1/chat/completions", o)) for s, o in alone]
    after = _metrics(server)
    calls = after["ds4_decode_batch_size_count"] - before["ds4_decode_batch_size_count"]
    rows = after["ds4_decode_batch_size_sum"] - before["ds4_decode_batch_size_sum"]
    assert rows > calls > 0   # some calls decoded several sequences
    # verify calls have a histogram of their own (batched verifies: tests/runtime/test_batching.py)
    assert after["ds4_verify_batch_size_count"] >= before["ds4_verify_batch_size_count"] >= 0
    assert after['ds4_verify_batch_size_bucket{le="+Inf"}'] == after["ds4_verify_batch_size_count"]
    # and a drafter's steps (DSpark's proposals, where the cost model asks for them: none when drafting
    # does not pay on this machine; counted by test_metrics_histograms_count_sequences_per_call)
    assert after['ds4_draft_step_batch_size_bucket{le="+Inf"}'] == after["ds4_draft_step_batch_size_count"]
    assert mode == "dspark" or after["ds4_draft_step_batch_size_count"] == 0
    assert after['ds4_requests_total{outcome="ok"}'] - before['ds4_requests_total{outcome="ok"}'] == len(bodies)
    assert after["ds4_prompt_tokens_cached_total"] > before["ds4_prompt_tokens_cached_total"]   # the repeats
    assert after["ds4_requests_running"] == 0 and after["ds4_parallel"] == 4
    assert after["ds4_prompt_tokens_beside_decodes_total"] >= before["ds4_prompt_tokens_beside_decodes_total"] >= 0


def test_metrics_histograms_count_sequences_per_call():
    """/metrics' call-size histograms from the engine's counters (no server): cumulative buckets,
    the drafter steps' summed over their functions."""
    from collections import Counter
    from types import SimpleNamespace

    from ds4tvm.server.metrics import metrics_text

    from ds4tvm.runtime.engine import Engine

    engine = SimpleNamespace(decode_calls=Counter({1: 4, 3: 2}), verify_calls=Counter(), prefilled_beside_decodes=0,
                             batched_calls=Counter({("mtp_step", 2): 3, ("mtp_step", 1): 2, ("other_step", 4): 1}))
    engine.step_calls = Engine.step_calls.fget(engine)
    service = SimpleNamespace(engine=engine, parallel=4, jobs=SimpleNamespace(qsize=lambda: 0), counters=lambda: {
        "running": 0, "outcomes": {}, "prompt": 0, "cached": 0, "generated": 0, "tok_s": 0.0})
    got = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in metrics_text(service).splitlines()
                                    if not line.startswith("#"))}
    assert [got[f'ds4_draft_step_batch_size_bucket{{le="{b}"}}'] for b in (1, 2, 4, 8)] == [2, 5, 6, 6]
    assert got["ds4_draft_step_batch_size_count"] == 6 and got["ds4_draft_step_batch_size_sum"] == 12
    assert [got[f'ds4_decode_batch_size_bucket{{le="{b}"}}'] for b in (1, 2, 4)] == [4, 4, 6]
    assert got["ds4_decode_batch_size_sum"] == 10 and got["ds4_verify_batch_size_count"] == 0
