import json
import subprocess
import sys

import pytest

from conftest import run_ds4


def test_import_and_help_do_not_import_tvm():
    code = ("import sys, ds4tvm, ds4tvm.cli, ds4tvm.gguf, ds4tvm.families; "
            "from typer.testing import CliRunner; r = CliRunner().invoke(ds4tvm.cli.app, ['--help']); "
            "assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_lists_the_commands():
    r = run_ds4("--help")
    assert r.returncode == 0
    for cmd in ("inspect", "tokenize", "detokenize", "convert", "demo"):
        assert cmd in r.stdout


@pytest.mark.compile
def test_demo_generates_with_dspark(tmp_path):
    """The README's main job: the embedded pair is built, compiled, and decodes with DSpark."""
    import re
    import time

    t = time.time()
    r = run_ds4("demo", "--dir", tmp_path, timeout=600)
    first = time.time() - t
    assert r.returncode == 0, r.stderr
    assert "identical to target-only decoding" in r.stdout
    rate = float(re.search(r"accept_rate=([0-9.]+)%", r.stderr).group(1))
    assert rate > 80.0, r.stderr
    model = tmp_path / "ds4-demo-tiny-deepseek4.gguf"
    info = json.loads(run_ds4("inspect", model, "--json").stdout)
    assert info["quant_types"]["Q8_0"] > 0 and info["n_layers"] == 5
    t = time.time()
    again = run_ds4("demo", "--dir", tmp_path)
    assert again.returncode == 0 and "identical to target-only decoding" in again.stdout
    print(f"demo: first run {first:.1f} s, second {time.time() - t:.1f} s")
    assert first < 180 and time.time() - t < 30


def test_usage_errors_exit_2():
    r = run_ds4("inspect")
    assert r.returncode == 2
    r = run_ds4("no-such-command")
    assert r.returncode == 2
