"""Trains the embedded default of `ds4 demo`: a small DeepSeek-V4 code model and its DSpark drafter,
on the Python standard library source of this interpreter (ds4tvm/training/corpus.py; the files of
corpus.HELD_OUT are never trained on).

    python scripts/train_demo.py OUT                  # every stage, about an hour on 2 cores
    python scripts/train_demo.py OUT --stage drafter  # one stage, reading the earlier ones from OUT

Stages, each writing into OUT:
1. tokenizer: a byte-level BPE (HF tokenizers) with ds4's deepseek-v3 pre-tokenizer -> hf/;
2. target: a transformers DeepseekV4ForCausalLM of the real architecture (hyper-connections, a hash
   layer, ratio-4 layers with the indexer, a ratio-128 layer, MoE with a shared expert), trained on
   random windows of the training files -> hf/, then `ds4 convert --type q8_0` -> target.gguf;
3. drafter: the PyTorch DSpark reference (ds4tvm/training/dspark_reference.py) trained on the
   target's own greedy continuations of training windows, with the target's captured rows from the
   compiled engine; θ calibrated on held-out windows -> dspark.gguf.
The summary of every stage goes to OUT/summary.json; the log to stderr. Fixed seeds, torch threads
= cores: two runs on one machine give the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4tvm.training import corpus  # noqa: E402

BOS, EOS = "<|begin_of_file|>", "<|end_of_file|>"
# a code model's template: the user's text is the start of a file, continued by the model
TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
SEQ = 256


def target_config(vocab: int) -> dict:
    kinds = ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
             "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]
    return dict(vocab_size=vocab, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=len(kinds),
                num_attention_heads=4, head_dim=64, q_lora_rank=128, partial_rotary_factor=16 / 64,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, o_groups=2, o_lora_rank=128,
                index_n_heads=8, index_head_dim=32, index_topk=16, sliding_window=64, layer_types=kinds,
                mlp_layer_types=["hash_moe"] + ["moe"] * (len(kinds) - 1),
                tie_word_embeddings=False, rope_parameters={"rope_type": "yarn", "factor": 16,
                                                            "original_max_position_embeddings": 65536,
                                                            "beta_fast": 32, "beta_slow": 1})


class Log:
    def __init__(self, out: Path):
        self.path = out / "summary.json"
        self.summary = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __call__(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def record(self, stage: str, values: dict) -> None:
        self.summary[stage] = values
        self.path.write_text(json.dumps(self.summary, indent=1) + "\n")


# ---------------------------------------------------------------------------------- 1. tokenizer
def train_tokenizer(out: Path, vocab: int, files: list[Path], log: Log) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from ds4tvm.gguf.pretokenizers import PRE_TOKENIZERS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZERS["deepseek-v3"].regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS, EOS], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((corpus.read(p) for p in files), trainer, length=len(files))
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "chat_template": TEMPLATE}, indent=1))
    log(f"tokenizer: {tok.get_vocab_size()} tokens from {len(files)} files")
    log.record("tokenizer", {"vocab": tok.get_vocab_size(), "train_files": len(files)})


def load_tokenizer(out: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "hf" / "tokenizer.json"))


def token_stream(tok, files: list[Path]) -> np.ndarray:
    """Every file as BOS, its tokens, EOS, in the list's order."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts = [np.array([bos, *tok.encode(corpus.read(p)).ids, eos], np.int64) for p in files]
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------- 2. target
def new_target(vocab: int, seed: int):
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**target_config(vocab))
    model = DeepseekV4ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    for name, b in model.named_buffers():   # hash routing: distinct experts per token
        if name.endswith("tid2eid"):
            n_tok, k = b.shape
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(n_tok)]))
    return model


def heldout_perplexity(model, stream: np.ndarray, n_windows: int = 32) -> float:
    import torch

    starts = np.linspace(0, len(stream) - SEQ - 1, n_windows).astype(int)
    x = torch.from_numpy(np.stack([stream[s:s + SEQ] for s in starts]))
    model.eval()
    with torch.no_grad():
        loss = sum(model(x[i:i + 8], labels=x[i:i + 8]).loss.item() for i in range(0, len(x), 8)) / math.ceil(len(x) / 8)
    model.train()
    return math.exp(loss)


def train_target(out: Path, args, log: Log) -> None:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    tok = load_tokenizer(out)
    train = token_stream(tok, corpus.stdlib_files(False, args.max_files))
    held = token_stream(tok, corpus.stdlib_files(True, args.max_files))
    log(f"target: {len(train):,} training tokens, {len(held):,} held-out")
    model = new_target(tok.get_vocab_size(), args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(100, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    rng = np.random.default_rng(args.seed)
    t0, losses, curve = time.time(), [], []
    model.train()
    with Progress(TextColumn("training the target"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[loss]}"), disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("", total=args.steps, loss="")
        for step in range(args.steps):
            starts = rng.integers(0, len(train) - SEQ - 1, args.batch)
            x = torch.from_numpy(np.stack([train[s:s + SEQ] for s in starts]))
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=f"loss {np.mean(losses[-20:]):.3f}")
            if (step + 1) % 50 == 0:
                log(f"target step {step + 1}/{args.steps}: loss {np.mean(losses[-50:]):.3f}, "
                    f"{(step + 1) * args.batch * SEQ / (time.time() - t0):.0f} tok/s")
                curve.append([step + 1, round(float(np.mean(losses[-50:])), 4)])
            if args.minutes and time.time() - t0 > 60 * args.minutes:
                log(f"target: stopping at step {step + 1}: the {args.minutes}-minute budget is spent")
                break
    seconds = time.time() - t0
    ppl = heldout_perplexity(model, held, 32 if args.max_files is None else 2)
    log(f"target: {seconds / 60:.1f} min, held-out perplexity {ppl:.2f} (per token)")
    model.save_pretrained(out / "hf")
    from ds4tvm.families.deepseek4.convert import convert_hf

    convert_hf(out / "hf", out / "target.gguf", dense_type="q8_0", progress=False)
    log.record("target", {"parameters": n_params, "steps": len(losses), "batch": args.batch, "seq": SEQ,
                          "tokens": len(losses) * args.batch * SEQ, "train_tokens": int(len(train)),
                          "minutes": round(seconds / 60, 1), "final_loss": round(float(np.mean(losses[-50:])), 4),
                          "heldout_perplexity": round(ppl, 3), "loss_curve": curve})


# ---------------------------------------------------------------------------------- 3. drafter
DRAFTER = dict(n_stages=2, block_size=5, markov_rank=256)
BOUNDS = dict(max_context=512, max_verify=8, prefill_chunk=256)
PROMPT_TOKENS, NEW_TOKENS = 64, 192
THETAS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
DIRECT_RATE = 0.3     # about the share of plain decode steps when half the guesses are right


def _drafter_type(spec):
    from gguf import GGMLQuantizationType as QT

    from ds4tvm.families.deepseek4.random_model import default_type
    from ds4tvm.gguf.validate import DENSE, ROUTED

    return QT.Q8_0 if spec.types in (DENSE, ROUTED) and spec.shape[0] % 32 == 0 else default_type(spec)


def default_layers(n_layers: int) -> tuple[int, ...]:
    """The target layers the drafter reads: one from the middle, the last two."""
    return (n_layers // 2 - 1, n_layers - 2, n_layers - 1)


def capture_artifact(out: Path, target_path: Path, seed: int) -> Path:
    """The target compiled with a DSpark drafter (any: only its layer ids matter), for `captured`."""
    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import CompileRequest, compile_gguf
    from ds4tvm.families.deepseek4.config import Config as V4Config
    from ds4tvm.families.dspark.random_model import write_random_dspark
    from ds4tvm.gguf import open_gguf

    art = out / "capture-artifact"
    if not (art / "manifest.json").exists():
        cfg = V4Config.from_gguf(open_gguf(target_path))
        support = write_random_dspark(out / "capture-support.gguf", cfg, seed=seed,
                                      target_layer_ids=default_layers(cfg.n_layers), **DRAFTER)
        compile_gguf(target_path, art, CompileRequest("cpu", Bounds(**BOUNDS), support=support))
    return art


def initial_drafter(out: Path, target_path: Path, layers: tuple[int, ...], seed: int):
    """The support file to train from: every stage starts as a copy of the target's last layer (the
    same V4 block), the head as the target's output HC head, main_proj random, the Markov head
    small and the confidence head zero."""
    import torch

    from ds4tvm.families.deepseek4.config import Config as V4Config
    from ds4tvm.families.dspark.config import Config, paired_with
    from ds4tvm.families.dspark.random_model import write_random_dspark
    from ds4tvm.gguf import open_gguf
    from ds4tvm.training.dspark_reference import DSparkReference

    target_cfg = V4Config.from_gguf(open_gguf(target_path))
    start = write_random_dspark(out / "dspark-init.gguf", target_cfg, seed=seed, type_of=_drafter_type,
                                target_layer_ids=layers, **DRAFTER)
    cfg = paired_with(Config.from_gguf(open_gguf(start)), target_cfg)
    ref = DSparkReference(open_gguf(target_path), open_gguf(start), cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    last_layer, head = f"blk.{target_cfg.n_layers - 1}.", f"mtp.{cfg.n_stages - 1}."
    copies = {f"{head}hc_head_{k}.weight": f"output_hc_{k}.weight" for k in ("fn", "base", "scale")}
    copies[head + "norm.weight"] = "output_norm.weight"
    with torch.no_grad():
        for name in ref.w.f.tensors:
            p = ref.w(name)
            src = copies.get(name) or last_layer + name.split(".", 2)[2]
            if src in ref.t.f.tensors and tuple(ref.t(src).shape) == tuple(p.shape):
                p.copy_(ref.t(src))
            elif "markov_w" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif "confidence_head" in name:
                p.zero_()
    return ref


def collect(engine, files, n_prompts: int, seed: int, progress: str, cache: Path):
    """(captured rows, tokens, prompt length) of the target's greedy continuations of windows of
    the files (kept in `cache`, an .npz, for reruns of the training)."""
    if cache.exists():
        z = np.load(cache)
        return [(z[f"captured{i}"], z[f"tokens{i}"], int(z["starts"][i])) for i in range(len(z["starts"]))]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ds4tvm.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(engine.tokenizer_data)
    prompts = corpus.windows(tok, files, n_prompts, PROMPT_TOKENS, seed)
    with Progress(TextColumn(progress), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("", total=len(prompts))
        data = corpus.greedy_continuations(engine, prompts, NEW_TOKENS, "captured", lambda: bar.advance(task))
    arrays = {f"captured{i}": c for i, (c, _, _) in enumerate(data)}
    arrays.update({f"tokens{i}": t for i, (_, t, _) in enumerate(data)})
    np.savez(cache, starts=np.array([s for _, _, s in data]), **arrays)
    return data


def drafter_losses(ref, captured, tokens, anchors, direct=None):
    """Cross-entropy of each block row (LM head + the Markov bias of the true previous token)
    against the greedy continuation, and the confidence head's logistic loss against whether that
    row's argmax is right; and the rows' correctness. direct: ring rows from plain decode steps."""
    import torch

    B = ref.cfg.block_size
    tokens_t = torch.as_tensor(tokens)
    P = torch.as_tensor(anchors)
    offsets = torch.arange(B)
    labels = tokens_t[P[:, None] + 1 + offsets]
    prev = tokens_t[P[:, None] + offsets]
    r = ref.blocks(captured, tokens, anchors, direct)
    m, bias = ref.markov(prev)
    scores = ref.logits(r) + bias
    ce = torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), labels.reshape(-1))
    right = (scores.argmax(-1) == labels).to(r.dtype)
    c = ref.confidence(r, m)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(c, right)
    return ce, bce, right


def direct_rows(n: int, rng) -> np.ndarray:
    """Which positions a plain decode step committed: the runtime writes those ring rows through
    ds4's direct path (after a missed guess, a scheduler skip); the drafter learns both kinds."""
    return rng.random(n) < rng.uniform(0.0, DIRECT_RATE * 2)


def anchor_positions(seq_len: int, prompt_len: int) -> np.ndarray:
    """Anchors whose whole block of labels is the target's greedy continuation."""
    return np.arange(prompt_len - 1, seq_len - DRAFTER["block_size"] - 1)


def train_drafter_steps(ref, data, steps: int, lr: float, seed: int, log: Log):
    import torch

    params = [p for n, p in zip(ref.w.f.tensors, ref.parameters()) if not n.endswith("exp_probs_b.bias")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = np.random.default_rng(seed)
    hist = []
    for step in range(steps):
        captured, tokens, start = data[rng.integers(len(data))]
        anchors = rng.choice(anchor_positions(len(tokens), start), 48, replace=False)
        ce, bce, right = drafter_losses(ref, captured, tokens, anchors, direct_rows(len(tokens), rng))
        opt.zero_grad()
        (ce + 0.5 * bce).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        hist.append([ce.item(), bce.item(), *right.mean(0).tolist()])
        if (step + 1) % 50 == 0:
            h = np.mean(hist[-50:], axis=0)
            log(f"drafter step {step + 1}/{steps}: ce {h[0]:.3f}, confidence {h[1]:.3f}, "
                f"row accuracy {' '.join(f'{a:.2f}' for a in h[2:])}")
    return np.mean(hist[-50:], axis=0)


def acceptance(ref, data, thetas=THETAS) -> dict:
    """Per θ: the average accepted tokens per proposal (the guess counted, as ds4 counts) when each
    block is drafted as the runtime drafts it (the Markov chain on its own drafts, the gate's early
    stop, DIRECT_RATE of the ring rows from plain decode steps), over every anchor of the data."""
    import torch

    B = ref.cfg.block_size
    matched, sig = [], []
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for captured, tokens, start in data:
            anchors = anchor_positions(len(tokens), start)
            r = ref.blocks(captured, tokens, anchors, rng.random(len(tokens)) < DIRECT_RATE)
            logits = ref.logits(r)
            prev = torch.as_tensor(tokens)[anchors]
            run = torch.ones(len(anchors), dtype=torch.bool)
            m_len, s_rows = torch.zeros(len(anchors)), []
            for i in range(B):
                m, bias = ref.markov(prev)
                s_rows.append(torch.sigmoid(ref.confidence(r[:, i], m)))
                prev = (logits[:, i] + bias).argmax(-1)
                run &= prev == torch.as_tensor(tokens)[anchors + 1 + i]
                m_len += run
            matched.append(m_len)
            sig.append(torch.stack(s_rows, 1))
    matched, sig = torch.cat(matched), torch.cat(sig)
    out = {}
    for theta in thetas:
        passed = torch.cumprod((sig >= theta).to(torch.int64), 1).sum(1) if theta > 0 else torch.full_like(matched, B)
        proposed = passed.to(matched.dtype)
        out[theta] = {"accepted_per_proposal": round(float(torch.minimum(matched, proposed).mean()), 3),
                      "proposed_per_anchor": round(float(proposed.mean()), 3),
                      "empty_blocks": round(float((proposed == 0).to(torch.float32).mean()), 3)}
    return out


def train_drafter(out: Path, args, log: Log) -> None:
    from dataclasses import replace

    from ds4tvm.runtime.engine import Engine

    target = args.target or out / "target.gguf"
    engine = Engine(args.capture_artifact or capture_artifact(out, target, args.seed))
    ref = initial_drafter(out, target, tuple(engine.drafters["dspark"]["target_layer_ids"]), args.seed)
    t0 = time.time()
    data = collect(engine, corpus.stdlib_files(False, args.max_files), args.drafter_prompts, args.seed,
                   "greedy continuations (training)",
                   out / f"drafter-train-{args.drafter_prompts}-{args.seed}.npz")
    held = collect(engine, corpus.stdlib_files(True, args.max_files), max(4, args.drafter_prompts // 8),
                   args.seed + 1, "greedy continuations (held-out)",
                   out / f"drafter-heldout-{args.drafter_prompts}-{args.seed}.npz")
    log(f"drafter: {len(data)} training and {len(held)} held-out continuations in {time.time() - t0:.0f} s")
    before = acceptance(ref, held, (0.0,))[0.0]["accepted_per_proposal"]
    t1 = time.time()
    final = train_drafter_steps(ref, data, args.drafter_steps, 1e-3, args.seed, log)
    minutes = (time.time() - t1) / 60
    table = acceptance(ref, held)
    # θ: the most accepted tokens per verify row spent, among θ that keep most of the best acceptance
    best = max(v["accepted_per_proposal"] for v in table.values())
    theta = max((t for t, v in table.items() if v["accepted_per_proposal"] >= 0.9 * best),
                key=lambda t: (table[t]["accepted_per_proposal"] / max(table[t]["proposed_per_anchor"], 1e-9), t))
    for t, v in table.items():
        log(f"drafter held-out θ={t}: {v}")
    log(f"drafter: {minutes:.1f} min of training; accepted per proposal {before} before, "
        f"{table[theta]['accepted_per_proposal']} after at the calibrated θ={theta}")
    ref.cfg = replace(ref.cfg, confidence_threshold=float(theta))
    ref.save(out / "dspark.gguf", name="ds4tvm demo dspark")
    log.record("drafter", {**DRAFTER, "target_layer_ids": list(ref.cfg.target_layer_ids),
                           "training_sequences": len(data),
                           "heldout_sequences": len(held), "steps": args.drafter_steps, "minutes": round(minutes, 1),
                           "final_ce": round(float(final[0]), 4), "row_accuracy": [round(float(a), 3) for a in final[2:]],
                           "heldout_accepted_per_proposal_untrained": before, "heldout_by_theta": table,
                           "confidence_threshold": theta})


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--stage", choices=["all", "tokenizer", "target", "drafter"], default="all")
    p.add_argument("--vocab", type=int, default=6144)
    p.add_argument("--steps", type=int, default=1400, help="target optimizer steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--minutes", type=float, default=0, help="stop the target's training after this long (0: never)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files of each set (smoke tests)")
    p.add_argument("--drafter-steps", type=int, default=3000)
    p.add_argument("--drafter-prompts", type=int, default=320)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--target", type=Path, default=None, help="drafter stage: the target GGUF (default OUT/target.gguf)")
    p.add_argument("--capture-artifact", type=Path, default=None,
                   help="drafter stage: an artifact of the target compiled with a DSpark drafter, whose captured "
                        "rows it reads (default: compiled into OUT)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out)
    if args.stage in ("all", "tokenizer"):
        train_tokenizer(args.out, args.vocab, corpus.stdlib_files(False, args.max_files), log)
    if args.stage in ("all", "target"):
        train_target(args.out, args, log)
    if args.stage in ("all", "drafter"):
        train_drafter(args.out, args, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
