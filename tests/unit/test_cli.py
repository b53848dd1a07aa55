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


def test_shapes_only_names_its_output_after_the_family(monkeypatch, tmp_path):
    """`ds4-compile --shapes-only --family F` without -o writes F-shapes-<target> (the compile
    itself is replaced: tests/targets and the real-size runs in BENCHMARKS.md do it whole)."""
    import ds4tvm.compile.driver as driver
    from ds4tvm.cli import compile_app

    written = []
    monkeypatch.setattr(driver, "compile_shapes", lambda family, out, req: written.append(out) or {})
    monkeypatch.chdir(tmp_path)
    for family in ("deepseek4", "glm5next", "qwen4exp"):
        compile_app(["--shapes-only", "--family", family, "--target", "llvm", "--quiet"], standalone_mode=False)
    assert [str(p) for p in written] == ["deepseek4-shapes-llvm", "glm5next-shapes-llvm", "qwen4exp-shapes-llvm"]
