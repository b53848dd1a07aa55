"""Fuzzing the GGUF reader as a user's damaged or hostile file meets it: seeded mutants of small
valid DeepSeek-V4 and Qwen3.8 files (header, metadata, tensor infos, data) through the reader, the
family's config and tensor checks and the tokenizer. Every mutant is accepted or refused with a
one-line Ds4Error: no other exception, no hang, bounded memory. 300 mutants here, 3,000 under
-m slow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _sources(d: Path) -> list[Path]:
    from ds4tvm.families.deepseek4.random_model import tiny_config as v4_config
    from ds4tvm.families.deepseek4.random_model import write_random_deepseek4
    from ds4tvm.families.qwen4exp.random_model import tiny_config as qwen_config
    from ds4tvm.families.qwen4exp.random_model import write_random_qwen4exp

    return [write_random_deepseek4(d / "v4.gguf", v4_config(), seed=3),
            write_random_qwen4exp(d / "qwen.gguf", qwen_config(), seed=3)]


def _fuzz(tmp_path, count: int, seed: int) -> dict:
    files = _sources(tmp_path)
    r = subprocess.run([sys.executable, str(TESTS / "gguf_fuzz.py"), str(count), str(seed), *map(str, files)],
                       capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    print(f"\n{report}")
    return report


def _check(report: dict, count: int) -> None:
    assert report["mutants"] == count
    assert report["others"] == [] and report["hangs"] == 0, report
    assert report["refused"] > count // 2, report   # most mutants of the header are refused, as they should be
    assert report["peak_rss_mib"] < 1024, report    # no allocation sized by a forged count


def test_300_gguf_mutants(tmp_path):
    _check(_fuzz(tmp_path, 300, 40), 300)


@pytest.mark.slow
def test_3000_gguf_mutants(tmp_path):
    _check(_fuzz(tmp_path, 3000, 41), 3000)
