"""What int8 activations (`ds4-compile --int8-activations`) do to a trained model's predictions:
the same GGUF compiled for this CPU with float and with int8 inputs to its quantized linears, both
run over held-out windows of Python's standard library (ds4tvm/training/corpus.py), compared as
llama.cpp's `perplexity --kl-divergence` compares two builds: top-1 agreement of the next-token
predictions, perplexity of the text under each, and the KL divergence of the int8 distributions
from the float ones (mean, 99th percentile, max). Default: the embedded demo target (Q8_0).

    python benchmarks/int8_quality.py [MODEL.gguf] [--windows 16] [--length 256] [--dir DIR]
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np

from ds4tvm.artifact import Bounds
from ds4tvm.compile.driver import CompileRequest, compile_gguf
from ds4tvm.runtime.engine import Engine
from ds4tvm.runtime.tokenizer import Tokenizer
from ds4tvm.training import corpus


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def logits_of(art: Path, windows: list[list[int]]) -> list[np.ndarray]:
    engine = Engine(art)
    out = []
    for w in windows:
        engine.reset()
        out.append(engine.prefill(w, all_logits=True).logits)
    return out


def compare(windows, ref: list[np.ndarray], test: list[np.ndarray]) -> dict:
    agree, nll_ref, nll_test, kl = [], [], [], []
    for w, a, b in zip(windows, ref, test):
        la, lb = log_softmax(a[:-1]), log_softmax(b[:-1])   # row i predicts token i + 1
        nxt = np.asarray(w[1:])
        agree.append(la.argmax(-1) == lb.argmax(-1))
        nll_ref.append(-la[np.arange(len(nxt)), nxt])
        nll_test.append(-lb[np.arange(len(nxt)), nxt])
        kl.append((np.exp(la) * (la - lb)).sum(-1))
    agree, nll_ref, nll_test, kl = (np.concatenate(x) for x in (agree, nll_ref, nll_test, kl))
    return {"tokens": int(agree.size), "top1_agreement": float(agree.mean()),
            "ppl_float": float(np.exp(nll_ref.mean())), "ppl_int8": float(np.exp(nll_test.mean())),
            "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", help="GGUF (default: the embedded demo target)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=None, help="where the two artifacts are compiled (kept)")
    a = ap.parse_args()
    if a.model is None:
        from ds4tvm.demo import embedded_pair

        a.model = embedded_pair()[0]
    work = a.dir or Path(tempfile.mkdtemp(prefix="int8-quality-"))
    bounds = Bounds(max_context=max(512, a.length), max_verify=8, prefill_chunk=256)
    arts = {}
    for name, int8 in (("float", False), ("int8", True)):
        arts[name] = work / name
        if not (arts[name] / "manifest.json").is_file():
            compile_gguf(Path(a.model), arts[name], CompileRequest("cpu", bounds, int8_activations=int8))
    tok = Tokenizer.from_metadata(Engine(arts["float"]).tokenizer_data)
    windows = corpus.windows(tok, corpus.stdlib_files(True), a.windows, a.length, seed=11)
    r = compare(windows, logits_of(arts["float"], windows), logits_of(arts["int8"], windows))
    print(f"{Path(a.model).name}: {len(windows)} held-out windows of {a.length} tokens ({r['tokens']} predictions)")
    print("| top-1 agreement | perplexity float | perplexity int8 | KL mean | KL p99 | KL max |")
    print("|---|---|---|---|---|---|")
    print(f"| {100 * r['top1_agreement']:.2f}% | {r['ppl_float']:.3f} | {r['ppl_int8']:.3f} | {r['kl_mean']:.5f} | "
          f"{r['kl_p99']:.5f} | {r['kl_max']:.4f} |")


if __name__ == "__main__":
    main()
