"""Generated tokens -> text, incrementally, for `ds4 run` and the server: one place decides what
text a client sees, so streamed and non-streamed answers are the same string.

Tokens are decoded in a sliding window (a piece is released once it no longer ends in a partial
UTF-8 character); stop tokens add no text; a stop string ends the text before it; and when tool
calls are enabled the text from the tool-call block on is not content: it is held back while it
could still be the start of the block, and parsed once generation ends.
"""

from __future__ import annotations



class TextStream:
    def __init__(self, tokenizer, stop_ids=frozenset(), stop_strings=(), tools=None):
        self.tok, self.stop_ids = tokenizer, frozenset(stop_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.tools = tools
        self.ids: list[int] = []       # generated ids that carry text (no stop tokens)
        self._prefix = self._read = 0  # the decode window: ids[_prefix:_read] is already text
        self.text = ""                 # all text so far (cut at a stop string)
        self.sent = 0                  # characters of content handed out by push()
        self.stop_string: str | None = None
        self.stop_token = False

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None or self.stop_token

    @property
    def in_tool_call(self) -> bool:
        return self.tools is not None and self.tools.open_block(self.text)

    def push(self, token: int) -> str:
        """Adds one generated token; returns the content that became final with it."""
        if self.stopped:
            return ""
        if token in self.stop_ids:
            self.stop_token = True
            return ""
        self.ids.append(token)
        self._advance(flush=False)
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """Generation ended: the content not yet handed out (bytes of an unfinished character
        included, as the tokenizer decodes them)."""
        if not self.stop_string:
            self._advance(flush=True)
        return self._release(final=True)

    def _advance(self, flush: bool) -> None:
        before = self.tok.decode(self.ids[self._prefix:self._read])
        now = self.tok.decode(self.ids[self._prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not flush):
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0))
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        hits = [(i, s) for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
        if hits:
            i, self.stop_string = min(hits)
            self.text = self.text[:i]

    def content(self) -> str:
        return self.text if self.tools is None else self.tools.content(self.text)

    def tool_calls(self) -> list[dict]:
        return [] if self.tools is None else self.tools.parse(self.text)

    def _release(self, final: bool) -> str:
        if final:
            end = len(self.content())
        else:
            end = len(self.text) - self._held_suffix()
            if self.tools is not None:
                end = min(end, self.tools.content_end(self.text[:end]))
        piece = self.content()[self.sent:end] if end > self.sent else ""
        self.sent += len(piece)
        return piece

    def _held_suffix(self) -> int:
        """Length of the longest tail of the text that may still become a stop string or a
        tool-call marker."""
        marks = list(self.stop_strings) + ([self.tools.begin] if self.tools is not None else [])
        held = 0
        for m in marks:
            for n in range(min(len(m) - 1, len(self.text)), held, -1):
                if self.text.endswith(m[:n]):
                    held = n
                    break
        return held
