"""`ds4 bench` plumbing (no speed is asserted)."""

import json

import pytest

from conftest import run_ds4

pytestmark = pytest.mark.compile


def test_bench_json_fields(tiny_artifact, tmp_path):
    r = run_ds4("bench", "-m", tiny_artifact, "--prompt-len", "16", "--gen", "8", "--verify-k", "3", "--repeats", "1",
                "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert {"prompt_len", "gen", "repeats", "prefill_tok_s", "decode_tok_s", "verify_cost"} <= set(info)
    assert sorted(info["verify_cost"]) == ["1", "2", "3"] and info["decode_tok_s"] > 0
    assert "speculative" not in info
    table = run_ds4("bench", "-m", tiny_artifact, "--prompt-len", "16", "--gen", "4", "--verify-k", "2",
                    "--repeats", "1", "--concurrency", "3")
    assert table.returncode == 0 and "verify(k) / decode" in table.stdout
    line = next(x for x in table.stdout.splitlines() if x.startswith("3 at once"))
    assert "sequences per decode call (compiled for up to 3)" in line, line


def test_bench_errors(tiny_artifact):
    r = run_ds4("bench", "-m", tiny_artifact, "--dspark")
    assert r.returncode == 2 and "no DSpark drafter" in r.stderr
    r = run_ds4("bench", "-m", tiny_artifact, "--verify-k", "40")
    assert r.returncode == 2 and "--verify-k" in r.stderr
    r = run_ds4("bench", "-m", tiny_artifact, "--concurrency", "0")
    assert r.returncode == 2 and "--concurrency 0" in r.stderr
