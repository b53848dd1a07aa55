"""Chat rendering with the GGUF's own jinja template (`tokenizer.chat_template`).

The environment follows what HF transformers gives templates (sandboxed, trim/lstrip blocks,
loop controls, `raise_exception`, `tojson` without ASCII escaping, `strftime_now`), plus the
`from_json` filter that the DeepSeek-V4 templates use for string tool arguments.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

from ..errors import Ds4Error


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    raise Ds4Error(f"chat template: {message}")


MAX_OPERATIONS = 5_000_000   # calls, attribute and item lookups in one rendering (a long chat: ~10^5)
MAX_SECONDS = 10.0


def _environment():
    import time

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Bounded(ImmutableSandboxedEnvironment):
        """A template comes with the model file, and a hostile one could loop for hours: every call,
        attribute and item lookup spends from a budget of operations and time (jinja's sandbox caps
        range() itself); one environment per rendering."""
        spent, deadline = 0, float("inf")

        def _spend(self):
            self.spent += 1
            if self.spent > MAX_OPERATIONS or (self.spent % 4096 == 0 and time.monotonic() > self.deadline):
                raise SecurityError(f"rendering exceeds {MAX_OPERATIONS:,} operations or {MAX_SECONDS:g} s")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            __self._spend()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self._spend()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self._spend()
            return super().getitem(obj, argument)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _normalise(messages: list[dict]) -> list[dict]:
    """OpenAI clients send tool-call arguments as a JSON string; templates iterate them as a
    mapping (`arguments|items`), so they get the parsed object."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise Ds4Error(f"tool call {fn.get('name', '?')}: arguments are not valid "
                                   f"JSON") from None
    return out


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2

        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._env = _environment()
            self._template = self._env.from_string(source)
        except jinja2.TemplateError as e:
            raise Ds4Error(f"chat template does not parse: {e}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, max_chars: int | None = None, **kwargs: Any) -> str:
        """The conversation rendered; max_chars: a longer rendering is a Ds4Error (stopped as soon as
        it is known)."""
        import time

        variables = dict(messages=_normalise(messages), add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        if tools:
            variables["tools"] = tools
        self._env.spent, self._env.deadline = 0, time.monotonic() + MAX_SECONDS
        out, n = [], 0
        try:
            for piece in self._template.generate(**variables):
                n += len(piece)
                if max_chars is not None and n > max_chars:
                    raise Ds4Error(f"the rendered prompt exceeds {max_chars:,} characters, more than the context "
                                   f"can hold")
                out.append(piece)
        except Ds4Error:
            raise
        except Exception as e:  # noqa: BLE001 - a template is code from the model file: it can raise anything
            raise Ds4Error(f"chat template failed to render: {type(e).__name__}: {str(e)[:200]}") from None
        return "".join(out)


def chat_prompt_ids(tok, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, max_tokens: int | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's template, ready for the assistant's
    turn unless told otherwise (the template writes BOS itself). max_tokens: a rendering too long to
    be that many tokens is a Ds4Error before it is tokenized."""
    if not tok.chat_template:
        raise Ds4Error("the model has no chat template (tokenizer.chat_template); send raw text instead")
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
    eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
    limit = None if max_tokens is None else max_tokens * tok.longest_token
    text = ChatTemplate(tok.chat_template, bos, eos).render(messages, tools=tools, max_chars=limit,
                                                            add_generation_prompt=add_generation_prompt)
    return tok.encode(text, add_bos=False)
