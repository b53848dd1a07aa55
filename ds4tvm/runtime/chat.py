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


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
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
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise Ds4Error(f"chat template does not parse: {e}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        import jinja2

        variables = dict(messages=_normalise(messages), add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        if tools:
            variables["tools"] = tools
        try:
            return self._template.render(**variables)
        except Ds4Error:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise Ds4Error(f"chat template failed to render: {type(e).__name__}: {e}") from None


def chat_prompt_ids(tok, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's template, ready for the assistant's
    turn unless told otherwise (the template writes BOS itself)."""
    if not tok.chat_template:
        raise Ds4Error("the model has no chat template (tokenizer.chat_template); send raw text instead")
    bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
    eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
    text = ChatTemplate(tok.chat_template, bos, eos).render(messages, tools=tools,
                                                            add_generation_prompt=add_generation_prompt)
    return tok.encode(text, add_bos=False)
