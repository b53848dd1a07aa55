"""Tool calls in GLM's generated text: one block per call after the answer text, the syntax GLM's chat
template teaches the model (../shared/fixtures/templates/GLM-4.7-Flash.jinja):

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>

The template writes a string argument as it is and any other value as JSON, so a value that reads
as JSON is taken as JSON and anything else as a string. Several calls follow one another; the
model ends its turn with its end-of-turn token (`<|observation|>`), and text after the last call
that does not begin another one ends it too. Inside an open block the server decodes greedily
(ds4-spec §6).
"""

from __future__ import annotations

import json
import re


class GLMToolSyntax:
    begin = "<tool_call>"
    end = "</tool_call>"
    _call = re.compile(r"<tool_call>\s*([^<\s]+)\s*(.*?)</tool_call>", re.S)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def open_block(self, text: str) -> bool:
        i = text.rfind(self.begin)
        return i >= 0 and text.find(self.end, i) < 0

    def closed_block(self, text: str) -> bool:
        """A call is complete and what follows it is neither nothing yet nor (the start of) another call."""
        i = text.rfind(self.end)
        if i < 0 or text.find(self.begin) < 0 or self.open_block(text):
            return False
        rest = text[i + len(self.end):].lstrip()
        return bool(rest) and not (rest.startswith(self.begin) or self.begin.startswith(rest))

    def content(self, text: str) -> str:
        """The answer text: everything before the first call, without the whitespace before it."""
        i = text.find(self.begin)
        return text if i < 0 else text[:i].rstrip()

    def content_end(self, text: str) -> int:
        return len(self.content(text).rstrip())

    def parse(self, text: str) -> list[dict]:
        """[{"name": ..., "arguments": {...}}] of the complete calls."""
        calls = []
        for name, body in self._call.findall(text, max(text.find(self.begin), 0)):
            args = {}
            for key, value in self._arg.findall(body):
                try:
                    args[key.strip()] = json.loads(value)
                except json.JSONDecodeError:
                    args[key.strip()] = value
            calls.append({"name": name, "arguments": args})
        return calls
