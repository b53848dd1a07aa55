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

import re

from ..tagged_tools import TaggedToolSyntax


class GLMToolSyntax(TaggedToolSyntax):
    XGRAMMAR = "glm_4_7"   # xgrammar's structural tag of this syntax (forced tool calls)
    _call = re.compile(r"<tool_call>\s*([^<\s]+)\s*(.*?)</tool_call>", re.S)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
