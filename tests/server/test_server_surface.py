"""What `ds4 serve` says about itself and the small routes clients and UIs use, on the real server:
any model name is served (one model), one log line per request (JSON here), /tokenize and
/detokenize as llama-server has them, /props, Anthropic's count_tokens agreeing with a real
request's usage, and CORS for a configured origin."""

import json
import time
import urllib.error
import urllib.request

import pytest
from serving import ServerProcess

pytestmark = pytest.mark.compile
ORIGIN = "http://ui.example"


@pytest.fixture(scope="module")
def server(demo_pair):
    s = ServerProcess("-m", demo_pair[2], "--alias", "demo", "--log-format", "json", "--cors-origin", ORIGIN)
    yield s
    s.stop()


def _call(server, path, body=None, method=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    try:
        return status, {k.lower(): v for k, v in headers.items()}, json.loads(raw or b"null")
    except ValueError:   # a CORS preflight answers "OK"
        return status, {k.lower(): v for k, v in headers.items()}, raw.decode()


def test_any_model_name_is_served_and_each_request_is_logged(server):
    status, _, out = _call(server, "/v1/chat/completions", {"model": "gpt-4o", "max_tokens": 3, "temperature": 0,
                                                            "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and out["model"] == "demo", out
    status, _, err = _call(server, "/v1/chat/completions", {"model": "x", "messages": []})
    assert status == 400
    time.sleep(0.5)
    lines = [json.loads(x[len("ds4 serve: "):]) for x in server.output().splitlines()
             if x.startswith("ds4 serve: {")]
    done = [x for x in lines if x["route"] == "/v1/chat/completions" and x["status"] == 200]
    assert done and done[-1]["completion_tokens"] == out["usage"]["completion_tokens"]
    assert {"prompt_tokens", "cached_tokens", "seconds", "tokens_per_second", "finish_reason"} <= set(done[-1])
    assert any(x["status"] == 400 and "error" in x for x in lines)


def test_tokenize_detokenize_and_props(server, demo_pair):
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(Engine(demo_pair[2]).tokenizer_data)
    text = "Hello, world! def f(x): return x"
    status, _, out = _call(server, "/tokenize", {"content": text})
    assert status == 200 and out["tokens"] == tok.encode(text, add_bos=False)
    status, _, back = _call(server, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["content"] == text
    assert _call(server, "/detokenize", {"tokens": [10 ** 9]})[0] == 400
    status, _, props = _call(server, "/props")
    assert status == 200 and props["model"] == "demo" and props["n_ctx"] == 512 and props["family"] == "deepseek4"


def test_count_tokens_agrees_with_a_request(server):
    body = {"model": "demo", "system": "be brief", "messages": [{"role": "user", "content": "count me, please"}]}
    status, _, counted = _call(server, "/v1/messages/count_tokens", body)
    assert status == 200, counted
    status, _, answer = _call(server, "/v1/messages", {**body, "max_tokens": 1})
    usage = answer["usage"]
    assert counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] > 3


def test_cors_for_the_configured_origin_only(server):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = _call(server, "/v1/chat/completions", method="OPTIONS", headers=pre)
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN, headers
    status, headers, _ = _call(server, "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN
    status, headers, _ = _call(server, "/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in headers


def test_structured_outputs_with_the_openai_client(server):
    """response_format json_schema through the real openai client: the content parses and validates
    (jsonschema), sampled and greedy, streamed and not; json_object starts an object."""
    import jsonschema
    from openai import OpenAI

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 10},
                             "days": {"type": "integer", "minimum": 1, "maximum": 30}}}
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Plan a trip as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": schema, "strict": True}}
    for temperature, seed in ((0.0, None), (0.9, 1), (0.9, 2)):
        r = client.chat.completions.create(model="demo", messages=messages, response_format=fmt, max_tokens=64,
                                           temperature=temperature, seed=seed)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=64, stream=True,
                                            response_format=fmt, temperature=0.9, seed=4)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    # any object: this random model never closes one it has opened a string in, so only the start is
    # checked here (test_grammar.py checks the grammar's mask)
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=16, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{"), r


def test_logprobs_of_chat_and_completions(server, demo_pair):
    """logprobs through the real openai client: each token's log-probability and its top ones under
    the model's distribution, checked for the first token against scipy's log_softmax of the
    engine's own logits for the same prompt; at temperature 0 the chosen token is the top one; the
    tokens' text is the content. With streaming: a 400 naming logprobs."""
    import numpy as np
    from openai import BadRequestError, OpenAI
    from scipy.special import log_softmax

    from ds4tvm.runtime.engine import Engine

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    prompt = [5, 17, 99, 3, 42, 8]
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    want = log_softmax(Engine(demo_pair[2]).prefill(prompt).logits.reshape(-1).astype(np.float64))
    best = np.argsort(-want)[:3]
    assert abs(lp.token_logprobs[0] - want[best[0]]) <= 1e-5
    assert sorted(lp.top_logprobs[0].values(), reverse=True) == pytest.approx(list(want[best]), abs=1e-5)
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    for c in content:
        assert c.logprob <= 0 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-9)
        assert bytes(c.bytes).decode(errors="replace") == c.token or "\ufffd" in c.token
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True, stream=True)
    assert "logprobs" in str(e.value)


def test_forced_tool_calls(server):
    """tool_choice "required" and a named function (OpenAI), "any" (Anthropic): the family's
    tool-call syntax is forced by xgrammar's structural tag for it (here DeepSeek-V4's DSML), and
    each call's arguments validate against its tool's schema; a name not among the tools is a 400."""
    import anthropic
    import jsonschema
    from openai import BadRequestError, OpenAI

    weather = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
               "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}}}
    schemas = {"get_weather": weather, "now": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, seed in (("required", 1), ("required", 2), ({"type": "function", "function": {"name": "get_weather"}}, 3)):
        r = client.chat.completions.create(model="demo", messages=messages, tools=tools, tool_choice=choice,
                                           max_tokens=400, temperature=0.9, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        if isinstance(choice, dict):
            assert {c.function.name for c in calls} == {"get_weather"}
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=messages, tools=tools, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "tool_choice" in str(e.value)
    # one tool: the demo's context is 512 tokens, and the tool definitions are part of the prompt
    m = anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
        model="demo", max_tokens=150, messages=messages, tool_choice={"type": "any"},
        tools=[{"name": "now", "input_schema": schemas["now"]}], extra_body={"temperature": 0.9})
    assert m.stop_reason == "tool_use" and {b.name for b in m.content if b.type == "tool_use"} == {"now"}, m
