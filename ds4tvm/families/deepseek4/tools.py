"""Tool calls in generated text. DeepSeek-V4 writes them as a DSML block after the answer text
(the syntax its chat template teaches the model):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

string="false" values are JSON. Inside an open block the server decodes greedily (ds4-spec §6).
"""

from __future__ import annotations

import json
import re

DSML = "｜DSML｜"


class DSMLToolSyntax:
    """The interface every family's tool syntax offers (runtime/textstream.py and the server use it)."""

    XGRAMMAR = "deepseek_v4"   # xgrammar's structural tag of this syntax (forced tool calls)
    begin = f"<{DSML}tool_calls>"
    end = f"</{DSML}tool_calls>"
    _invoke = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
    _param = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)

    def open_block(self, text: str) -> bool:
        i = text.rfind(self.begin)
        return i >= 0 and text.find(self.end, i) < 0

    def closed_block(self, text: str) -> bool:
        i = text.find(self.begin)
        return i >= 0 and text.find(self.end, i) >= 0

    def content(self, text: str) -> str:
        """The answer text: everything before the first tool-call block, without the blank lines
        that separate them."""
        i = text.find(self.begin)
        return text if i < 0 else text[:i].rstrip()

    def content_end(self, text: str) -> int:
        """How much of `text` (a prefix of the output) is surely content: trailing whitespace may
        still turn out to precede a block."""
        return len(self.content(text).rstrip())

    def parse(self, text: str) -> list[dict]:
        """[{"name": ..., "arguments": {...}}] of the complete invocations in the first block."""
        i = text.find(self.begin)
        if i < 0:
            return []
        calls = []
        for name, body in self._invoke.findall(text, i + len(self.begin)):
            args = {}
            for key, is_string, value in self._param.findall(body):
                if is_string == "true":
                    args[key] = value
                    continue
                try:
                    args[key] = json.loads(value)
                except json.JSONDecodeError:
                    args[key] = value
            calls.append({"name": name, "arguments": args})
        return calls
