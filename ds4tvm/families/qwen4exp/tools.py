"""Tool calls in Qwen's generated text, the syntax its chat template teaches
(../shared/fixtures/templates/Qwen3.5-4B.jinja), one block per call after the answer text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The template writes mappings and lists as JSON and any other value as its string, each on lines of
its own; a value that reads as JSON is taken as JSON, anything else as the string. Inside an open
block the server decodes greedily (ds4-spec §6)."""

from __future__ import annotations

import re

from ..tagged_tools import TaggedToolSyntax


class QwenToolSyntax(TaggedToolSyntax):
    XGRAMMAR = "qwen_3_5"   # xgrammar's structural tag of this syntax (forced tool calls)
    _call = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
    _arg = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.S)
