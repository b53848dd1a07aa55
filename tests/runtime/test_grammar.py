"""Structured outputs (runtime/grammar.py) through the one speculative loop: every output of 200
seeded generations parses and validates against its schema (jsonschema, an independent validator),
sampled with and without a drafter (exact acceptance), on the trained demo pair (DSpark) and on a
tiny GLM-5.3 (its MTP layer); at temperature 0 a drafter changes no token."""

import json

import numpy as np
import pytest

from conftest import _once_per_run, compile_here, shared_tiny_glm

pytestmark = pytest.mark.compile

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "id", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "io"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}


def _embedded(d):
    """The trained demo pair, one generation at a time: without the batched functions of `ds4 demo`'s
    bounds (demo.BOUNDS: ds4 serve's four at once), its compile takes about half the time."""
    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import CompileRequest, compile_gguf
    from ds4tvm.demo import embedded_pair

    if not (d / "art" / "manifest.json").is_file():
        model, support = embedded_pair()
        compile_gguf(model, d / "art", CompileRequest("cpu", Bounds(max_context=512, max_verify=8, prefill_chunk=256),
                                                      progress=False, support=support))
    return d / "art"


@pytest.fixture(scope="module", params=["demo+dspark", "glm+mtp"])
def model(request, tmp_path_factory):
    """(engine, tokenizer, drafter class, prompt) of the trained demo pair or a tiny GLM-5.3."""
    from ds4tvm.runtime.drafters.dspark import DSparkDrafter
    from ds4tvm.runtime.drafters.glm_mtp import GLMMTPDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.tokenizer import Tokenizer

    if request.param == "demo+dspark":
        art, drafter = _once_per_run(tmp_path_factory, "embedded", _embedded), DSparkDrafter
    else:
        art, drafter = shared_tiny_glm(tmp_path_factory)[0], GLMMTPDrafter
    engine = Engine(art)
    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    return engine, tok, drafter, tok.encode("# one record as JSON\nrecord = ")


def _generate(model, constraint, params, seed: int, drafter=None, exact: bool = False):
    from ds4tvm.runtime.speculative import generate

    engine, tok, _, prompt = model
    engine.reset()
    out, _ = generate(engine, prompt, 96, params, np.random.default_rng(seed), drafter=drafter, exact=exact,
                      stop_ids=tok.stop_ids, constraint=constraint)
    return out


def test_every_sampled_output_follows_the_schema(model):
    """200 generations at temperature 0.9 (top-p 0.95), the odd ones with the drafter and exact
    acceptance: each ends with a stop token inside its budget, parses as JSON and validates."""
    import jsonschema

    from ds4tvm.runtime.grammar import Grammars
    from ds4tvm.runtime.sampler import SamplingParams

    engine, tok, drafter_class, _ = model
    grammars, params = Grammars(tok), SamplingParams(0.9, top_p=0.95)
    texts = set()
    for seed in range(200):
        drafted = seed % 2 == 1
        c = grammars.json_schema(SCHEMA)
        out = _generate(model, c, params, seed, drafter_class(engine) if drafted else None, drafted)
        assert out[-1] in tok.stop_ids and c.finished, (seed, tok.decode(out))
        text = tok.decode(out[:-1])
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 100   # sampled: the grammar leaves the model its choices


def test_a_drafter_changes_no_token_at_temperature_0(model):
    from ds4tvm.runtime.grammar import Grammars
    from ds4tvm.runtime.sampler import SamplingParams

    engine, tok, drafter_class, _ = model
    grammars, greedy = Grammars(tok), SamplingParams(0.0)
    for schema in (SCHEMA, {"type": "object"}):
        plain = _generate(model, grammars.json_schema(schema), greedy, 0)
        drafted = _generate(model, grammars.json_schema(schema), greedy, 0, drafter_class(engine))
        assert drafted == plain, (tok.decode(plain), tok.decode(drafted))


def test_mask_refuses_control_tokens_and_names_a_bad_schema(model):
    """Control tokens other than the stop tokens, and tokens holding a raw control character, are
    refused everywhere (xgrammar would allow their text inside a string); a schema xgrammar cannot
    compile is one line naming where it came from."""
    from ds4tvm.runtime.grammar import GrammarError, Grammars
    from ds4tvm.runtime.tokenizer import CONTROL

    _, tok, _, _ = model
    grammars = Grammars(tok)
    c = grammars.json_schema({"type": "string"})
    c.accept(tok.encode('"', add_bos=False)[0])   # inside a string: almost anything goes
    masked = c.mask(np.zeros(tok.n_vocab, np.float32))
    control = [i for i, t in enumerate(tok.token_types) if t == CONTROL and i not in tok.stop_ids]
    raw = [i for i in range(tok.n_vocab) if any(ord(ch) < 0x20 for ch in tok.decode([i]))]
    assert control and raw and np.isneginf(masked[control + raw]).all()
    assert np.isfinite(masked).sum() > tok.n_vocab // 2
    with pytest.raises(GrammarError, match=r"^the schema: Unsupported type \"objectx\"$"):
        grammars.json_schema({"type": "objectx"}, "the schema")


def test_text_stays_valid_utf8_across_tokens(model):
    """After a token ending in the lead byte ED, only 80..9F may follow (A0..BF would encode a
    surrogate, which xgrammar's decoder lets through); rolled back, the string goes on as before."""
    import xgrammar as xgr

    from ds4tvm.runtime.grammar import Grammars

    _, tok, _, _ = model
    decoded = xgr.TokenizerInfo(tok.tokens, xgr.VocabType.BYTE_LEVEL, vocab_size=tok.n_vocab).decoded_vocab
    ids = {b: i for i, b in enumerate(decoded)}
    c = Grammars(tok).json_schema({"type": "string"})
    c.accept(ids[b'"'])
    c.accept(ids[b"\xed"])
    masked = c.mask(np.zeros(tok.n_vocab, np.float32))
    follows = {b[0] for i, b in enumerate(decoded) if b and np.isfinite(masked[i])}
    assert follows and follows <= set(range(0x80, 0xA0)) and ids[b"\x9f"] in np.flatnonzero(np.isfinite(masked))
    c.rollback(1)
    assert np.isfinite(c.mask(np.zeros(tok.n_vocab, np.float32))[ids[b"a"]])


def test_ds4_run_json_schema(tmp_path_factory, tmp_path):
    """`ds4 run -j SCHEMA` (text or a file) on the tiny GLM: the printed text validates; a bad schema
    is one line, exit 2."""
    import jsonschema

    from conftest import run_ds4

    art = shared_tiny_glm(tmp_path_factory)[0]
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for schema in (json.dumps(SCHEMA), str(schema_file)):
        r = run_ds4("run", "-m", art, "--raw", "-p", "record = ", "-n", "96", "--temp", "0.9", "-s", "5",
                    "-j", schema, "--json")
        assert r.returncode == 0, r.stderr
        jsonschema.validate(json.loads(json.loads(r.stdout)["text"]), SCHEMA)
    for schema, says in (('{"type": "objectx"}', 'Unsupported type "objectx"'), ("[1]", "neither a JSON schema"),
                         ("{not json", "not JSON")):
        r = run_ds4("run", "-m", art, "-p", "x", "-j", schema)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _tiny_qwen(d):
    from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp

    if not (d / "art" / "manifest.json").is_file():
        d.mkdir(parents=True, exist_ok=True)
        gguf = write_random_qwen4exp(d / "qwen.gguf", tiny_config(), seed=1)
        compile_here(gguf, "--target", "llvm", "-o", d / "art", "--max-context", "512", "--quiet")
    return d / "art"


@pytest.mark.parametrize("family", ["glm5next", "qwen4exp"])
def test_forced_tool_calls_parse_in_the_familys_syntax(family, tmp_path_factory):
    """The grammar of a forced call (tool_choice "required" and a named tool) in GLM-5.3's and
    Qwen3.8's tool syntax (xgrammar's glm_4_7 and qwen_3_5 tags): every sampled output is a call the
    family's own parser reads, naming a given tool, its arguments following that tool's schema
    (DeepSeek-V4's DSML: tests/server/test_server_surface.py, through the server)."""
    import jsonschema

    from ds4tvm.families import family_named, load_attr
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.grammar import Grammars
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate
    from ds4tvm.runtime.tokenizer import Tokenizer

    art = (shared_tiny_glm(tmp_path_factory)[0] if family == "glm5next"
           else _once_per_run(tmp_path_factory, "grammar-qwen4exp", _tiny_qwen))
    syntax = load_attr(family_named(family).tool_syntax)
    engine = Engine(art)
    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    schemas = {"get_weather": SCHEMA, "now": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    grammars = Grammars(tok)
    for seed, choice in enumerate(["required"] * 3 + [{"type": "function", "function": {"name": "get_weather"}}]):
        engine.reset()
        c, parser, text = grammars.tool_calls(syntax.XGRAMMAR, tools, choice), syntax(), []

        def on_token(t):   # the turn ends as the server ends it: a complete call followed by other text
            text.append(t)
            return parser.closed_block(tok.decode(text))

        out, _ = generate(engine, tok.encode("call a tool: "), 300, SamplingParams(0.9), np.random.default_rng(seed),
                          stop_ids=tok.stop_ids, constraint=c, on_token=on_token)
        calls = parser.parse(tok.decode([t for t in out if t not in tok.stop_ids]))
        assert calls and (c.finished or parser.closed_block(tok.decode(out))), (seed, tok.decode(out))
        for call in calls:
            jsonschema.validate(call["arguments"], schemas[call["name"]])
        assert isinstance(choice, str) or {call["name"] for call in calls} == {"get_weather"}
