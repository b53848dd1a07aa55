"""Prefix reuse in `ds4 serve` through the real `openai` and `anthropic` clients, on the demo
artifact at temperature 0: a conversation continues from the slot (or checkpoint) that holds its
prefix, reports the reused tokens, and every answer equals a fresh server's; slots, checkpoints on
disk across a restart (and damaged ones), `ds4 run --session`, and --api-key.

The demo model writes random tokens, whose text does not encode back to the same tokens, so the
next turn's prompt shares the previous prompt with the slot but diverges early in the re-rendered
answer: the reuse asserted here is the previous prompt (a checkpoint is taken after every prefill).
Continuations that are token-exact reuse everything (the --session test, tests/runtime/test_prefix.py)."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import run_ds4
from serving import ServerProcess

pytestmark = pytest.mark.compile

N = 24
SYSTEM = "You answer in one line. " * 12


def _conversation(tag: str, turns: int = 4) -> list[list[dict]]:
    """The user turns of a conversation, appended to as answers come back."""
    return [{"role": "user", "content": f"{tag} question {i}: what is the sea like today?"} for i in range(turns)]


def _openai(server, key="unused"):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _anthropic(server, key="unused"):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def _ask_openai(server, messages, stream=False):
    """(answer, prompt_tokens, cached_tokens) for one chat request."""
    c = _openai(server)
    if not stream:
        r = c.chat.completions.create(model="demo", messages=messages, max_tokens=N, temperature=0)
        return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    text, usage = "", None
    for chunk in c.chat.completions.create(model="demo", messages=messages, max_tokens=N, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def _ask_anthropic(server, messages):
    # this client has no sampling fields (the 2026 Messages API dropped them): ours go as extra body
    r = _anthropic(server).messages.create(model="demo", system=messages[0]["content"], messages=messages[1:],
                                           max_tokens=N, extra_body={"temperature": 0})
    u = r.usage
    return "".join(b.text for b in r.content), u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens


def _talk(server, users, ask=_ask_openai, answers=None):
    """Plays the conversation; answers: the assistant turns to send back (default: the server's own)."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for i, user in enumerate(users):
        messages.append(user)
        text, prompt, cached = ask(server, list(messages))
        out.append((text, prompt, cached))
        messages.append({"role": "assistant", "content": answers[i] if answers else text})
    return out


def _fresh_answers(art, users) -> list[str]:
    """Each turn asked of a server started for it, so nothing is reused."""
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for user in users:
        messages.append(user)
        server = ServerProcess("-m", art, "--alias", "demo")
        try:
            text, _, cached = _ask_openai(server, list(messages))
        finally:
            server.stop()
        assert cached == 0
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
    return answers


@pytest.fixture(scope="module")
def art(demo_pair):
    return demo_pair[2]


@pytest.fixture(scope="module")
def reference(art):
    users = _conversation("A")
    return users, _fresh_answers(art, users)


def _check_reuse(turns, answers, seen: bool = False):
    """Answers equal the fresh server's; from turn 2 on at least the previous prompt is reused (and
    the first turn's, when the server has seen the conversation before)."""
    assert [t[0] for t in turns] == answers
    assert turns[0][2] == (turns[0][1] - 1 if seen else 0)
    for (_, prev_prompt, _), (_, prompt, cached) in zip(turns, turns[1:]):
        assert prev_prompt - 1 <= cached < prompt


# the DSpark case is the plain one with the drafter's rings fed too: kept under -m slow for the suite's time
@pytest.mark.parametrize("mode", ["plain", pytest.param("dspark", marks=pytest.mark.slow)])
def test_a_conversation_continues_from_its_prefix_and_answers_as_a_fresh_server(art, reference, mode):
    users, answers = reference
    server = ServerProcess("-m", art, "--alias", "demo", *(["--dspark"] if mode == "dspark" else []))
    try:
        _check_reuse(_talk(server, users), answers)
        _check_reuse(_talk(server, users, ask=_ask_anthropic), answers, seen=True)
        _check_reuse(_talk(server, users, ask=lambda s, m: _ask_openai(s, m, stream=True)), answers, seen=True)
    finally:
        log = server.stop()
    assert "warning" not in log


def test_interleaved_conversations_keep_their_slots_or_evict_each_other(art, reference):
    users_a, answers_a = reference
    users_b = _conversation("B", 3)
    answers_b = _fresh_answers(art, users_b)
    for args, reused in ((["--slots", "2"], True), (["--slots", "1"], True),
                         (["--slots", "1", "--kv-cache-size", "0"], False)):
        server = ServerProcess("-m", art, "--alias", "demo", *args)
        try:
            msgs = {"A": [{"role": "system", "content": SYSTEM}], "B": [{"role": "system", "content": SYSTEM}]}
            got, last_prompt = {"A": [], "B": []}, {}
            for i in range(3):
                for name, users in (("A", users_a), ("B", users_b)):
                    msgs[name].append(users[i])
                    text, prompt, cached = _ask_openai(server, msgs[name])
                    got[name].append(text)
                    msgs[name].append({"role": "assistant", "content": text})
                    if i and reused:
                        assert cached >= last_prompt[name] - 1, (args, name, i)
                    elif i:   # the other conversation took the only slot, and nothing was checkpointed
                        assert cached == 0, (args, name, i)
                    last_prompt[name] = prompt
            assert got == {"A": answers_a[:3], "B": answers_b}, args
        finally:
            server.stop()


def _checkpoints(d):
    return sorted(d.glob("*.ds4state"))


def test_checkpoints_on_disk_survive_a_restart_and_damaged_ones_are_recomputed(art, reference, tmp_path):
    users, answers = reference
    kv = tmp_path / "kv"
    args = ("-m", art, "--alias", "demo", "--kv-cache-dir", kv)
    server = ServerProcess(*args)
    try:
        first = _talk(server, users[:2])
    finally:
        server.stop()
    files = _checkpoints(kv)
    assert len(files) == 4                       # after each prompt and each answer
    pristine = {p: p.read_bytes() for p in files}
    messages = [{"role": "system", "content": SYSTEM}, users[0], {"role": "assistant", "content": answers[0]},
                users[1], {"role": "assistant", "content": answers[1]}, users[2]]

    def damage(how):
        for p, raw in pristine.items():
            p.write_bytes(how(raw))

    def foreign(raw):
        return raw.replace(raw[raw.index(b'"artifact": "') + 13:][:16], b"0123456789abcdef", 1)

    def flip(raw):
        b = bytearray(raw)
        b[-3] ^= 0x10
        return bytes(b)

    for name, how in (("intact", None), ("flipped", flip), ("truncated", lambda raw: raw[:len(raw) // 2]),
                      ("foreign", foreign)):
        for p in list(kv.iterdir()):
            p.unlink()
        damage(how or (lambda raw: raw))
        server = ServerProcess(*args)
        try:
            text, prompt, cached = _ask_openai(server, messages)
        finally:
            log = server.stop()
        warnings = [line for line in log.splitlines() if "warning" in line]
        assert text == answers[2], name
        if how is None:
            assert cached >= first[1][1] - 1 and not warnings
        else:
            assert cached == 0 and warnings, (name, log)
            assert all(line.startswith("ds4: warning: ") and ".ds4state" in line for line in warnings), log
            assert len(warnings) == len({line.split(":")[2] for line in warnings})   # one per file


@pytest.mark.slow   # the store's size bound runs by default in tests/runtime/test_prefix.py; this is it through a server
def test_the_checkpoint_directory_stays_within_its_size(art, reference, tmp_path):
    users, _ = reference
    kv, limit = tmp_path / "kv", 1_200_000
    server = ServerProcess("-m", art, "--alias", "demo", "--kv-cache-dir", kv, "--kv-cache-size", str(limit))
    try:
        for i in range(4):
            _talk(server, _conversation(f"C{i}", 2))
            assert 0 < sum(p.stat().st_size for p in kv.iterdir()) <= limit
    finally:
        server.stop()


def test_run_session_continues_without_rereading(art, tmp_path):
    session = tmp_path / "chat.session"

    def run(tokens, *extra):
        r = run_ds4("run", "-m", art, "--tokens", ",".join(map(str, tokens)), "-n", N, "--temp", 0, "--json",
                    *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    first, _ = run([5, 6, 7, 8], "--session", session)
    second, _ = run([40, 41, 42], "--session", session)
    whole, _ = run([5, 6, 7, 8] + first["tokens"] + [40, 41, 42])
    assert second["tokens"] == whole["tokens"]
    assert second["n_prompt"] == whole["n_prompt"] and second["n_cached"] >= 4 + len(first["tokens"]) - 2
    raw = bytearray(session.read_bytes())
    raw[-2] ^= 1
    session.write_bytes(bytes(raw))
    r = run_ds4("run", "-m", art, "--tokens", "40,41,42", "-n", N, "--temp", 0, "--session", session)
    assert r.returncode == 2 and session.read_bytes() == bytes(raw), r.stderr   # refused, the file untouched
    assert len(r.stderr.strip().splitlines()) == 1 and "(checksum mismatch)" in r.stderr
    again, err = run([40, 41, 42], "--session", session, "--session-overwrite")
    alone, _ = run([40, 41, 42])
    assert again["tokens"] == alone["tokens"] and again["n_cached"] == 0
    assert len(err.strip().splitlines()) == 1 and "(checksum mismatch); starting a new conversation" in err


def test_run_session_continues_a_chat(art, tmp_path):
    """Chat turns with -p: the second is the template over both turns, its answer that of a cold
    start on the whole conversation; the demo's answer re-renders into other tokens, so the session
    keeps the state after the first prompt and the second turn prefills from there."""
    from ds4tvm.runtime.chat import chat_prompt_ids
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate
    from ds4tvm.runtime.tokenizer import Tokenizer

    session, turns = tmp_path / "chat.session", []
    for text in ("Hi there", "And then?"):
        r = run_ds4("run", "-m", art, "-p", text, "-n", N, "--temp", 0, "--json", "--session", session)
        assert r.returncode == 0 and not r.stderr.strip(), r.stderr
        turns.append(json.loads(r.stdout))
    engine = Engine(art)
    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    whole = chat_prompt_ids(tok, [{"role": "user", "content": "Hi there"},
                                  {"role": "assistant", "content": turns[0]["text"]},
                                  {"role": "user", "content": "And then?"}])
    want, _ = generate(engine, whole, N, SamplingParams(0.0), np.random.default_rng(0), stop_ids=tok.stop_ids)
    assert turns[1]["tokens"] == want and turns[1]["n_prompt"] == len(whole)
    assert turns[1]["n_cached"] == turns[0]["n_prompt"] - 1


def test_api_key(art, monkeypatch):
    import anthropic
    import openai

    server = ServerProcess("-m", art, "--alias", "demo", "--api-key", "s3cret")
    try:
        ask = [{"role": "user", "content": "hi"}]
        assert _openai(server, "s3cret").chat.completions.create(model="demo", messages=ask, max_tokens=4)
        assert _anthropic(server, "s3cret").messages.create(model="demo", messages=ask, max_tokens=4)
        for key in ("wrong", "s3cret-but-longer"):
            with pytest.raises(openai.AuthenticationError):
                _openai(server, key).chat.completions.create(model="demo", messages=ask, max_tokens=4)
            with pytest.raises(anthropic.AuthenticationError):
                _anthropic(server, key).messages.create(model="demo", messages=ask, max_tokens=4)
        for path, shape in (("/v1/chat/completions", "error"), ("/v1/messages", "type"), ("/v1/models", "error")):
            req = urllib.request.Request(server.url + path, data=None if path.endswith("models") else b"{}",
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            body = json.loads(e.value.read())
            assert e.value.code == 401 and shape in body
            if path == "/v1/messages":
                assert body["error"]["type"] == "authentication_error"
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
    finally:
        server.stop()
    monkeypatch.setenv("DS4_API_KEY", "from-env")
    exposed = ServerProcess("-m", art, "--alias", "demo", "--host", "0.0.0.0")
    try:
        with pytest.raises(openai.AuthenticationError):
            _openai(exposed).models.list()
        assert _openai(exposed, "from-env").models.list()
    finally:
        log = exposed.stop()
    assert "without --api-key" not in log
    monkeypatch.delenv("DS4_API_KEY")
    open_server = ServerProcess("-m", art, "--alias", "demo", "--host", "0.0.0.0")
    log = open_server.stop()
    assert len([x for x in log.splitlines() if "warning: listening on 0.0.0.0 without --api-key" in x]) == 1


def test_bad_reuse_flags_are_one_line_errors(art, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for flags, says in ((["--slots", "0"], "--slots 0: expected at least 1"),
                        (["--kv-cache-size", "4XB"], "--kv-cache-size '4XB': expected a size"),
                        (["--kv-cache-dir", not_a_dir], "not a directory"),
                        (["--api-key", " "], "--api-key: the key is empty"),
                        (["--parallel", "0"], "--parallel 0: expected 1..64")):
        r = run_ds4("serve", "-m", art, *flags)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], (flags, r.stderr)
