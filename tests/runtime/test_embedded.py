"""The embedded default (ds4tvm/data/demo, trained by scripts/train_demo.py): `ds4 demo` from an
empty cache, then `ds4 run` and `ds4 serve` with no model, which reuse the artifact it compiled.
The three that compile are under -m slow for the default run's time; .ci/run runs `ds4 demo` and a
`ds4 run` with no model after the tests."""

import hashlib
import json
import os
import re

import pytest

from conftest import run_ds4



def test_shipped_files_are_the_ones_their_sums_name():
    from ds4tvm.demo import DATA, SUPPORT_FILE, TARGET_FILE

    sums = dict(line.split()[::-1] for line in (DATA / "SHA256SUMS").read_text().splitlines() if line.strip())
    assert set(sums) == {TARGET_FILE, SUPPORT_FILE}
    for name, digest in sums.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name
    total = sum((DATA / name).stat().st_size for name in sums)
    assert total <= 40 << 20, total
    summary = json.loads((DATA / "training.json").read_text())
    assert summary["target"]["heldout_perplexity"] > 1 and summary["drafter"]["confidence_threshold"] >= 0


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An empty ds4tvm cache, and what `ds4 demo` printed when it first ran there."""
    env = {**os.environ, "DS4TVM_CACHE": str(tmp_path_factory.mktemp("embedded-cache"))}
    return env, run_ds4("demo", timeout=900, env=env)


@pytest.mark.slow
@pytest.mark.compile
def test_demo_completes_python_and_its_dspark_output_is_target_only(cache):
    from ds4tvm.demo import PROMPT

    _, r = cache
    assert r.returncode == 0, r.stderr
    assert "first use of the embedded model" in r.stderr
    assert "is identical to target-only decoding" in r.stdout, r.stdout
    code = r.stdout.split("-" * 72)[1]
    assert code.strip("\n").startswith(PROMPT) and len(code.splitlines()) > len(PROMPT.splitlines()) + 2, code
    # what the trained drafter achieves: below the 100% a drafter built to copy the target gets
    rate = float(re.search(r"accept_rate=([0-9.]+)%", r.stderr).group(1))
    per_cycle = float(re.search(r"avg_accept=([0-9.]+)", r.stderr).group(1))
    assert 0 < rate < 100 and per_cycle > 1.0, r.stderr


@pytest.mark.slow
@pytest.mark.compile
def test_run_without_a_model_uses_the_embedded_pair(cache):
    env, first = cache
    assert first.returncode == 0, first.stderr
    plain = run_ds4("run", "-p", "def add(a, b):", "-n", "32", "--temp", "0", "--json", env=env)
    assert plain.returncode == 0, plain.stderr
    assert "using the embedded demo model" in plain.stderr and "first use" not in plain.stderr
    out = json.loads(plain.stdout)
    assert out["n_generated"] > 0 and out["text"].strip()
    spec = run_ds4("run", "-p", "def add(a, b):", "-n", "32", "--temp", "0", "--json", "--dspark", env=env)
    assert spec.returncode == 0, spec.stderr
    assert json.loads(spec.stdout)["tokens"] == out["tokens"]


@pytest.mark.slow
@pytest.mark.compile
def test_serve_without_a_model_answers_the_openai_client(cache):
    from openai import OpenAI

    from serving import ServerProcess

    env, first = cache
    assert first.returncode == 0, first.stderr
    server = ServerProcess("--dspark", "--alias", "demo", env=env)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        r = client.completions.create(model="demo", prompt="import os\n\n\ndef ", max_tokens=16, temperature=0)
        assert r.choices[0].text.strip() and r.usage.completion_tokens > 0
    finally:
        log = server.stop()
    assert "using the embedded demo model" in log and "DSpark speculative decoding" in log
