"""The server's slot choice (server/service.py) on a test double: a request takes the slot that can
continue the longest prefix of its prompt, a new conversation the least recently used slot, so the
conversations in the other slots keep their state."""

from fakes import TableEngine

from ds4tvm.server.service import Service


def _serve(service, prompt):
    """What a job does to the state: resume, then prefill the rest and decode one token."""
    with service._sequence(prompt) as (engine, held):
        engine.prefill(prompt[held:])
        engine.decode(1)
    return held


def test_conversations_keep_their_slots():
    engine = TableEngine(vocab=6, max_context=64, max_verify=4)
    service = Service(engine, tokenizer=None, slots=2)
    try:
        a, b = [0, 1, 2, 3, 4, 5, 1, 2], [5, 5, 4, 4, 3, 3]
        assert _serve(service, a) == 0
        assert _serve(service, b) == 0                        # the unused slot, not a's
        assert _serve(service, a + [1, 3, 3]) == len(a)       # a continues from its own slot
        assert _serve(service, b + [1, 0]) == len(b)
        c = [2, 2, 2, 2]
        assert _serve(service, c) == 0                        # the least recently used slot: a's
        assert [s.seq.history[:4] for s in service.slots] == [c, b[:4]]
    finally:
        service.close()
