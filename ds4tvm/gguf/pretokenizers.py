"""The pre-tokenizers that `tokenizer.ggml.pre` names, as llama.cpp's llama-vocab.cpp applies them
(regexes in sequence), keyed by the names GGUF converters write."""

from __future__ import annotations

from dataclasses import dataclass

# Pre-tokenizer regex lists per `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp applies them.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DEEPSEEK_LLM = [
    "[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
]
DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # llama3: a whole pre-token found in the vocab is kept as is
    add_bos: bool = False        # llama.cpp's default when the GGUF has no add_bos_token key


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "llama-bpe": PreTokenizer((LLAMA3,), True, True),
    "llama3": PreTokenizer((LLAMA3,), True, True),
    "llama-v3": PreTokenizer((LLAMA3,), True, True),
    "qwen2": PreTokenizer((QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((QWEN2,)),
    "qwen35": PreTokenizer((QWEN35,)),
    "gpt-2": PreTokenizer((GPT2,)),
    "default": PreTokenizer((GPT2,)),
    "deepseek-llm": PreTokenizer(tuple(DEEPSEEK_LLM)),
    "deepseek-v3": PreTokenizer(tuple(DEEPSEEK3)),
    "joyai-llm": PreTokenizer(tuple(DEEPSEEK3)),  # what published DeepSeek-V4 GGUFs carry
    "glm4": PreTokenizer((LLAMA3,)),
    "chatglm-bpe": PreTokenizer((LLAMA3,)),
}
