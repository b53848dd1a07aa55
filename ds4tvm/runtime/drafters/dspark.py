"""DSpark drafter (ds4 behaviour): rings fed with every committed position, the 3-stage block
over [main row, anchor, noise...], then per step the Markov head (row lookup in w1, rank->vocab
bias through w2, argmax with ties to the lower id) and the confidence gate sigma(c_i) >= theta
with an early stop; c_0 is evaluated before the LM head, so an empty block skips it."""

from __future__ import annotations

import math

import numpy as np
from gguf import quants

from ...errors import Ds4Error
from ..speculative import Proposal

DEFAULT_THETA = 0.7
EXACT_DEFAULT_THETA = 0.8


class DSparkDrafter:
    def __init__(self, engine, theta: float = DEFAULT_THETA, max_block: int | None = None):
        if engine.draft is None:
            raise Ds4Error(f"{engine.dir}: this artifact has no DSpark drafter; compile it with --mtp SUPPORT.gguf")
        if not 0 <= theta <= 1:
            raise Ds4Error(f"--dspark-confidence {theta}: expected a value in [0, 1]")
        d = engine.draft
        self.block_size, self.noise, self.theta = d["block_size"], d["noise_token_id"], theta
        self.proposals = min(self.block_size, max_block or self.block_size)  # a verify cap
        last = f"mtp.{d['n_stages'] - 1}."
        t = engine.draft_gguf.tensors[last + "confidence_head.proj.weight"]
        # The confidence head is one vector of width + rank values; it is read on the host.
        self.conf = quants.dequantize(np.asarray(t.data), t.ggml_type).reshape(-1).astype(np.float64)
        self.anchor_row = None

    def begin(self, engine, prompt):
        engine.dspark_observe(engine.captured, 0, direct=False)
        self.anchor_row = engine.captured[-1]

    def observe(self, engine, tokens, speculative):
        rows = engine.captured[:len(tokens)]
        engine.dspark_observe(rows, engine.pos - len(tokens), direct=not speculative)
        self.anchor_row = rows[-1]

    def draft(self, engine, anchor, max_tokens):
        r = engine.dspark_block(self.anchor_row, [anchor] + [self.noise] * (self.block_size - 1), engine.pos - 1)
        prev, tokens, logits, first = anchor, [], None, None
        for i in range(min(self.proposals, max_tokens)):
            m, bias = engine.dspark_markov(prev)
            if self.theta > 0:
                c = float(np.dot(self.conf, np.concatenate([r[i], m])))
                sig = 1.0 / (1.0 + math.exp(-c)) if c > -700 else 0.0
                first = sig if i == 0 else first
                if sig < self.theta:
                    break
            if logits is None:  # the LM head runs only once the first row passed its gate
                logits = engine.dspark_logits(r)
            prev = int(np.argmax(logits[i] + bias))
            tokens.append(prev)
        return Proposal(tokens, first_confidence=first)
