import json
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


def test_demo_builds_and_inspects_the_embedded_model(tmp_path):
    r = run_ds4("demo", "--dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "deepseek4 (target): 5 layers" in r.stdout
    model = next(tmp_path.glob("*.gguf"))
    info = json.loads(run_ds4("inspect", model, "--json").stdout)
    assert info["quant_types"]["Q8_0"] > 0 and info["n_layers"] == 5
    # The demo model is fixed by its seed: a second build gives the same bytes.
    again = tmp_path / "again"
    assert run_ds4("demo", "--dir", again).returncode == 0
    assert next(again.glob("*.gguf")).read_bytes() == model.read_bytes()


def test_usage_errors_exit_2():
    r = run_ds4("inspect")
    assert r.returncode == 2
    r = run_ds4("no-such-command")
    assert r.returncode == 2
