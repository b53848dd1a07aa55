"""Legacy one-stage MTP drafter for DeepSeek-V4-Flash (ds4-spec §7): after the token t the target
chose, the MTP block reads t's embedding and the target's final HC streams and drafts the next
token (argmax of the target's output head); recursively, from its own streams and that draft, up to
--mtp-draft N tokens per cycle (t included: N = 1 is off, 2 is recommended). With N = 2, a draft
whose top-1 minus top-2 logit margin is below --mtp-margin (DS4_MTP_MIN_MARGIN, default 3.0) is not
verified: t is decoded alone (a margin-skip). --mtp-timing prints one line per cycle."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from ...errors import Ds4Error
from ..speculative import DraftCounters, stats_line

DEFAULT_MARGIN = 3.0
MAX_DRAFT = 16


def _margin(logits: np.ndarray) -> float:
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0])


class MTPDrafter:
    NAME = "MTP"
    def __init__(self, engine, n_draft: int = 2, margin: float = DEFAULT_MARGIN, timing: bool = False):
        if "mtp" not in engine.drafters:
            raise Ds4Error(f"{engine.dir}: this artifact has no legacy MTP drafter; compile it with --mtp MTP.gguf")
        if not 2 <= n_draft <= MAX_DRAFT:
            raise Ds4Error(f"--mtp-draft {n_draft}: expected 2..{MAX_DRAFT} (1 turns MTP off)")
        if not margin >= 0:
            raise Ds4Error(f"--mtp-margin {margin}: expected a logit margin >= 0")
        self.n_draft, self.margin, self.timing = n_draft, margin, timing
        self.streams = None          # the target's HC streams at the last committed position
        self.stats, self.margin_skips = DraftCounters(), 0
        self._drafted, self._draft_ms = None, 0.0   # this cycle's drafts, for result() and --mtp-timing

    def begin(self, engine, step, stop_ids):
        streams = step.outputs["hc_state"]
        start = engine.pos - len(streams)
        if start == 0:
            self._write_rows(engine, streams, engine.history, 0, None)
        elif len(streams) > 1:  # row 0 re-evaluated a kept position: its ring row is in place
            self._write_rows(engine, streams[1:], engine.history[start + 1:], start + 1, streams[0])
        else:
            self.streams = streams[-1]

    def guess(self, engine, remaining):
        return None

    def draft(self, engine, token, max_tokens):
        t0 = time.perf_counter()
        streams, drafts, tok = self.streams[None], [], token
        for i in range(min(self.n_draft - 1, max_tokens)):
            out = engine.call("mtp_step", hc_prev=streams, tokens=[tok], start=engine.pos + i)
            logits = out["logits"][0]
            if self.n_draft == 2 and _margin(logits) < self.margin:
                self.margin_skips += 1
                break
            tok = int(np.argmax(logits))
            drafts.append(tok)
            streams = out["hc_state"]
        self._drafted, self._draft_ms = len(drafts), 1000 * (time.perf_counter() - t0)
        if self.timing:
            self._t_verify = time.perf_counter()
        return drafts

    def result(self, accepted):
        self.stats.record(self._drafted or 0, accepted)

    def observe(self, engine, step, tokens):
        if self.timing and self._drafted is not None:
            kind = "decode2" if self._drafted else "margin-skip"
            print(f"ds4: mtp timing {kind} drafted={self._drafted} committed={len(tokens)} "
                  f"draft={self._draft_ms:.2f} ms verify={1000 * (time.perf_counter() - self._t_verify):.2f} ms",
                  file=sys.stderr)
        self._drafted = None
        self._write_rows(engine, step.outputs["hc_state"][:len(tokens)], tokens, engine.pos - len(tokens),
                         self.streams)

    def finish(self, engine):
        pass

    def counters(self):
        return {**self.stats.as_dict(), "margin_skips": self.margin_skips}

    def stats_line(self, tok_s):
        d = self.counters()
        return stats_line(self.NAME, d, tok_s, **{k: d[k] for k in ("full", "partial", "miss_first", "margin_skips")})

    def _write_rows(self, engine, streams: np.ndarray, tokens: list[int], start: int, before) -> None:
        """Ring rows for committed positions start..: token i with the streams of position i - 1
        (`before` for the first; zeros at position 0, where nothing precedes)."""
        first = np.zeros_like(streams[:1]) if before is None else before[None]
        engine.call("mtp_observe", hc_prev=np.concatenate([first, streams[:-1]]), tokens=tokens, start=start)
        self.streams = streams[-1]


def from_options(engine, options):
    """--mtp FILE --mtp-draft N [--mtp-margin F] [--mtp-timing]."""
    margin = options.mtp_margin
    if margin is None:
        try:
            margin = float(os.environ.get("DS4_MTP_MIN_MARGIN", DEFAULT_MARGIN))
        except ValueError:
            raise Ds4Error(f"DS4_MTP_MIN_MARGIN={os.environ['DS4_MTP_MIN_MARGIN']!r}: expected a number") from None
    return MTPDrafter(engine, max(options.mtp_draft, 2) if options.mtp_timing else options.mtp_draft, margin,
                      options.mtp_timing)
