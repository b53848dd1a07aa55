"""Qwen3.8's MTP drafter (ds4-spec §5): the nextn layer inside the model GGUF
(families/qwen4exp/mtp.py) drafts d after the token t the target chose, from t's embedding and the
target's hc streams before t, and at depth 3 a chained d2 from d and its own streams; the loop
verifies [t, d] or [t, d, d2] in one pass and commits 1 to 3 tokens (a rejection picks the
verifier's GDN / conv / PLE snapshot slots: no replay). Acceptance is the loop's (greedy,
opportunistic, or exact with --mtp-exact-sampling).

The layer's rows: each committed position p holds the row of (token p, target streams of p - 1).
Drafting after t at p writes t's row; the rows of the other committed tokens (accepted drafts,
tokens decoded without drafting) wait and go into the next draft's pass (one call: those rows,
then t), or into `mtp_observe` when many wait or the generation ends. A chained step writes d's
row from the layer's own streams; that row is past the committed length and is rewritten from the
target's streams once d is committed.

Depth (`DepthPolicy`, ds4's qwen4_spec_depth): --mtp-exact-sampling pins 2, else
DS4_QWEN4_MTP_DEPTH=2|3 pins it (re-read every cycle; 0 or unset: adaptive). --mtp-timing adds a line per cycle."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from ...errors import Ds4Error
from ..speculative import DraftCounters, stats_line

DEPTH_ENV = "DS4_QWEN4_MTP_DEPTH"
FLUSH_ROWS = 32     # committed rows left unwritten (plain steps while the cost model leaves the drafter out) before a write


def pinned_depth() -> int | None:
    """DS4_QWEN4_MTP_DEPTH: 2 or 3, or None (0, unset: adaptive)."""
    value = os.environ.get(DEPTH_ENV, "").strip()
    if value in ("", "0"):
        return None
    if value not in ("2", "3"):
        raise Ds4Error(f"{DEPTH_ENV}={value}: expected 2 or 3 (a fixed depth), or 0 / unset (adaptive)")
    return int(value)


@dataclass
class DepthPolicy:
    """Verify depth (rows per cycle: the chosen token and 1 or 2 drafts). Adaptive: promote to 3
    when the last 8 first drafts were all accepted, after >= 8 cycles, with no second-draft
    rejection pending; demote when fewer than 6 of the last 8 were accepted or after 2 second-draft
    rejections in a row (d accepted, d2 not)."""
    window: int = 0         # first-draft outcomes, newest in bit 0, 8 kept
    cycles: int = 0
    reject2_streak: int = 0
    depth: int = 2

    def choose(self, exact: bool) -> int:
        pinned = pinned_depth()   # read (and checked) every cycle
        if exact:
            return 2
        if pinned is not None:
            return pinned
        accepted = bin(self.window).count("1")
        if self.depth == 2 and accepted == 8 and self.cycles >= 8 and self.reject2_streak == 0:
            self.depth = 3
        elif self.depth == 3 and (accepted < 6 or self.reject2_streak >= 2):
            self.depth = 2
        return self.depth

    def record(self, proposed: int, accepted: int) -> None:
        self.window = ((self.window << 1) | (accepted >= 1)) & 0xFF
        self.cycles += 1
        if proposed >= 2 and accepted >= 1:
            self.reject2_streak = 0 if accepted >= 2 else self.reject2_streak + 1


class QwenMTPDrafter:
    NAME = "Qwen3.8 MTP"
    def __init__(self, engine, timing: bool = False, exact: bool = False, out=None):
        if "qwen_mtp" not in engine.drafters:
            raise Ds4Error(f"{engine.dir}: this artifact has no Qwen3.8 MTP layer; compile a GGUF that holds its "
                           f"nextn block")
        pinned_depth()   # a bad DS4_QWEN4_MTP_DEPTH is an error before the first token
        self.timing, self.exact, self.out = timing, exact, out or sys.stderr
        self.streams = None           # the target's streams at the last committed position
        self.waiting: tuple[list, list] = ([], [])   # committed rows not yet written: tokens, streams before each
        self.drafted_at = None        # the position whose row the last mtp_step wrote
        self.stop_ids = frozenset()
        self.policy = DepthPolicy()
        self.stats = DraftCounters()
        self.by_depth = {2: DraftCounters(), 3: DraftCounters()}
        self._cycle = None            # this cycle's drafts and times

    def begin(self, engine, step, stop_ids):
        self.stop_ids, self.waiting, self.drafted_at = frozenset(stop_ids), ([], []), None
        streams = step.outputs["streams"]
        start = engine.pos - len(streams)
        if start == 0:
            self._write(engine, engine.history, [np.zeros_like(streams[0]), *streams[:-1]])
        elif len(streams) > 1:   # row 0 re-evaluated a kept position: its row is in place
            self._write(engine, engine.history[start + 1:], list(streams[:-1]))
        self.streams = streams[-1]

    def guess(self, engine, remaining):
        return None

    def draft(self, engine, token, max_tokens):
        t0 = time.perf_counter()
        tokens, before = self.waiting[0] + [token], self.waiting[1] + [self.streams]
        out = engine.call("mtp_step", streams_prev=np.stack(before), tokens=tokens, start=engine.pos - len(tokens) + 1)
        self.waiting, self.drafted_at = ([], []), engine.pos
        if max_tokens < 1:
            return []
        drafts = [int(np.argmax(out["logits"][0]))]
        depth = self.policy.choose(self.exact)
        if depth == 3 and max_tokens >= 2 and drafts[0] not in self.stop_ids:
            out = engine.call("mtp_step", streams_prev=out["streams"], tokens=drafts, start=engine.pos + 1)
            drafts.append(int(np.argmax(out["logits"][0])))
        now = time.perf_counter()
        self._cycle = {"drafts": drafts, "draft_ms": 1000 * (now - t0), "t_verify": now}
        return drafts

    def result(self, accepted):
        proposed = len(self._cycle["drafts"]) if self._cycle is not None else 1
        self.stats.record(proposed, accepted)
        self.by_depth[proposed + 1].record(proposed, accepted)
        self.policy.record(proposed, accepted)
        if self.timing and self._cycle is not None:
            verify_ms = 1000 * (time.perf_counter() - self._cycle["t_verify"])
            print(f"ds4: qwen mtp cycle: depth {proposed + 1}, draft {self._cycle['draft_ms']:.2f} ms, "
                  f"verify{proposed + 1} {verify_ms:.2f} ms, accepted {accepted}/{proposed} "
                  f"(drafts {' '.join(map(str, self._cycle['drafts']))})", file=self.out)
        self._cycle = None

    def observe(self, engine, step, tokens):
        start = engine.pos - len(tokens)
        streams = step.outputs["streams"][:len(tokens)]
        if self.drafted_at == start:   # tokens[0]'s row was written when drafting after it
            self.waiting[0].extend(tokens[1:])
            self.waiting[1].extend(streams[:-1])
        else:
            self.waiting[0].extend(tokens)
            self.waiting[1].extend([self.streams, *streams[:-1]])
        self.streams, self.drafted_at = streams[-1], None
        if len(self.waiting[0]) >= FLUSH_ROWS:
            self.finish(engine)

    def finish(self, engine):
        tokens, before = self.waiting
        if tokens:
            self._write(engine, tokens, before)
        self.waiting = ([], [])

    def counters(self):
        d = self.stats.as_dict()
        d["by_depth"] = {str(k): c.as_dict() for k, c in self.by_depth.items()}
        d["depth_now"] = self.policy.depth
        return d

    def stats_line(self, tok_s):
        d = self.counters()
        per = {f"depth{k}": f"{v['accepted_draft']}/{v['proposed']}@{v['cycles']}"
               for k, v in d["by_depth"].items() if v["cycles"]}
        return stats_line(self.NAME, d, tok_s, **per)

    def _write(self, engine, tokens: list[int], before: list) -> None:
        """Rows of the committed positions that end at engine.pos."""
        engine.call("mtp_observe", streams_prev=np.stack(before), tokens=list(tokens), start=engine.pos - len(tokens))


def from_options(engine, options):
    """--mtp (bare) or --mtp-timing (the family's check_speculation refused the rest)."""
    return QwenMTPDrafter(engine, timing=options.mtp_timing, exact=options.exact_sampling)
