"""The worked example of `--draft-onnx`: trains K Medusa-style draft heads for the embedded default
model (`ds4 demo`), exports them with torch.onnx.export, compiles them into an artifact with the
target and measures them on held-out text.

    python scripts/train_onnx_heads.py --out heads.onnx          # train + export (+ evaluate)
    ds4-compile "$(python -c 'import ds4tvm.demo as d; print(d.embedded_pair()[0])')" \
        --draft-onnx heads.onnx -o demo-heads
    ds4 run -m demo-heads -p "def parse(" --temp 0 --draft-onnx

Each head is a residual block over the target's final hidden state h (r_k = h + SiLU(W_k h + b_k))
read by the target's own output head, frozen; all heads go through that head in one product. Head
k at position p learns the token k + 2 positions after p: after the token t the target chooses from
h, the (k + 1)-th token after t. The labels are the target's own greedy continuations (self-
distillation: what greedy verification accepts), of prompts cut from the Python standard library's
source (ds4tvm/training/corpus.py: the files of corpus.HELD_OUT are never trained on and give the
evaluation prompts). The target's hidden states come from the ds4tvm engine
(every target function returns `hidden`), so the heads learn the compiled model's numbers.
Deterministic for a seed (torch threads = cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

def examples(data, k: int):
    """Training pairs: the hidden state at p (p + 1 a target choice) and the k tokens p + 2 .. p + k + 1."""
    xs, ys = [], []
    for hidden, seq, start in data:
        for p in range(start - 1, len(seq) - k - 1):
            xs.append(hidden[p])
            ys.append(seq[p + 2:p + 2 + k])
    return np.stack(xs).astype(np.float32), np.stack(ys).astype(np.int64)


def heads_module(lm_head: np.ndarray, k: int):
    import torch

    class MedusaHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            V, D = lm_head.shape
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(k))
            for b in self.blocks:   # start as the identity: every head reads h as the output head does
                torch.nn.init.zeros_(b.weight)
                torch.nn.init.zeros_(b.bias)
            self.lm_head = torch.nn.Linear(D, V, bias=False)
            self.lm_head.weight.data.copy_(torch.from_numpy(lm_head))
            self.lm_head.weight.requires_grad_(False)

        def forward(self, hidden):
            r = torch.stack([hidden + torch.nn.functional.silu(b(hidden)) for b in self.blocks], dim=1)
            n, K, D = r.shape
            return self.lm_head(r.reshape(n * K, D)).reshape(n, K, -1)

    return MedusaHeads()


def train(model, x: np.ndarray, y: np.ndarray, steps: int, batch: int, lr: float, seed: int, progress):
    import torch

    g = torch.Generator().manual_seed(seed)
    X, Y = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, len(X), (batch,), generator=g)
        logits = model(X[idx])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), Y[idx].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        progress(step, losses[-1])
    return losses


def export(model, D: int, path: Path) -> Path:
    import torch

    model.eval()
    example = torch.zeros(4, D)
    torch.onnx.export(model, (example,), str(path), input_names=["hidden"], output_names=["logits"],
                      dynamic_shapes={"hidden": {0: torch.export.Dim("n", min=1, max=4096)}}, dynamo=True,
                      verbose=False)
    return path


def _vs_onnxruntime(engine, heads: Path, window: list[int]) -> float | None:
    """The largest difference between the compiled heads and onnxruntime, on the target's hidden
    states of one window (None without onnxruntime)."""
    try:
        import onnxruntime
    except ImportError:
        return None
    engine.reset()
    hidden = engine.prefill(window, all_logits=True).outputs["hidden"]
    want = onnxruntime.InferenceSession(str(heads)).run(["logits"], {"hidden": hidden})[0]
    return float(np.abs(engine.call("draft_onnx", hidden=hidden)["logits"] - want).max())


def evaluate(art: Path, heads: Path, windows, n_new: int) -> dict:
    """Greedy target-only vs with the heads on the held-out windows: identical text, per-head
    acceptance and tok/s (alternated per window)."""
    from ds4tvm.runtime.drafters.onnx import ONNXDrafter
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.sampler import SamplingParams
    from ds4tvm.runtime.speculative import generate

    engine, greedy = Engine(art), SamplingParams(temperature=0.0)
    plain_t = spec_t = 0.0
    drafter = ONNXDrafter(engine)
    tokens = 0
    for w in windows:
        engine.reset()
        plain, s = generate(engine, w, n_new, greedy, np.random.default_rng(0))
        plain_t += s.seconds
        engine.reset()
        spec, s2 = generate(engine, w, n_new, greedy, np.random.default_rng(0), drafter=drafter)
        spec_t += s2.seconds
        tokens += len(plain)
        if spec != plain:
            raise SystemExit("train_onnx_heads: speculation with the heads changed the greedy text")
    c = drafter.counters()
    return {"windows": len(windows), "tokens": tokens, "onnxruntime_max_abs_diff": _vs_onnxruntime(engine, heads, windows[0]), "target_only_tok_s": round(tokens / plain_t, 1),
            "heads_tok_s": round(tokens / spec_t, 1), "speedup": round(plain_t / spec_t, 3),
            "accept_rate": round(c["accept_rate"], 4), "avg_accept": round(c["avg_accept"], 3),
            "head_accept_rate": [round(r, 4) for r in c["head_accept_rate"]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("heads.onnx"))
    ap.add_argument("--demo-dir", type=Path, default=None, help="where the embedded model's artifact is (compiled "
                    "there on first use; default: the ds4tvm cache)")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--windows", type=int, default=256, help="training prompts")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--continue-len", type=int, default=48, help="greedy tokens after each prompt")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-eval", action="store_true", help="skip compiling and measuring the heads")
    ap.add_argument("--json", type=Path, help="write the losses and the evaluation here")
    a = ap.parse_args(argv)
    import torch
    from gguf.quants import dequantize
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import CompileRequest, compile_gguf
    from ds4tvm.demo import embedded_artifact, embedded_pair
    from ds4tvm.training import corpus
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.engine import Engine
    from ds4tvm.runtime.tokenizer import Tokenizer

    torch.manual_seed(a.seed)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model_path = embedded_pair()[0]
    engine = Engine(embedded_artifact(a.demo_dir))
    tok = Tokenizer.from_metadata(engine.tokenizer_data, source=str(model_path))
    out = open_gguf(model_path).tensors["output.weight"]
    lm_head = dequantize(out.data, out.ggml_type).reshape(engine.n_vocab, -1).astype(np.float32)
    t0 = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=None, transient=False) as bar:
        task = bar.add_task("target continuations", total=a.windows, info="")
        data = corpus.greedy_continuations(engine, corpus.windows(tok, corpus.stdlib_files(False), a.windows,
                                                                  a.prompt_len, a.seed),
                                           a.continue_len, "hidden", lambda: bar.advance(task))
        x, y = examples(data, a.heads)
        heads = heads_module(lm_head, a.heads)
        task = bar.add_task("training heads", total=a.steps, info="")
        losses = train(heads, x, y, a.steps, a.batch, a.lr, a.seed,
                       lambda s, loss: bar.update(task, advance=1, info=f"loss {loss:.3f}"))
    print(f"train_onnx_heads: {len(x)} examples, loss {losses[0]:.3f} -> {np.mean(losses[-20:]):.3f} "
          f"in {time.time() - t0:.0f} s", file=sys.stderr)
    export(heads, x.shape[1], a.out)
    print(f"train_onnx_heads: wrote {a.out}", file=sys.stderr)
    report = {"examples": len(x), "loss_first": losses[0], "loss_last20": float(np.mean(losses[-20:]))}
    if not a.no_eval:
        with tempfile.TemporaryDirectory() as d:
            heads_art = compile_gguf(model_path, Path(d) / "art", CompileRequest("cpu", Bounds(512, 8, 256),
                                                                                draft_onnx=a.out, progress=True))
            held = corpus.windows(tok, corpus.stdlib_files(True), a.eval_windows, a.prompt_len, a.seed + 1)
            report["held_out"] = evaluate(heads_art, a.out, held, a.continue_len)
        print(json.dumps(report["held_out"]))
    if a.json:
        a.json.write_text(json.dumps({**report, "losses": losses}, indent=1))


if __name__ == "__main__":
    main()
