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
def test_demo_generates_with_dspark(demo_pair):
    """The README's main job: the embedded pair (built and compiled by conftest.demo_pair with the
    demo's own code; .ci/run also runs `ds4 demo` from nothing) decodes with DSpark, from the CLI."""
    import re

    r = run_ds4("demo", "--dir", demo_pair[0].parent, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "identical to target-only decoding" in r.stdout and "first run" not in r.stderr
    rate = float(re.search(r"accept_rate=([0-9.]+)%", r.stderr).group(1))
    assert rate > 80.0, r.stderr
    info = json.loads(run_ds4("inspect", demo_pair[0], "--json").stdout)
    assert info["quant_types"]["Q8_0"] > 0 and info["n_layers"] == 5


def test_usage_errors_exit_2():
    r = run_ds4("inspect")
    assert r.returncode == 2
    r = run_ds4("no-such-command")
    assert r.returncode == 2
