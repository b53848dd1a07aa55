"""Tool calls written as tagged blocks after the answer text (`<tool_call>...</tool_call>`, one per
call, several in a row), the form GLM's and Qwen's chat templates teach. A subclass gives the
pattern of a call (`_call`: groups name and body) and of an argument in its body (`_arg`: groups
key and value); a value that reads as JSON is taken as JSON (the templates write non-strings as
JSON), anything else as the string without the whitespace around it."""

from __future__ import annotations

import json
import re


class TaggedToolSyntax:
    begin = "<tool_call>"
    end = "</tool_call>"
    _call: re.Pattern
    _arg: re.Pattern

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
                except json.JSONDecodeError:   # a string; whitespace around it is layout, as for JSON
                    args[key.strip()] = value.strip()
            calls.append({"name": name, "arguments": args})
        return calls
