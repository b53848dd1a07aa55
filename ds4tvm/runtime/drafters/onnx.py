"""Draft heads from ONNX (`ds4-compile --draft-onnx HEADS.onnx`, compile/onnx_heads.py), for every
family: after the token t the target chose from the hidden state h of the last committed position,
head i of `draft_onnx(h, t)` proposes the token i + 1 positions after t (its argmax); all K are
verified in one target pass. The heads keep no state: h comes with every target call (`hidden`)."""

from __future__ import annotations

import numpy as np

from ...errors import Ds4Error
from ..speculative import DraftCounters, stats_line


class ONNXDrafter:
    NAME = "ONNX heads"
    def __init__(self, engine):
        settings = engine.drafters.get("onnx")
        if settings is None:
            raise Ds4Error(f"{engine.dir}: this artifact has no ONNX draft heads; compile it with "
                           f"ds4-compile --draft-onnx HEADS.onnx")
        self.k, self.inputs, self.function = int(settings["k"]), tuple(settings["inputs"]), settings["function"]
        self.hidden = None                     # the target's hidden state at the last committed position
        self.stats = DraftCounters()
        self.by_head = [0] * self.k            # cycles in which head i's draft was accepted
        self.asked = [0] * self.k              # cycles in which head i proposed
        self._drafted = 0

    def begin(self, engine, step, stop_ids):
        self.hidden = step.outputs["hidden"][-1]

    def guess(self, engine, remaining):
        return None

    def draft(self, engine, token, max_tokens):
        inputs = {"hidden": self.hidden[None]}
        if "tokens" in self.inputs:
            inputs["tokens"] = [token]
        logits = engine.call(self.function, **inputs)["logits"][0]
        drafts = [int(np.argmax(row)) for row in logits[:max_tokens]]
        self._drafted = len(drafts)
        return drafts

    def result(self, accepted):
        self.stats.record(self._drafted, accepted)
        for i in range(self._drafted):
            self.asked[i] += 1
            self.by_head[i] += i < accepted

    def observe(self, engine, step, tokens):
        self.hidden = step.outputs["hidden"][len(tokens) - 1]
        self._drafted = 0

    def finish(self, engine):
        pass

    def counters(self):
        rates = [a / n if n else 0.0 for a, n in zip(self.by_head, self.asked)]
        return {**self.stats.as_dict(), "heads": self.k, "head_accept_rate": rates}

    def stats_line(self, tok_s):
        d = self.counters()
        heads = ",".join(f"{100 * r:.1f}%" for r in d["head_accept_rate"])
        return stats_line(self.NAME, d, tok_s, **{k: d[k] for k in ("full", "partial", "miss_first")}, per_head=heads)


def from_options(engine, options):
    """--draft-onnx (with --quality the heads are loaded and checked, decoding stays target-only)."""
    return ONNXDrafter(engine)
