"""runtime/residency.py on stand-in tensors: a recorded function's row always gets the same tensors,
no sequence's contents change when sets move between sequences, and a batch whose members stay
in their rows copies nothing. (The engine and the GPU check's recorded functions:
tests/targets/test_device_check.py, which fails when a recorded call is given other tensors.)"""

import gc

from ds4tvm.runtime.engine import Sequence
from ds4tvm.runtime.residency import Residency


class Tensor:
    copies = 0

    def __init__(self, value=None):
        self.value = value

    def copyfrom(self, other):
        Tensor.copies += 1
        self.value = other.value


def _sequence(name: str) -> Sequence:
    return Sequence({"model": [Tensor(f"{name}.k"), Tensor(f"{name}.v")], "draft": [Tensor(f"{name}.d")]})


def _contents(seq) -> dict:
    return {g: [t.value for t in ts] for g, ts in seq.states.items()}


def test_rows_keep_their_tensors_and_sequences_keep_their_contents():
    r = Residency(lambda t: Tensor())
    seqs = {n: _sequence(n) for n in "abcd"}
    want = {n: _contents(s) for n, s in seqs.items()}
    given = {}   # (group, slot) -> the tensors the first call got

    def call(group, rows):
        for slot, seq in rows:
            r.hold(seq, group, slot)
            tensors = given.setdefault((group, slot), seq.states[group])
            assert seq.states[group] is tensors, (group, slot)
        for n, s in seqs.items():
            assert _contents(s) == want[n], n

    a, b, c, d = seqs.values()
    for rows in ([(0, a), (1, b)], [("one", c)], [(0, a), (1, b), (2, c)], [("one", a)], [(0, c), (1, d)],
                 [(0, b), (1, a), (2, d)], [("one", b)], [("one", d)]):
        call("model", rows)
    call("draft", [("one", a)])
    call("draft", [("one", b)])
    assert _contents(a)["draft"] == ["a.d"] and _contents(b)["draft"] == ["b.d"]


def test_a_batch_that_stays_copies_nothing_and_arranged_keeps_rows():
    r = Residency(lambda t: Tensor())
    a, b, c = (_sequence(n) for n in "abc")
    for slot, seq in enumerate((a, b, c)):
        r.hold(seq, "model", slot)
    Tensor.copies = 0
    order = r.arranged([c, a, b], "model")   # c holds row 2, a row 0, b row 1
    assert order == [1, 2, 0]
    for slot, i in enumerate(order):
        r.hold([c, a, b][i], "model", slot)
    assert Tensor.copies == 0
    assert r.arranged([c, b], "model") == [0, 1]   # b keeps row 1; c takes row 0
    r.hold(c, "model", 0)   # a still holds row 0: contents swapped (3 copies per tensor)
    assert Tensor.copies == 6 and _contents(a) == {"model": ["a.k", "a.v"], "draft": ["a.d"]}
    del a
    gc.collect()
    Tensor.copies = 0
    d = _sequence("d")
    r.hold(d, "model", 2)   # c's old row 2 went to a, now gone: one copy per tensor in
    assert Tensor.copies == 2 and _contents(d)["model"] == ["d.k", "d.v"]
