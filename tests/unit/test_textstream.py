"""TextStream (what `ds4 run` prints and the server sends) against the tokenizer's own decode of
the whole output, and the DSML tool-call syntax."""

import numpy as np
import pytest

from ds4tvm.gguf.vocab import synthetic_vocab
from ds4tvm.runtime.textstream import TextStream
from ds4tvm.runtime.tokenizer import Tokenizer
from ds4tvm.families.deepseek4.tools import DSMLToolSyntax as ToolSyntax

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    meta = dict(synthetic_vocab(512))
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][0]
    return Tokenizer.from_metadata(meta)


def _stream(tok, ids, **kw):
    s = TextStream(tok, tok.stop_ids, **kw)
    pieces = [s.push(t) for t in ids]
    pieces.append(s.finish())
    return s, pieces


@pytest.mark.parametrize("seed", range(20))
def test_streamed_pieces_join_to_the_whole_decode(tok, seed):
    rng = np.random.default_rng(seed)
    # bytes-only tokens (4..259) make partial UTF-8 characters common, merged tokens make words
    ids = [int(i) for i in rng.integers(4, 512 if seed % 2 else 260, size=60)]
    s, pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == s.content()


def test_multibyte_characters_are_released_whole(tok):
    ids = tok.encode("naïve café — 東京 ok", add_bos=False)
    s, pieces = _stream(tok, ids)
    assert "".join(pieces) == "naïve café — 東京 ok"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_token_ends_the_text_without_its_text(tok):
    ids = tok.encode("Hello world", add_bos=False) + [tok.eos_id] + tok.encode(" after", add_bos=False)
    s, pieces = _stream(tok, ids)
    assert "".join(pieces) == "Hello world" and s.stop_token and s.stopped


@pytest.mark.parametrize("stop", ["world", "o w", "d!", "Hello"])
def test_stop_string_cuts_before_it_and_is_never_streamed(tok, stop):
    text = "Hello world! Hello world!"
    ids = tok.encode(text, add_bos=False)
    s, pieces = _stream(tok, ids, stop_strings=[stop, "zzz"])
    assert "".join(pieces) == text[:text.index(stop)]
    assert s.stop_string == stop


def test_tool_call_block_is_not_content_and_is_parsed(tok):
    block = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">[1, 2]</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    ids = tok.encode("Let me check.\n\n" + block, add_bos=False)
    s = TextStream(tok, tok.stop_ids, tools=ToolSyntax())
    pieces, open_at = [], []
    for t in ids:
        pieces.append(s.push(t))
        open_at.append(s.in_tool_call)
    pieces.append(s.finish())
    assert "".join(pieces) == "Let me check." == s.content()
    assert s.tool_calls() == [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]
    assert any(open_at) and not open_at[-1]   # greedy mode while the block is open, not after it closes
    assert ToolSyntax().closed_block(s.text)


def test_text_that_only_looks_like_a_block_start_is_released(tok):
    text = "a <｜DSML| b\n\n c "
    ids = tok.encode(text, add_bos=False)
    s, pieces = _stream(tok, ids, tools=ToolSyntax())
    assert "".join(pieces) == text and s.tool_calls() == []


def test_malformed_json_argument_is_kept_as_text():
    text = ('<｜DSML｜tool_calls><｜DSML｜invoke name="f">'
            '<｜DSML｜parameter name="x" string="false">{not json</｜DSML｜parameter></｜DSML｜invoke>')
    assert ToolSyntax().parse(text) == [{"name": "f", "arguments": {"x": "{not json"}}]
