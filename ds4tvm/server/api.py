"""Request bodies of the OpenAI (chat/completions, completions) and Anthropic (messages) APIs ->
validated generation jobs, and results -> response bodies. Every user mistake is an ApiError that
names the field at fault; the HTTP layer turns it into a 4xx in the API's own error shape."""

from __future__ import annotations

import itertools
import json
import math
import secrets
import time
from dataclasses import dataclass

from ..errors import Ds4Error
from ..runtime.chat import chat_prompt_ids
from ..runtime.grammar import GrammarError
from ..runtime.sampler import SamplingParams
from .service import Job, Result

MAX_STOP = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def anthropic(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(self.status,
                                                                                                  self.kind)
        if self.status >= 500:
            kind = "api_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}


@dataclass
class Defaults:
    """The server's sampling defaults (the `ds4 run` flags given to `ds4 serve`)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.05


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# ---------------------------------------------------------------------------- field checks
_TYPES = {"string": str, "object": dict, "array": list, "boolean": bool}


def field(body: dict, key: str, kind: str, default=None, required: bool = False):
    """body[key] checked against kind: string, object, array, boolean, integer or number."""
    if key not in body or body[key] is None:
        if required:
            raise ApiError(400, f"'{key}' is required", key)
        return default
    v = body[key]
    if kind == "integer":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind == "number":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    else:
        ok = isinstance(v, _TYPES[kind])
    if not ok:
        raise ApiError(400, f"'{key}' must be {'an' if kind[0] in 'aeio' else 'a'} {kind}, got {json.dumps(v)[:60]}",
                       key)
    return v


def sampling(body: dict, d: Defaults, top_p_key: str = "top_p") -> SamplingParams:
    t = field(body, "temperature", "number", d.temperature)
    if t < 0:
        raise ApiError(400, f"'temperature' must be >= 0, got {t}", "temperature")
    top_p = field(body, top_p_key, "number", d.top_p)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'{top_p_key}' must be in (0, 1], got {top_p}", top_p_key)
    top_k = field(body, "top_k", "integer", d.top_k)
    if top_k < 0:
        raise ApiError(400, f"'top_k' must be >= 0, got {top_k}", "top_k")
    min_p = field(body, "min_p", "number", d.min_p)
    if not 0 <= min_p <= 1:
        raise ApiError(400, f"'min_p' must be in [0, 1], got {min_p}", "min_p")
    return SamplingParams(float(t), float(top_p), int(top_k), float(min_p))


def seed(body: dict) -> int | None:
    value = field(body, "seed", "integer")
    if value is not None and not 0 <= value < 2**63:
        raise ApiError(400, f"'seed' must be in [0, 2^63), got {value}", "seed")
    return value


def stop_strings(body: dict, key: str = "stop") -> tuple[str, ...]:
    v = body.get(key)
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOP:
        raise ApiError(400, f"'{key}' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings",
                       key)
    return tuple(items)


def check_model(body: dict, served: str) -> None:
    """Any model name: this server serves one model, as llama-server does (clients and proxies send
    names of their own; the answers carry the served one)."""
    field(body, "model", "string", required=True)


def budget(service, prompt: list[int], max_tokens: int | None, key: str, prompt_key: str = "messages") -> int:
    """The tokens a job may generate: what was asked for, within the context (--ctx)."""
    room = service.ctx - len(prompt)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; the context holds {service.ctx} "
                            f"(prompt plus at least one generated token)", prompt_key, "context_length_exceeded")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'{key}' must be >= 1, got {max_tokens}", key)
    return room if max_tokens is None else min(max_tokens, room)


def _text(content, where: str) -> str:
    """Message content: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be a string or a list of content parts", where)
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, f"'{where}.content[{i}]' must be an object with a 'type'", where)
        if part["type"] != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"'{where}.content[{i}]': only text parts are supported, got "
                                f"type {part['type']!r}", where)
        out.append(part["text"])
    return "".join(out)


def check_length(service, n_chars: int, param: str) -> None:
    """A text of more than ctx x (the longest token's characters) cannot fit the context: refused
    before it is rendered or tokenized (which takes seconds for megabytes)."""
    limit = service.ctx * service.tok.longest_token
    if n_chars > limit:
        raise ApiError(400, f"the prompt has {n_chars:,} characters; the context of {service.ctx} tokens holds at "
                            f"most {limit:,}", param, "context_length_exceeded")


def _prompt(service, messages: list[dict], tools: list[dict] | None) -> list[int]:
    check_length(service, sum(len(m.get("content") or "") for m in messages), "messages")
    try:
        ids = chat_prompt_ids(service.tok, messages, tools, max_tokens=service.ctx)
    except Ds4Error as e:
        raise ApiError(400, e.message, "messages") from None
    if not ids:
        raise ApiError(400, "the rendered prompt is empty", "messages")
    return ids


# ---------------------------------------------------------------------------- OpenAI
ROLES = ("system", "developer", "user", "assistant", "tool")


def openai_tools(body: dict) -> list[dict] | None:
    tools = field(body, "tools", "array")
    if not tools or body.get("tool_choice") == "none":
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "tools")
    return tools


def refuse_unsupported(body: dict, tool_choices: tuple = ("auto", "none"), openai: bool = True) -> None:
    """Fields a client may send that this server does not act on yet are a 400 naming the field,
    never accepted and ignored (a client asking for a forced tool call must not get unconstrained
    text as if it were that). openai: an OpenAI endpoint (response_format and logprobs apply)."""
    for key in ("response_format", "logprobs", "top_logprobs"):
        if not openai and body.get(key) not in (None, False):
            raise ApiError(400, f"'{key}' is not supported on this endpoint", key)
    for key in ("echo", "suffix", "best_of"):
        if body.get(key) not in (None, False) and not (key == "best_of" and body[key] == 1):
            raise ApiError(400, f"'{key}' is not supported by this server", key)
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and kind not in tool_choices:
        raise ApiError(400, f"'tool_choice' {json.dumps(choice)[:80]} is not supported by this server (only "
                            f"{' and '.join(tool_choices)}: the model chooses whether to call a tool)", "tool_choice")


def response_format(body: dict, service):
    """The grammar OpenAI's `response_format` asks for (runtime/grammar.py), or None for text."""
    fmt = body.get("response_format")
    kinds = ("text", "json_object", "json_schema")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
        raise ApiError(400, f"'response_format.type' must be one of {', '.join(kinds)}", "response_format")
    if body.get("tools"):
        raise ApiError(400, "'response_format' cannot be combined with 'tools' on this server (the grammar "
                            "would forbid the tool-call syntax)", "response_format")
    try:
        if fmt["type"] == "json_object":
            return service.grammars.json_object()
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object", "response_format")
        return service.grammars.json_schema(spec["schema"], "'response_format.json_schema.schema'")
    except GrammarError as e:
        raise ApiError(400, e.message, "response_format") from None


def logprobs_request(body: dict, chat: bool) -> int | None:
    """How many top alternatives to report with each token's log-probability, or None: chat's
    `logprobs` (boolean) + `top_logprobs`, completions' `logprobs` (a count). Not with streaming."""
    if chat:
        top = field(body, "top_logprobs", "integer")
        if top is not None and not body.get("logprobs"):
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        n = (top or 0) if field(body, "logprobs", "boolean", False) else None
    else:
        n = None if body.get("logprobs") is False else field(body, "logprobs", "integer")
    if n is not None and not 0 <= n <= 20:
        raise ApiError(400, f"'{'top_logprobs' if chat else 'logprobs'}' must be 0 to 20, got {n}",
                       "top_logprobs" if chat else "logprobs")
    if n is not None and body.get("stream"):
        raise ApiError(400, "'logprobs' with 'stream' is not supported by this server (ask without streaming)",
                       "logprobs")
    return n


def forcing(service) -> tuple:
    """The tool_choice kinds this server acts on: a forced call ("required", a named function)
    needs the family's tool syntax to name its xgrammar format."""
    forced = ("required", "function") if getattr(service.tool_syntax, "XGRAMMAR", None) else ()
    return ("auto", "none", *forced)


def forced_call(service, tools: list[dict] | None, choice):
    """The grammar of a forced tool call (OpenAI's tool_choice "required" or a named function, as
    xgrammar takes it), or None when the model chooses."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if tools is None or kind not in ("required", "function"):
        return None
    if kind == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in [t["function"]["name"] for t in tools]:
            raise ApiError(400, f"'tool_choice' names {json.dumps(name)}, which is not one of 'tools'", "tool_choice")
    try:
        return service.grammars.tool_calls(service.tool_syntax.XGRAMMAR, tools, choice)
    except GrammarError as e:
        raise ApiError(400, e.message, "tool_choice") from None


def chat_job(body: dict, service, served: str, d: Defaults) -> tuple[Job, dict]:
    check_model(body, served)
    refuse_unsupported(body, forcing(service))
    messages = field(body, "messages", "array", required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty", "messages")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}", "messages")
        msg = {"role": m["role"], "content": _text(m.get("content"), where)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      and isinstance(c["function"].get("name"), str) for c in calls):
                raise ApiError(400, f"'{where}.tool_calls' must be a list of {{\"function\": {{\"name\", "
                                    f"\"arguments\"}}}}", "messages")
            msg["tool_calls"] = calls
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        clean.append(msg)
    if field(body, "n", "integer", 1) != 1:
        raise ApiError(400, "'n' must be 1 (one choice per request)", "n")
    tools = openai_tools(body)
    params = sampling(body, d)
    prompt = _prompt(service, clean, tools)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    job = Job(prompt, budget(service, prompt, field(body, key, "integer"), key), params,
              seed=seed(body), stop=stop_strings(body), tools=tools is not None,
              constraint=response_format(body, service) or forced_call(service, tools, body.get("tool_choice")),
              logprobs=logprobs_request(body, chat=True))
    stream_opts = field(body, "stream_options", "object", {})
    return job, {"stream": field(body, "stream", "boolean", False),
                 "include_usage": bool(stream_opts.get("include_usage"))}


def completion_job(body: dict, service, served: str, d: Defaults) -> tuple[Job, dict]:
    check_model(body, served)
    refuse_unsupported(body)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]   # a batch of one
    if isinstance(p, str):
        check_length(service, len(p), "prompt")
        prompt = service.tok.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < service.tok.n_vocab]
        if bad:
            raise ApiError(400, f"'prompt': token id {bad[0]} is outside the vocabulary of {service.tok.n_vocab}",
                           "prompt")
        prompt = list(p)
    else:
        raise ApiError(400, "'prompt' must be a string, or a non-empty list of token ids (one prompt per request)",
                       "prompt")
    if not prompt:
        raise ApiError(400, "'prompt' is empty", "prompt")
    if field(body, "n", "integer", 1) != 1:
        raise ApiError(400, "'n' must be 1 (one choice per request)", "n")
    params = sampling(body, d)
    job = Job(prompt, budget(service, prompt, field(body, "max_tokens", "integer", 16), "max_tokens", "prompt"),
              params, seed=seed(body), stop=stop_strings(body), constraint=response_format(body, service),
              logprobs=logprobs_request(body, chat=False))
    stream_opts = field(body, "stream_options", "object", {})
    return job, {"stream": field(body, "stream", "boolean", False),
                 "include_usage": bool(stream_opts.get("include_usage"))}


def openai_usage(r: Result) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def anthropic_usage(r: Result) -> dict:
    """Anthropic counts the prompt tokens read from a cache apart from input_tokens."""
    return {"input_tokens": r.prompt_tokens - r.cached_tokens, "cache_read_input_tokens": r.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": r.completion_tokens}


def openai_tool_calls(r: Result) -> list[dict]:
    return [{"id": new_id("call_"), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in r.tool_calls]


def chat_logprobs(r: Result, tok) -> dict | None:
    """OpenAI chat's `logprobs`: each generated token with its text, bytes and top alternatives."""
    def one(t, lp):
        return {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.token_bytes(t))}

    if r.logprobs is None:
        return None
    return {"content": [dict(one(t, lp), top_logprobs=[one(i, x) for i, x in top]) for t, lp, top in r.logprobs]}


def completion_logprobs(r: Result, tok) -> dict | None:
    """OpenAI completions' `logprobs`: tokens, their log-probabilities, the top ones, text offsets."""
    if r.logprobs is None:
        return None
    texts = [tok.decode([t]) for t, _, _ in r.logprobs]
    offsets = [0, *itertools.accumulate(len(x) for x in texts)][:len(texts)]
    return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in r.logprobs],
            "top_logprobs": [{tok.decode([i]): x for i, x in top} for _, _, top in r.logprobs], "text_offset": offsets}


def chat_response(r: Result, rid: str, created: int, served: str, tok=None) -> dict:
    msg = {"role": "assistant", "content": r.content}
    if r.tool_calls:
        msg["tool_calls"] = openai_tool_calls(r)
    out = {"id": rid, "object": "chat.completion", "created": created, "model": served,
           "choices": [{"index": 0, "message": msg, "finish_reason": r.finish_reason,
                        "logprobs": chat_logprobs(r, tok)}],
           "usage": openai_usage(r)}
    if r.spec is not None:
        out["ds4_speculation"] = r.spec
    return out


def chat_chunk(rid: str, created: int, served: str, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def completion_response(r: Result, rid: str, created: int, served: str, tok=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": served,
            "choices": [{"index": 0, "text": r.content, "finish_reason": r.finish_reason,
                         "logprobs": completion_logprobs(r, tok)}],
            "usage": openai_usage(r)}


def completion_chunk(rid: str, created: int, served: str, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": served,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}


# ---------------------------------------------------------------------------- Anthropic
def _anthropic_blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}.content' must be a string or a list of content blocks", "messages")
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") not in ("text", "tool_use", "tool_result"):
            kind = b.get("type") if isinstance(b, dict) else None
            raise ApiError(400, f"'{where}.content[{i}]': only text, tool_use and tool_result blocks are "
                                f"supported, got {kind!r}", "messages")
    return content


def anthropic_messages(body: dict) -> list[dict]:
    """Anthropic messages (+ system) as the OpenAI-style messages chat templates understand."""
    out = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            system = _text(system, "system")
        if not isinstance(system, str):
            raise ApiError(400, "'system' must be a string or a list of text blocks", "system")
        out.append({"role": "system", "content": system})
    messages = field(body, "messages", "array", required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"'{where}.role' must be user or assistant", "messages")
        blocks = _anthropic_blocks(m.get("content"), where)
        text = "".join(b.get("text", "") for b in blocks if b["type"] == "text")
        if m["role"] == "assistant":
            calls = [{"id": b.get("id"), "type": "function",
                      "function": {"name": b.get("name"), "arguments": b.get("input") or {}}}
                     for b in blocks if b["type"] == "tool_use"]
            msg = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in blocks:
            if b["type"] == "tool_result":
                c = b.get("content")
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text(c if isinstance(c, (list, str)) else None, where)})
        if text or not any(b["type"] == "tool_result" for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def anthropic_tools(body: dict) -> list[dict] | None:
    tools = field(body, "tools", "array")
    choice = body.get("tool_choice")
    if not tools or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise ApiError(400, f"'tools[{i}]' must be an object with a 'name'", "tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                      "parameters": t.get("input_schema", {})}})
    return out


def count_tokens(body: dict, service, served: str, d: Defaults) -> dict:
    """Anthropic's /v1/messages/count_tokens: the prompt's tokens as a request would render them."""
    check_model(body, served)
    return {"input_tokens": len(_prompt(service, anthropic_messages(body), anthropic_tools(body)))}


def tokenize(body: dict, service, served: str, d: Defaults) -> dict:
    """llama-server's /tokenize: {"content": text[, "add_special": bool]} -> {"tokens": ids}."""
    text = field(body, "content", "string", required=True)
    check_length(service, len(text), "content")
    return {"tokens": service.tok.encode(text, add_bos=bool(field(body, "add_special", "boolean", False)))}


def detokenize(body: dict, service, served: str, d: Defaults) -> dict:
    """llama-server's /detokenize: {"tokens": ids} -> {"content": text}."""
    ids = field(body, "tokens", "array", required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < service.tok.n_vocab for t in ids):
        raise ApiError(400, f"'tokens' must be token ids of the vocabulary of {service.tok.n_vocab}", "tokens")
    return {"content": service.tok.decode(ids)}


def messages_job(body: dict, service, served: str, d: Defaults) -> tuple[Job, dict]:
    check_model(body, served)
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    forced_kinds = ("any", "tool") if "required" in forcing(service) else ()
    refuse_unsupported(body, ("auto", "none", *forced_kinds), openai=False)
    max_tokens = field(body, "max_tokens", "integer", required=True)
    messages = anthropic_messages(body)
    tools = anthropic_tools(body)
    name = choice.get("name") if kind == "tool" else None
    forced = forced_call(service, tools, {"any": "required", "tool": {"type": "function", "function": {"name": name}}}.get(kind))
    params = sampling(body, d)
    prompt = _prompt(service, messages, tools)
    job = Job(prompt, budget(service, prompt, max_tokens, "max_tokens"), params,
              seed=seed(body), stop=stop_strings(body, "stop_sequences"), tools=tools is not None, constraint=forced)
    return job, {"stream": field(body, "stream", "boolean", False)}


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_stop_reason(r: Result) -> str:
    return "stop_sequence" if r.stop_sequence is not None else STOP_REASONS[r.finish_reason]


def anthropic_tool_blocks(r: Result) -> list[dict]:
    return [{"type": "tool_use", "id": new_id("toolu_"), "name": c["name"], "input": c["arguments"]}
            for c in r.tool_calls]


def message_response(r: Result, mid: str, served: str) -> dict:
    content = ([{"type": "text", "text": r.content}] if r.content else []) + anthropic_tool_blocks(r)
    return {"id": mid, "type": "message", "role": "assistant", "model": served, "content": content,
            "stop_reason": anthropic_stop_reason(r), "stop_sequence": r.stop_sequence,
            "usage": anthropic_usage(r)}


def now() -> int:
    return int(time.time())
