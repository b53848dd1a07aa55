"""scripts/train_demo.py, shortened so that it cannot rot: every stage on a few files for a few
steps. The drafter stage reads its captured rows from the random demo pair's artifact (a DSpark
artifact of the random target) instead of compiling one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo.py"


def _train(out, *args):
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), "--max-files", "3", *map(str, args)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_tokenizer_and_target_stages_write_a_gguf_ds4_reads(tmp_path):
    from ds4tvm.families.deepseek4.config import Config
    from ds4tvm.gguf import open_gguf
    from ds4tvm.runtime.tokenizer import Tokenizer

    summary = _train(tmp_path, "--stage", "tokenizer", "--vocab", "1024")
    summary = _train(tmp_path, "--stage", "target", "--steps", "2", "--batch", "2")
    assert summary["target"]["steps"] == 2 and summary["target"]["heldout_perplexity"] > 1
    f = open_gguf(tmp_path / "target.gguf")
    cfg = Config.from_gguf(f)
    assert set(cfg.compress_ratios) == {0, 4, 128} and cfg.n_hash_layers == 1 and cfg.n_expert_shared == 1
    assert f.tensors["blk.2.attn_q_b.weight"].ggml_type.name == "Q8_0"
    tok = Tokenizer.from_gguf(f)
    text = 'def add(a, b):\n    """Sum."""\n    return a + b\n'
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert tok.encode(text, add_bos=False) == hf.encode(text).ids
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_drafter_stage_trains_calibrates_and_writes_a_support_file(demo_pair, tmp_path):
    from ds4tvm.families.dspark.config import Config
    from ds4tvm.gguf import open_gguf

    model, _, art, _ = demo_pair
    summary = _train(tmp_path, "--stage", "drafter", "--target", model, "--capture-artifact", art,
                     "--drafter-steps", "2", "--drafter-prompts", "2")
    d = summary["drafter"]
    assert d["steps"] == 2 and set(d["heldout_by_theta"]) >= {"0.0", "0.7"}
    cfg = Config.from_gguf(open_gguf(tmp_path / "dspark.gguf"))
    assert cfg.confidence_threshold == pytest.approx(d["confidence_threshold"], abs=1e-6) and cfg.block_size == 5
