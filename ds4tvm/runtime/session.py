"""`ds4 run --session FILE`: a conversation kept across runs, its messages (or tokens) and the state
after them in one checkpoint file (runtime/checkpoint.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import Ds4Error


class Session:
    """`ds4 run --session FILE`: the conversation so far (the messages, or the tokens for --raw and
    --tokens prompts) and the state after it, in one checkpoint file (runtime/checkpoint.py)."""

    def __init__(self, path: Path, engine, drafter, overwrite: bool = False):
        from .checkpoint import CheckpointError, load_state
        from .drafters import drafter_tag

        self.path, self.engine, self.tag = path, engine, drafter_tag(drafter)
        meta = {}
        if path.exists():
            try:
                meta = load_state(engine, path, self.tag)
                check_session_meta(path, meta, engine.n_vocab)
            except CheckpointError as e:
                if not overwrite:   # a user's file (a GGUF given by mistake) is never overwritten
                    raise Ds4Error(f"--session: {e.message}; the file is left as it is (--session-overwrite "
                                   f"replaces it with a new conversation)") from None
                print(f"ds4: --session: {e.message}; starting a new conversation in its place", file=sys.stderr)
                engine.reset()
                meta = {}
        self.tokens = [int(t) for t in meta.get("tokens", [])]          # the conversation so far
        self.messages = list(meta.get("messages", []))

    def resume(self, ids: list[int]) -> int:
        from .prefix import common_prefix, resume

        held = len(self.engine.history)
        extends = common_prefix(self.engine.history, ids) == held
        cached = resume(self.engine, ids)
        if held and not extends:
            kept = f"continuing from {cached} of them" if cached else "starting fresh"
            print(f"ds4: --session {self.path}: the prompt does not extend the session's {held} tokens; {kept}",
                  file=sys.stderr)
        return cached

    def save(self, tok, ids: list[int], out: list[int], text: str, at_prompt) -> None:
        """Saves the state after the answer, or, for a chat whose template renders the answer into
        other tokens than were generated, the state after the prompt (the next turn's prefix)."""
        from .chat import chat_prompt_ids
        from .checkpoint import save_state

        meta = {"tokens": ids + out}
        if self.messages:
            meta["messages"] = self.messages + [{"role": "assistant", "content": text}]
            again = chat_prompt_ids(tok, meta["messages"], add_generation_prompt=False)
            if again[:self.engine.pos] != self.engine.history and at_prompt:
                self.engine.restore(at_prompt[0])
        try:
            save_state(self.engine, self.path, self.tag, meta)
        except OSError as e:
            raise Ds4Error(f"--session {self.path}: cannot write it ({e.strerror or e})") from None


def check_session_meta(path: Path, meta: dict, n_vocab: int) -> None:
    """What `Session.save` wrote: the tokens (ids of the vocabulary) and the chat messages."""
    from .checkpoint import CheckpointError

    tokens, messages = meta.get("tokens", []), meta.get("messages", [])
    if not (isinstance(tokens, list) and all(isinstance(t, int) and 0 <= t < n_vocab for t in tokens)
            and isinstance(messages, list)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
        raise CheckpointError(f"{path}: not a ds4 run --session conversation (its tokens or messages are malformed)")
