"""Byte-level BPE from GGUF metadata, run by the HF `tokenizers` library.

Reproduces llama.cpp's tokenization of the same metadata: the pre-tokenizer regexes chosen by
`tokenizer.ggml.pre` and applied in sequence, merges ranked in file order, control and unknown
tokens matched as whole specials only when special parsing is on, user-defined tokens always
matched whole, and BOS/EOS from `tokenizer.ggml.*`.
"""

from __future__ import annotations

import threading
from functools import cached_property

from gguf import GGUFValueType

from ..errors import Ds4Error
from ..gguf.reader import GGUFFile

from ..gguf.pretokenizers import PRE_TOKENIZERS, PreTokenizer

# token_type values of tokenizer.ggml.token_type (llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _strings(f: GGUFFile, key: str, required: bool = True) -> list[str] | None:
    field = f._reader.get_field(key)
    if field is None:
        if required:
            raise Ds4Error(f"{f.name}: missing tokenizer key {key}")
        return None
    if field.types[:1] != [GGUFValueType.ARRAY] or field.types[-1] not in (GGUFValueType.STRING,
                                                                          GGUFValueType.ARRAY):
        f.get(key, "strs")  # not an array of strings: raises the typed one-line error
    parts = field.parts
    try:
        return [bytes(parts[i]).decode("utf-8") for i in field.data]
    except UnicodeDecodeError:
        raise Ds4Error(f"{f.name}: {key} holds a string that is not valid UTF-8") from None


class Tokenizer:
    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int], pre: str,
                 bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool = False,
                 eot_ids: tuple[int, ...] = (), source: str = "tokenizer"):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre not in PRE_TOKENIZERS:
            raise Ds4Error(f"{source}: tokenizer.ggml.pre '{pre}' is not supported; expected one of "
                           f"{', '.join(sorted(PRE_TOKENIZERS))}")
        if len(token_types) != len(tokens):
            raise Ds4Error(f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                           f"{len(tokens)} tokens")
        self.tokens = tokens
        self.token_types = token_types
        self.n_vocab = len(tokens)
        for name, tid in (("bos", bos_id), ("eos", eos_id)):
            if tid is not None and not 0 <= tid < self.n_vocab:
                raise Ds4Error(f"{source}: tokenizer.ggml.{name}_token_id {tid} is outside the "
                               f"vocabulary of {self.n_vocab}")
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.stop_ids = frozenset(t for t in (eos_id, *eot_ids) if t is not None)
        spec = PRE_TOKENIZERS[pre]

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for m in merges:
            # llama.cpp splits at the first space after position 0: a merge may start with a space token
            cut = m.find(" ", 1)
            if cut < 0:
                raise Ds4Error(f"{source}: merge {m!r} in tokenizer.ggml.merges has no separator")
            pairs.append((m[:cut], m[cut + 1:]))
        # The Rust BPE panics (not an Exception) on a merge whose result is not in the vocab;
        # llama.cpp ignores such merges, and so do we.
        pairs = [p for p in pairs if p[0] + p[1] in vocab and p[0] in vocab and p[1] in vocab]
        model = models.BPE(vocab=vocab, merges=pairs, byte_fallback=False,
                           ignore_merges=spec.ignore_merges)
        tok = HFTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(token_types) if t in (UNKNOWN, CONTROL)])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(token_types) if t == USER_DEFINED])
        self._hf = tok
        self._lock = threading.Lock()
        self.chat_template: str | None = None

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Tokenizer":
        model = f.get("tokenizer.ggml.model", "str")
        meta = {"tokenizer.ggml.model": model,
                "tokenizer.ggml.tokens": _strings(f, "tokenizer.ggml.tokens"),
                "tokenizer.ggml.merges": _strings(f, "tokenizer.ggml.merges")}
        for key, kind in (("tokenizer.ggml.token_type", "ints"), ("tokenizer.ggml.pre", "str"),
                          ("tokenizer.ggml.bos_token_id", "int"), ("tokenizer.ggml.eos_token_id", "int"),
                          ("tokenizer.ggml.eot_token_id", "int"), ("tokenizer.ggml.eom_token_id", "int"),
                          ("tokenizer.ggml.add_bos_token", "bool"), ("tokenizer.ggml.add_eos_token", "bool"),
                          ("tokenizer.chat_template", "str")):
            value = f.get(key, kind, default=None)
            if value is not None:
                meta[key] = value
        return cls.from_metadata(meta, source=f.name)

    @classmethod
    def from_metadata(cls, meta: dict, source: str = "tokenizer") -> "Tokenizer":
        """From `tokenizer.*` GGUF keys held in a dict (as artifacts store them)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise Ds4Error(f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE "
                           f"('gpt2') is supported")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise Ds4Error(f"{source}: missing tokenizer key tokenizer.ggml.tokens")
        g = meta.get
        eot = tuple(x for x in (g("tokenizer.ggml.eot_token_id"), g("tokenizer.ggml.eom_token_id")) if x is not None)
        tok = cls(list(tokens), list(g("tokenizer.ggml.merges") or []),
                  list(g("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)), g("tokenizer.ggml.pre", "default"),
                  g("tokenizer.ggml.bos_token_id"), g("tokenizer.ggml.eos_token_id"),
                  bool(g("tokenizer.ggml.add_bos_token",
                        PRE_TOKENIZERS.get(g("tokenizer.ggml.pre", "default"), PreTokenizer(())).add_bos)),
                  bool(g("tokenizer.ggml.add_eos_token", False)),
                  eot, source=source)
        tok.chat_template = g("tokenizer.chat_template")
        return tok

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. With `parse_special`, the text of control tokens (as written by a
        chat template) becomes those tokens; without it, such text is tokenized as plain bytes."""
        with self._lock:   # encode_special_tokens is the tokenizer's state, shared by the server's threads
            self._hf.encode_special_tokens = not parse_special
            # encode_batch releases the GIL while it works (encode holds it: a 14 MiB prompt stalled
            # every other thread of the server for 22 s)
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if self.add_eos and self.eos_id is not None and add_bos is None:
            ids = [*ids, self.eos_id]
        return ids

    @cached_property
    def longest_token(self) -> int:
        """Characters of the longest token (bytes, for byte-level vocabularies): a text of more than
        n times this many characters cannot be n tokens or fewer."""
        return max(1, max((len(t) for t in self.tokens), default=1))

    @cached_property
    def _unicode_to_byte(self) -> dict[str, int]:
        from ..gguf.vocab import byte_to_unicode

        return {c: b for b, c in byte_to_unicode().items()}

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (a control or user-defined token: its text in UTF-8)."""
        text = self.tokens[i]
        if self.token_types[i] in (CONTROL, USER_DEFINED, UNKNOWN) or any(c not in self._unicode_to_byte for c in text):
            return text.encode()
        return bytes(self._unicode_to_byte[c] for c in text)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        for i in ids:
            if not 0 <= i < self.n_vocab:
                raise Ds4Error(f"token id {i} is outside the vocabulary of {self.n_vocab}")
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)
