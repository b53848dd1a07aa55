import subprocess
import sys

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


def test_usage_errors_exit_2():
    r = run_ds4("inspect")
    assert r.returncode == 2
    r = run_ds4("no-such-command")
    assert r.returncode == 2
