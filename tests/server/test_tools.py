"""Tool calls through the server with the real clients. The target is scripted (tests/fakes.py):
its greedy continuation of any prompt is a tool call in DeepSeek-V4's DSML or GLM's syntax, which no
random tiny model would write; everything between HTTP and the engine is the production code."""

import json
import threading

import pytest
from conftest import fixtures_dir
from fakes import ScriptEngine
from serving import InProcessServer

from ds4tvm.families.deepseek4.tools import DSMLToolSyntax
from ds4tvm.families.glm5next.tools import GLMToolSyntax
from ds4tvm.families.qwen4exp.tools import QwenToolSyntax
from ds4tvm.gguf.vocab import synthetic_vocab
from ds4tvm.runtime.tokenizer import Tokenizer
from ds4tvm.server.service import Service

pytestmark = pytest.mark.unit

BLOCK = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
         '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
ARGS = {"city": "Paris", "days": 3}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


# GLM's syntax (families/glm5next/tools.py), with GLM's chat template rendering the turns
GLM_BLOCK = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
             "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")


# Qwen's syntax (families/qwen4exp/tools.py), as Qwen's chat template writes a call
QWEN_BLOCK = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
SYNTAXES = {"glm": (GLM_BLOCK, GLMToolSyntax, "GLM-4.7-Flash.jinja"),
            "qwen": (QWEN_BLOCK, QwenToolSyntax, "Qwen3.5-4B.jinja")}


@pytest.fixture(scope="module", params=["dsml", "glm", "qwen"])
def server(request):
    meta = dict(synthetic_vocab(512))
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][0]
    block, syntax = BLOCK, DSMLToolSyntax
    if request.param in SYNTAXES:
        block, syntax, template = SYNTAXES[request.param]
        meta["tokenizer.chat_template"] = (fixtures_dir("templates") / template).read_text()
    tok = Tokenizer.from_metadata(meta)
    script = tok.encode("Let me check.\n\n" + block, add_bos=False)
    # margin 10 over 511 others: the scripted token has p ~ 0.98 at temperature 1
    s = InProcessServer(Service(ScriptEngine(script, tok.n_vocab, tok.eos_id, max_context=2048, margin=10.0), tok,
                                    tool_syntax=syntax), "scripted")
    yield s
    s.stop()


def _openai(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_tool_call(server):
    client = _openai(server)
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS and call.id
    # streamed: the same content, then the call as a tool_calls delta
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=400, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, {"name": "", "arguments": ""})
            calls[tc.index]["name"] += tc.function.name or ""
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == ARGS
    # the next turn carries the call and its result back through the template
    follow = ASK + [{"role": "assistant", "content": "Let me check.", "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = client.chat.completions.create(model="scripted", messages=follow, tools=TOOLS, temperature=0, max_tokens=5)
    assert r2.choices[0].finish_reason == "length"


def test_anthropic_tool_use(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Weather forecast", "input_schema": TOOLS[0]["function"]["parameters"]}]
    m = client.messages.create(model="scripted", max_tokens=400, messages=ASK, tools=tools,
                               extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "Let me check."
    assert m.content[1].name == "get_weather" and m.content[1].input == ARGS
    with client.messages.stream(model="scripted", max_tokens=400, messages=ASK, tools=tools,
                                extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == ARGS
    assert final.content[0].text == "Let me check."
    # a tool result turn is accepted and rendered
    follow = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": m.content[1].id,
                                                       "name": "get_weather", "input": ARGS}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[1].id,
                                                  "content": "sunny"}]}]
    assert client.messages.create(model="scripted", max_tokens=3, messages=follow, tools=tools).stop_reason == \
        "max_tokens"


def test_tool_call_arguments_are_decoded_greedily_at_high_temperature(server):
    """Sampling at temperature 1 may wander before the block; once the block is open the server
    decodes greedily, so every call that comes back has exactly the scripted arguments."""
    client = _openai(server)
    ok = 0
    for seed in range(16):
        r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=400, extra_body={"min_p": 0.0})
        calls = r.choices[0].message.tool_calls or []
        for c in calls:
            assert c.function.name == "get_weather" and json.loads(c.function.arguments) == ARGS
        ok += bool(calls)
    print(f"{ok}/16 sampled answers reached the tool call")
    assert ok >= 2


class HeldPrefill(ScriptEngine):
    """A prefill that lasts until the test lets it go: as long as a long prompt's, on any machine."""
    release = threading.Event()

    def prefill(self, ids, on_chunk=None):
        assert self.release.wait(60)
        return super().prefill(ids, on_chunk)


def test_keep_alives_while_the_prompt_is_prefilled():
    """Keep-alives (every 0.2 s here) flow while the prompt is prefilled; the prefill is held until
    three have arrived, then the answer follows."""
    import http.client

    meta = dict(synthetic_vocab(512))
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][0]
    tok = Tokenizer.from_metadata(meta)
    server = InProcessServer(Service(HeldPrefill(tok.encode("Hi there", add_bos=False), tok.n_vocab, tok.eos_id),
                                     tok), "scripted", keepalive=0.2)
    try:
        for path, body, ping in (("/v1/chat/completions", {"model": "scripted", "messages": ASK, "stream": True,
                                                           "temperature": 0}, ": keep-alive"),
                                 ("/v1/messages", {"model": "scripted", "messages": ASK, "stream": True,
                                                   "max_tokens": 20, "temperature": 0}, "event: ping")):
            HeldPrefill.release.clear()
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r, lines = conn.getresponse(), []
            while (line := r.readline()):
                lines.append(line.decode().rstrip("\n"))
                if lines.count(ping) == 3:
                    HeldPrefill.release.set()
            conn.close()
            first_text = next(i for i, x in enumerate(lines) if '"H' in x)  # the first piece of "Hi there"
            assert lines[:first_text].count(ping) >= 3, lines[:first_text]
    finally:
        HeldPrefill.release.set()
        server.stop()


def test_glm_syntax_reads_several_calls_and_ends_after_the_last():
    s = GLMToolSyntax()
    two = ('Checking both.\n' + GLM_BLOCK + '\n<tool_call>get_time<arg_key>zone</arg_key>'
           '<arg_value>{"name": "CET", "dst": true}</arg_value></tool_call>')
    assert s.content(two) == "Checking both." and not s.open_block(two)
    assert s.parse(two) == [{"name": "get_weather", "arguments": ARGS},
                            {"name": "get_time", "arguments": {"zone": {"name": "CET", "dst": True}}}]
    # a finished call may be followed by another one: only other text ends the turn
    assert not s.closed_block(GLM_BLOCK) and not s.closed_block(GLM_BLOCK + "\n<tool_")
    assert s.open_block(GLM_BLOCK + "<tool_call>get_time<arg_key>zo") and not s.closed_block(GLM_BLOCK + "<tool_call>x")
    assert s.closed_block(GLM_BLOCK + "\nDone.")
    assert s.parse("no calls here") == [] and s.content_end("Answer  ") == len("Answer")


def test_qwen_syntax_reads_what_its_template_writes():
    """An assistant turn with two calls rendered by Qwen's chat template parses back to the calls
    (a string, an integer and a mapping argument), after the answer text."""
    from ds4tvm.runtime.chat import ChatTemplate

    calls = [{"name": "get_weather", "arguments": ARGS},
             {"name": "get_time", "arguments": {"zone": {"name": "CET", "dst": True}}}]
    turn = {"role": "assistant", "content": "Checking both.",
            "tool_calls": [{"type": "function", "function": c} for c in calls]}
    template = ChatTemplate((fixtures_dir("templates") / "Qwen3.5-4B.jinja").read_text())
    text = template.render(ASK + [turn], tools=TOOLS)
    reply = text[text.rindex("Checking both."):]
    s = QwenToolSyntax()
    assert s.parse(reply) == calls and s.content(reply) == "Checking both."
    assert not s.open_block(reply) and s.open_block(QWEN_BLOCK + "\n<tool_call>\n<function=get_t")
    assert not s.closed_block(QWEN_BLOCK) and s.closed_block(QWEN_BLOCK + "\nDone.")
