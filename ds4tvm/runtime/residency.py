"""Where the state tensors of recorded functions live (FunctionSpec.recorded: a CUDA graph replays
the addresses its first call was given, so every call must pass the same tensors).

A recorded function takes, per state group, one set of tensors for each sequence it works on: a
function of one sequence the set "one", row j of a batched function the set j (the same set for
every batch size: row 1 of decode_batch3 and of decode_batch2). Before such a call the sequence
must hold that set: `hold` gives it the set, and the set's previous holder takes the sequence's
tensors in exchange, contents swapped, so no sequence's state changes. A sequence keeps what it
holds until another sequence needs it, so a batch whose members stay in their rows copies
nothing; a sequence joining or leaving costs a copy of one sequence's state or two.
"""

from __future__ import annotations

import weakref


class Residency:
    def __init__(self, empty_like):
        """empty_like(tensor): a new uninitialised tensor of its shape, dtype and device."""
        self._empty_like = empty_like
        self._sets: dict[tuple, list] = {}       # (group, slot) -> the tensors recorded there
        self._holders: dict[tuple, weakref.ref] = {}

    def slot_of(self, seq, group: str):
        """The slot whose set seq's tensors of group are, else None."""
        return next((slot for (g, slot), tensors in self._sets.items()
                     if g == group and seq.states[group] is tensors), None)

    def arranged(self, seqs: list, group: str) -> list[int]:
        """An order of seqs (indices) for a batched call that keeps each sequence already holding
        one of its rows' sets in that row."""
        rows: list = [None] * len(seqs)
        rest = []
        for i, seq in enumerate(seqs):
            slot = self.slot_of(seq, group)
            if isinstance(slot, int) and slot < len(rows) and rows[slot] is None:
                rows[slot] = i
            else:
                rest.append(i)
        return [r if r is not None else rest.pop(0) for r in rows]

    def hold(self, seq, group: str, slot) -> None:
        """seq's tensors of group become the set of slot ("one" or a row index)."""
        key, mine = (group, slot), seq.states[group]
        tensors = self._sets.get(key)
        if mine is tensors:   # the common case, before any search: it holds the set already
            return
        own = self.slot_of(seq, group)
        if tensors is None:
            if own is None:   # its tensors become the set: nothing to copy
                self._sets[key], self._holders[key] = mine, weakref.ref(seq)
                return
            tensors = self._sets[key] = [self._empty_like(t) for t in mine]
        ref = self._holders.get(key)
        holder = ref() if ref is not None else None
        if holder is not None and holder.states[group] is tensors:
            for a, b in zip(mine, tensors):
                kept = self._empty_like(a)
                kept.copyfrom(a)
                a.copyfrom(b)
                b.copyfrom(kept)
            holder.states[group] = mine
            if own is not None:
                self._holders[(group, own)] = weakref.ref(holder)
        else:   # nobody holds the set any more: its contents are dead
            for a, b in zip(mine, tensors):
                b.copyfrom(a)
            if own is not None:
                self._holders.pop((group, own), None)
        seq.states[group] = tensors
        self._holders[key] = weakref.ref(seq)
