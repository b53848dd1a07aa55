"""GLM-5.3's MTP drafter (ds4-spec §4): the nextn layer inside the model GGUF (families/glm5next/mtp.py)
drafts one greedy token after the token t the target chose, from t's embedding and the target's
hidden state before t; the loop verifies [t, d] as one 2-row pass and commits 1 or 2 tokens; the
next draft reads the hidden state of the last committed row. Acceptance is the loop's (greedy,
opportunistic, or exact with --mtp-exact-sampling), rejection a pick of the verifier's snapshot
slots (no replay).

The layer's rows: drafting after t at position p writes t's row, from (t, h(p - 1)), which is the
row t keeps once committed; `observe` writes the rows of the other committed tokens (an accepted
draft, a token decoded without drafting) from the hidden states the target just returned. So the
layer's state holds a row for every committed position, as if the committed text had been fed to it.

--mtp enables it silently; --mtp-timing prints one line per cycle:
  ds4: glm mtp cycle: verify2 X ms, head+draft Y ms, ACCEPT|reject|EXACT_ACCEPT|exact_reject
  (draft ID 'txt' vs true ID 'txt')
the true token of a rejected draft being the one the target commits there (known one cycle later)."""

from __future__ import annotations

import sys
import time

import numpy as np

from ...errors import Ds4Error
from ..speculative import DraftCounters, stats_line


class GLMMTPDrafter:
    NAME = "GLM MTP"
    def __init__(self, engine, timing: bool = False, exact: bool = False, out=None):
        if "glm_mtp" not in engine.drafters:
            raise Ds4Error(f"{engine.dir}: this artifact has no GLM MTP layer; compile a GGUF that holds its nextn "
                           f"block")
        self.timing, self.exact, self.out = timing, exact, out or sys.stderr
        self.reads = engine.drafters["glm_mtp"].get("reads", "hidden")   # the target output it drafts from
        self.hidden = None            # that output's row at the last committed position
        self.drafted_at = None        # the position whose row the last mtp_step wrote
        self.stats = DraftCounters()
        self._tokenizer_data, self._tok = engine.tokenizer_data, None
        self._cycle = None            # this cycle's draft and times (--mtp-timing)
        self._rejected = None         # a rejected cycle, whose line waits for the token committed there

    def begin(self, engine, step, stop_ids):
        hidden = step.outputs[self.reads]
        start = engine.pos - len(hidden)
        if start == 0:
            self._write_rows(engine, hidden, engine.history, 0, None)
        elif len(hidden) > 1:  # row 0 re-evaluated a kept position: its row is in place
            self._write_rows(engine, hidden[1:], engine.history[start + 1:], start + 1, hidden[0])
        else:
            self.hidden = hidden[-1]

    def guess(self, engine, remaining):
        return None

    def draft(self, engine, token, max_tokens):
        t0 = time.perf_counter()
        out = engine.call("mtp_step", hidden_prev=self.hidden[None], tokens=[token], start=engine.pos)
        self.drafted_at = engine.pos
        if max_tokens < 1:
            return []
        d = int(np.argmax(out["logits"][0]))
        now = time.perf_counter()
        self._cycle = {"draft": d, "draft_ms": 1000 * (now - t0), "t_verify": now}
        return [d]

    def result(self, accepted):
        self.stats.record(1, accepted)
        if self._cycle is not None:
            self._cycle.update(accepted=bool(accepted), verify_ms=1000 * (time.perf_counter() - self._cycle["t_verify"]))

    def observe(self, engine, step, tokens):
        if self._rejected is not None:
            self._print(self._rejected, tokens[0])
            self._rejected = None
        start = engine.pos - len(tokens)
        hidden = step.outputs[self.reads][:len(tokens)]
        if self.drafted_at == start:   # tokens[0]'s row was written when drafting after it
            if len(tokens) > 1:
                self._write_rows(engine, hidden[1:], tokens[1:], start + 1, hidden[0])
            else:
                self.hidden = hidden[0]
        else:
            self._write_rows(engine, hidden, tokens, start, self.hidden)
        self.drafted_at = None
        cycle, self._cycle = self._cycle, None
        if cycle is not None and "accepted" in cycle:
            if cycle["accepted"]:
                self._print(cycle, cycle["draft"])
            else:
                self._rejected = cycle

    def finish(self, engine):
        if self._rejected is not None:
            self._print(self._rejected, None)
            self._rejected = None

    def counters(self):
        return self.stats.as_dict()

    def stats_line(self, tok_s):
        d = self.counters()
        return stats_line(self.NAME, d, tok_s)

    def _write_rows(self, engine, hidden: np.ndarray, tokens: list[int], start: int, before) -> None:
        """Rows of committed positions start..: token i with the hidden state of position i - 1
        (`before` for the first; zeros at position 0, where nothing precedes)."""
        first = np.zeros_like(hidden[:1]) if before is None else before[None]
        engine.call("mtp_observe", hidden_prev=np.concatenate([first, hidden[:-1]]), tokens=list(tokens), start=start)
        self.hidden = hidden[-1]

    def _print(self, cycle: dict, true_token: int | None) -> None:
        if not self.timing:
            return
        ok = cycle["accepted"]
        verdict = ("EXACT_ACCEPT" if ok else "exact_reject") if self.exact else ("ACCEPT" if ok else "reject")
        true = f"{true_token} {self._text(true_token)!r}" if true_token is not None else "none (generation ended)"
        print(f"ds4: glm mtp cycle: verify2 {cycle['verify_ms']:.2f} ms, head+draft {cycle['draft_ms']:.2f} ms, "
              f"{verdict} (draft {cycle['draft']} {self._text(cycle['draft'])!r} vs true {true})", file=self.out)

    def _text(self, token: int) -> str:
        if self._tok is None:
            from ..tokenizer import Tokenizer

            self._tok = Tokenizer.from_metadata(self._tokenizer_data, source="tokenizer")
        return self._tok.decode([token])


def from_options(engine, options):
    """--mtp (bare) or --mtp-timing (the family's check_speculation refused the rest);
    --mtp-exact-sampling names the verdicts EXACT_*."""
    return GLMMTPDrafter(engine, timing=options.mtp_timing, exact=options.exact_sampling)
