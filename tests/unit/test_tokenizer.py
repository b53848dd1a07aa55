"""Tokenizer against llama.cpp's expected ids for real vocabularies; chat templates render."""

import json

import pytest

from conftest import fixtures_dir, run_ds4
from ds4tvm.errors import Ds4Error
from ds4tvm.gguf import open_gguf
from ds4tvm.runtime.chat import ChatTemplate
from ds4tvm.runtime.tokenizer import Tokenizer

VOCABS = ["deepseek-llm", "qwen2", "qwen35", "llama-bpe", "gpt-2"]
_cache = {}


def load(name):
    if name not in _cache:
        _cache[name] = Tokenizer.from_gguf(open_gguf(fixtures_dir("vocab") / f"ggml-vocab-{name}.gguf"))
    return _cache[name]


def read_cases(name):
    """Parses the .inp/.out pair as llama.cpp's test-tokenizer-0 does: strings separated by
    "\\n__ggml_vocab_test__\\n", one line of ids per string."""
    base = fixtures_dir("vocab") / f"ggml-vocab-{name}.gguf"
    text = base.with_name(base.name + ".inp").read_text(encoding="utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(text):
        nxt = text.find(sep, pos)
        if nxt < 0:
            inputs.append(text[pos:])
            break
        inputs.append(text[pos:nxt])
        pos = nxt + len(sep)
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines) > 40
    return [(s, [int(x) for x in line.split()]) for s, line in zip(inputs, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_fixture_ids(name):
    tok = load(name)
    cases = read_cases(name)
    failures = [(s, want, tok.encode(s, add_bos=False, parse_special=False)) for s, want in cases]
    failures = [f for f in failures if f[1] != f[2]]
    print(f"{name}: {len(cases) - len(failures)}/{len(cases)} strings give llama.cpp's ids")
    assert not failures, failures[:3]


@pytest.mark.parametrize("name", VOCABS)
def test_decode_inverts_encode(name):
    tok = load(name)
    for s, _ in read_cases(name):
        assert tok.decode(tok.encode(s, add_bos=False, parse_special=False)) == s


def test_special_tokens_and_bos():
    tok = load("deepseek-llm")
    assert tok.add_bos and tok.bos_id == 100000
    bos = tok.tokens[tok.bos_id]
    # As text the control token is split into bytes; with special parsing it is one token.
    assert tok.encode(bos, add_bos=False, parse_special=True) == [tok.bos_id]
    assert len(tok.encode(bos, add_bos=False, parse_special=False)) > 1
    assert tok.encode("Hi")[0] == tok.bos_id
    with pytest.raises(Ds4Error, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])


def test_cli_tokenize_and_detokenize():
    path = fixtures_dir("vocab") / "ggml-vocab-qwen2.gguf"
    r = run_ds4("tokenize", path, "Hello world", "--json")
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)["ids"]
    assert ids == load("qwen2").encode("Hello world", add_bos=False)
    r = run_ds4("detokenize", path, ",".join(map(str, ids)))
    assert r.returncode == 0 and r.stdout == "Hello world\n"
    r = run_ds4("detokenize", path, "1,x")
    assert r.returncode == 2 and "IDS" in r.stderr and "Traceback" not in r.stderr


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"},
    {"role": "assistant", "content": "It is 18 °C in Paris."},
    {"role": "user", "content": "Thanks! And tomorrow?"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


@pytest.mark.parametrize("template", ["deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
                                      "GLM-4.7-Flash.jinja", "Qwen3.5-4B.jinja"])
def test_templates_render_two_turns_with_a_tool_call(template):
    source = (fixtures_dir("templates") / template).read_text(encoding="utf-8")
    text = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(CONVERSATION, tools=TOOLS)
    for needle in ("What is the weather in Paris?", "get_weather", "Paris", "18", "Thanks! And tomorrow?"):
        assert needle in text, (template, needle)
    assert text.index("What is the weather") < text.index("Thanks! And tomorrow?")


def test_encoding_a_long_text_lets_other_threads_run():
    """The server tokenizes on a worker thread; that only keeps its event loop free if the tokenizer
    releases the GIL while it works (tokenizers' encode does not, encode_batch does)."""
    import threading
    import time
    from pathlib import Path

    import ds4tvm

    tok = Tokenizer.from_gguf(open_gguf(Path(ds4tvm.__file__).parent / "data/demo/ds4-demo-target.gguf"))
    text = "def handler(request, *args):\n    return compute(request.value + 17)\n" * 40000
    gaps, done = [], threading.Event()

    def tick():
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(0.005)
            gaps.append(time.perf_counter() - t)

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    done.set()
    ticker.join()
    assert len(ids) > 100000 and took > 0.3, took   # long enough for a held GIL to show
    assert max(gaps) < took / 3, (max(gaps), took)
