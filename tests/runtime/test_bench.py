"""`ds4 bench` plumbing (no speed is asserted)."""

import json

import pytest

from conftest import always_drafting, run_ds4

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


def test_bench_concurrency_with_a_drafter(tmp_path_factory):
    """`--mtp --concurrency 2` (GLM-5.3's draft layer, asked every cycle): the generations at once
    speculate, each with its own drafter, and verify their blocks in shared calls (a block waits
    for the other generation's: Scheduler._verifies_now; without that wait 1.00 per call here), and
    their MTP steps go through the calls of one or two sequences that /metrics counts too."""
    from conftest import shared_tiny_glm

    art = shared_tiny_glm(tmp_path_factory)[0]
    r = run_ds4("bench", "-m", art, "--mtp", "--prompt-len", "16", "--gen", "12", "--verify-k", "2", "--repeats", "1",
                "--concurrency", "2", "--json", env=always_drafting())
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)["concurrency"]
    assert c["clients"] == 2 and c["verify_calls"] > 0 and 1 < c["mean_verify_batch"] <= 2, c
    assert c["draft_calls"] > 0 and 1 <= c["mean_draft_batch"] <= 2, c   # the MTP steps: batched copies of 2


def test_bench_errors(tiny_artifact):
    r = run_ds4("bench", "-m", tiny_artifact, "--dspark")
    assert r.returncode == 2 and "no DSpark drafter" in r.stderr
    r = run_ds4("bench", "-m", tiny_artifact, "--verify-k", "40")
    assert r.returncode == 2 and "--verify-k" in r.stderr
    r = run_ds4("bench", "-m", tiny_artifact, "--concurrency", "0")
    assert r.returncode == 2 and "--concurrency 0" in r.stderr
