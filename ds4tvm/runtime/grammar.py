"""Structured outputs: a grammar (JSON, JSON that follows a schema, or the model's tool-call syntax
with a call forced) compiled by xgrammar against the model's vocabulary, and a `Constraint` that
the speculative loop applies to every distribution it samples from or checks a draft against
(runtime/speculative.py): disallowed tokens get -inf, so no filter, sample, greedy choice or
acceptance test can pick one, and a draft the grammar refuses is never accepted. The matcher
follows the committed tokens; drafts are matched tentatively while they are checked and rolled
back before the accepted ones are committed.

Beyond the grammar, control tokens other than the stop tokens are always refused: the byte-level
vocabulary would let their text (`<|User|>`) stand inside a string. In JSON so are tokens holding a
raw control character (bytes below 0x20): compact JSON never contains one, and xgrammar 0.2.9's
rule for strings with a maxLength lets them through. And everywhere any byte that would make the
text invalid UTF-8 where xgrammar's decoder is lenient (surrogates ED A0..BF, overlong E0 80..9F /
F0 80..8F, beyond U+10FFFF): inside a token statically, across a token boundary from the last byte
accepted. Both leaks were found by tests/runtime/test_grammar.py and
tests/server/test_server_surface.py (invalid JSON, a maxLength exceeded once decoded).

xgrammar is optional (`pip install 'ds4tvm[grammar]'`); without it a request for structured output
is refused, never ignored.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

from ..errors import Ds4Error
from .tokenizer import CONTROL, UNKNOWN, UNUSED


class GrammarError(Ds4Error):
    """A grammar that cannot be compiled (an unsupported or malformed schema), or no xgrammar."""


def _xgrammar():
    if "torch" in sys.modules and sys.modules["torch"] is None:
        # loader.runtime_only_tvm marks PyTorch absent to keep a serving process light; xgrammar's
        # bitmasks are torch tensors, so the first structured request pays for importing it
        del sys.modules["torch"]
    try:
        import xgrammar
    except ModuleNotFoundError as e:
        if e.name != "xgrammar":
            raise GrammarError(f"structured outputs: xgrammar cannot be imported ({e})") from None
        raise GrammarError("structured outputs need the xgrammar package: pip install 'ds4tvm[grammar]'") from None
    except ImportError as e:
        raise GrammarError(f"structured outputs: xgrammar cannot be imported ({_first_line(e)})") from None
    return xgrammar


def _first_line(e: Exception) -> str:
    """xgrammar's message without its C++ location prefix, on one line."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


# a lead byte whose next byte strict UTF-8 narrows (Unicode Table 3-7): (lowest, highest)
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _never_utf8(b: bytes) -> bool:
    """Whether these bytes cannot stand in valid UTF-8 wherever they occur."""
    return (any(c in (0xC0, 0xC1) or c >= 0xF5 for c in b)
            or any(c in _SECOND and not _SECOND[c][0] <= d <= _SECOND[c][1] for c, d in zip(b, b[1:])))


class Vocabulary:
    """What a Constraint checks of each token beyond the grammar: refused outright (`refused`, in
    JSON; `refused_text`, in a tool call's text, where newlines are the syntax's), its first and
    last byte (-1: none) for the UTF-8 rule across token boundaries."""

    def __init__(self, tokenizer, decoded: list[bytes]):
        kept = np.ones(len(decoded), bool)
        kept[list(tokenizer.stop_ids)] = False
        text = kept & np.array([t in (CONTROL, UNKNOWN, UNUSED) or _never_utf8(b)
                                for t, b in zip(tokenizer.token_types, decoded)])
        raw = np.array([any(c < 0x20 for c in b) for b in decoded])
        self.refused_text, self.refused = np.flatnonzero(text), np.flatnonzero(text | (kept & raw))
        self.first = np.array([b[0] if b else -1 for b in decoded])
        self.last = [b[-1] if b else -1 for b in decoded]


class Grammars:
    """The grammar compiler of one tokenizer (built on first use, shared by every request)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._compiler, self.vocabulary = None, None
        self._lock = threading.Lock()

    def _compile(self, how, *args, in_json: bool = True, **kwargs):
        """A Constraint from compiler.how(*args). JSON is compact (no whitespace beyond one space
        after ',' and ':'): free whitespace lets a small model pad until it runs out of tokens."""
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo(self.tok.tokens, xgr.VocabType.BYTE_LEVEL, vocab_size=self.tok.n_vocab,
                                         stop_token_ids=sorted(self.tok.stop_ids))
                self.vocabulary = Vocabulary(self.tok, info.decoded_vocab)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            compiler = self._compiler
        v = self.vocabulary
        return Constraint(getattr(compiler, how)(*args, **kwargs), self.tok.n_vocab, v,
                          v.refused if in_json else v.refused_text)

    def json_object(self) -> "Constraint":
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema, where: str = "json schema") -> "Constraint":
        """JSON that follows `schema` (a dict or its text); a schema xgrammar cannot compile is a
        GrammarError naming `where`."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            return self._compile("compile_json_schema", text, any_whitespace=False)
        except GrammarError:
            raise
        except Exception as e:   # xgrammar raises its C++ errors as RuntimeError subclasses
            raise GrammarError(f"{where}: {_first_line(e)}") from None

    def tool_calls(self, syntax: str, tools: list[dict], choice) -> "Constraint":
        """The model's tool-call syntax (`syntax`: xgrammar's name of the format, the family's
        tool_syntax.XGRAMMAR) with a call forced: tool_choice "required" (any of `tools`, OpenAI's
        form) or {"type": "function", "function": {"name": ...}}; each call's arguments follow its
        tool's parameters schema. No reasoning block."""
        xgr = _xgrammar()
        try:
            tag = xgr.get_model_structural_tag(syntax, tools=tools, tool_choice=choice, reasoning=False,
                                               max_whitespace_cnt=1)   # as for JSON: no padding
            return self._compile("compile_structural_tag", tag, in_json=False)
        except GrammarError:
            raise
        except Exception as e:
            raise GrammarError(f"tools: {_first_line(e)}") from None


class Constraint:
    """One generation's grammar matcher: `mask` a distribution, `accept` the tokens committed,
    `rollback` tentative ones."""

    def __init__(self, compiled, n_vocab: int, vocabulary: Vocabulary, refused: np.ndarray):
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.n_vocab, self.vocab, self.refused = n_vocab, vocabulary, refused
        self._bitmask = xgr.allocate_token_bitmask(1, n_vocab)
        self._last: list[int] = []   # the last byte of every token accepted

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of logits with the tokens refused here at -inf."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        allowed = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)
        allowed[self.refused] = False
        lead = self._last[-1] if self._last else -1
        if lead in _SECOND:   # a sequence begun by the last token: strict UTF-8 bounds its next byte
            low, high = _SECOND[lead]
            allowed &= (self.vocab.first >= low) & (self.vocab.first <= high)
        return np.where(allowed, logits.reshape(-1), -np.inf).astype(logits.dtype).reshape(logits.shape)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise Ds4Error(f"the grammar refused token {token}, which its mask allowed")
        self._last.append(self.vocab.last[token])

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            del self._last[-n:]

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()
