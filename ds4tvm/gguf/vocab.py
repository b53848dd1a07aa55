"""Tokenizer metadata for GGUFs we write: imported from a HF `tokenizer.json`, or a small
byte-level BPE vocabulary learned from built-in text for tiny test and demo models."""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

from gguf import GGUFValueType

from ..errors import Ds4Error

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# A DeepSeek-style template, small enough for tiny models: tool schemas, then User/Assistant turns;
# assistant tool calls and tool results in DeepSeek-V4's DSML layout (families/deepseek4/tools.py parses it).
_DSML = "｜DSML｜"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '## Tools\\n' }}{% for t in tools %}{{ t['function'] | tojson }}{{ '\\n' }}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% if m['tool_calls'] %}{{ '\\n\\n<" + _DSML + "tool_calls>\\n' }}{% for c in m['tool_calls'] %}"
    "{{ '<" + _DSML + "invoke name=\"' + c['function']['name'] + '\">\\n' }}"
    "{% for k, v in c['function']['arguments'].items() %}{% if v is string %}"
    "{{ '<" + _DSML + "parameter name=\"' + k + '\" string=\"true\">' + v + '</" + _DSML + "parameter>\\n' }}"
    "{% else %}{{ '<" + _DSML + "parameter name=\"' + k + '\" string=\"false\">' + (v | tojson) + '</" + _DSML
    + "parameter>\\n' }}{% endif %}{% endfor %}{{ '</" + _DSML + "invoke>\\n' }}{% endfor %}"
    "{{ '</" + _DSML + "tool_calls>' }}{% endif %}{{ '<｜end▁of▁sentence｜>' }}"
    "{% elif m['role'] == 'tool' %}{{ '<｜User｜><tool_result>' + m['content'] + '</tool_result>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

CORPUS = """The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens
and the target model verifies them in one batched pass; accepted prefixes advance the state.
DeepSeek-V4-Flash keeps hyper-connection streams, a sliding window of 128 positions, compressed
rows and a lightning indexer. Hello, world! def main():\n    return 0\nimport numpy as np
Once upon a time there was a small model that wanted to run fast on every device it could find.
"""


@lru_cache(maxsize=None)
def byte_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map, which byte-level BPE vocabularies use.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def synthetic_vocab(n_vocab: int) -> dict:
    """tokenizer.ggml.* metadata of exactly `n_vocab` tokens: 4 control tokens, the 256 bytes and
    merges learned greedily (most frequent pair, ties to the smaller pair) from CORPUS."""
    specials = [BOS, EOS, USER, ASSISTANT]
    if n_vocab < len(specials) + 256:
        raise Ds4Error(f"vocabulary size {n_vocab} is too small for a byte-level vocabulary (>= 260)")
    b2u = byte_to_unicode()
    tokens = specials + [b2u[b] for b in range(256)]
    types = [CONTROL] * len(specials) + [NORMAL] * 256
    words = Counter()
    for piece in CORPUS.replace("\n", " \n").split(" "):
        if piece:
            words[tuple(b2u[b] for b in (" " + piece).encode())] += 1
    merges = []
    known = set(tokens)
    while len(tokens) < n_vocab:
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        pairs = {p: c for p, c in pairs.items() if p[0] + p[1] not in known}
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(merged)
        types.append(NORMAL)
        known.add(merged)
        new_words = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    while len(tokens) < n_vocab:
        tokens.append(f"<unused_{len(tokens)}>")
        types.append(UNUSED)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "deepseek-v3",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": (types, GGUFValueType.INT32),  # llama.cpp reads it as int32
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def hf_vocab(hf_dir: Path, n_vocab: int, pre: str) -> dict | None:
    """tokenizer.ggml.* metadata from a HF checkpoint's tokenizer.json (byte-level BPE), or None
    when the directory has no tokenizer."""
    path = hf_dir / "tokenizer.json"
    if not path.exists():
        return None
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise Ds4Error(f"{path}: not readable JSON ({e})") from None
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise Ds4Error(f"{path}: model.type is {model.get('type')!r}; only byte-level BPE is supported")
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for content, t in added.items():
        vocab.setdefault(content, t["id"])
    size = max(n_vocab, max(vocab.values()) + 1)
    if size != n_vocab:
        raise Ds4Error(f"{path}: token ids reach {size - 1}, beyond the model's vocab_size {n_vocab}")
    tokens = [f"<unused_{i}>" for i in range(n_vocab)]
    types = [UNUSED] * n_vocab
    for tok, i in vocab.items():
        tokens[i] = tok
        t = added.get(tok)
        types[i] = NORMAL if t is None else (CONTROL if t.get("special") else USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": (types, GGUFValueType.INT32), "tokenizer.ggml.merges": merges}
    cfg_path = hf_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    for name in ("bos", "eos"):
        tok = cfg.get(f"{name}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        if tok in vocab:
            meta[f"tokenizer.ggml.{name}_token_id"] = vocab[tok]
    meta["tokenizer.ggml.add_bos_token"] = bool(cfg.get("add_bos_token", True))
    template = cfg.get("chat_template")
    jinja = hf_dir / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    return meta
