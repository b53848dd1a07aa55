"""Prefix reuse: continue a sequence from the longest prefix of a new prompt that it (or a stored
checkpoint) already holds, instead of prefilling the prompt from zero.

Two positions are always evaluated again: the prompt's last token (its logits start the answer) and
the last kept one, so that the prefill that follows starts one position inside what is kept. A
drafter writes its rows for a position from the target's outputs of the position before
(speculative.Drafter.begin); re-evaluating the last kept position gives it those outputs, and the
target rewrites that position's rows with what it already held.
"""

from __future__ import annotations


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable(engine, prompt, seq=None) -> int:
    """How many prompt tokens a sequence of the engine (default: the attached one) can continue
    from by itself: its common prefix with prompt, less the re-evaluated one, if it ends within what
    it can rewind; else 0. A query: nothing is attached or changed."""
    seq = engine.seq if seq is None else seq
    c = common_prefix(seq.history[:seq.pos], prompt)
    return c - 1 if c >= 2 and seq.pos - (c - 1) <= engine.rewindable_of(seq) else 0


def resume(engine, prompt, store=None) -> int:
    """Puts the engine's attached sequence on the longest prefix of prompt it can continue from —
    its own state (`reusable`), or the best checkpoint in store when that holds more, or nothing —
    and returns how many prompt tokens need no prefill."""
    own = reusable(engine, prompt)
    while store is not None and (found := store.best(prompt, len(prompt))) is not None and len(found[0]) - 1 > own:
        cp = store.load(found[1])   # None: unusable, reported and dropped from the store; try the next
        if cp is not None:
            engine.restore(cp)
            engine.rewind(1)
            return engine.pos
    if own:
        engine.rewind(engine.pos - own)
        return own
    engine.reset()
    return 0
