"""Model packages: build (two targets) -> checksums -> `ds4 run -m PKG`, as a directory and as a
.tar; corrupted or foreign packages are refused with one line."""

import hashlib
import json
import shutil

import pytest
from conftest import always_drafting, compile_here, run_ds4, run_ds4_compile

from random_demo import PROMPT

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def package(demo_pair, tmp_path_factory):
    """The demo pair packaged for two targets: the demo artifact (compiled for this CPU) and one for
    generic llvm, bundled as `ds4-compile --package` bundles what it compiles (its command line with
    two targets: test_compile_package_command_line, -m slow)."""
    from ds4tvm.package import build_package

    model, support, art, _ = demo_pair
    d = tmp_path_factory.mktemp("pkg")
    compile_here(model, "--mtp", support, "--target", "llvm", "-o", d / "llvm", "--max-context", "512",
                 "--max-verify", "8", "--quiet")
    return build_package([art, d / "llvm"], d / "demo.pkg")


@pytest.mark.slow   # two compiles; the package fixture bundles the demo artifact and one compile
def test_compile_package_command_line(demo_pair, tmp_path):
    model, support, art, _ = demo_pair
    out = tmp_path / "demo.pkg"
    r = run_ds4_compile(model, "--mtp", support, "--target", "cpu", "--target", "llvm", "--package", out,
                        "--max-context", "512", "--max-verify", "8", "--quiet")
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "package.json").read_text())
    here = json.loads((art / "manifest.json").read_text())["target_name"]
    assert sorted(t["name"] for t in meta["targets"]) == sorted(["llvm", here])
    assert _run_json(out, "--dspark")["tokens"] == _run_json(art, "--dspark")["tokens"]


def _run_json(model, *extra):
    r = run_ds4("run", "-m", model, "-p", PROMPT, "-n", 40, "--temp", 0, "--json", *extra, env=always_drafting())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_package_lists_every_file_with_its_sha256(package, demo_pair):
    meta = json.loads((package / "package.json").read_text())
    on_disk = sorted(p.relative_to(package).as_posix() for p in package.rglob("*")
                     if p.is_file() and p.name != "package.json")
    assert sorted(meta["files"]) == on_disk
    for rel, want in meta["files"].items():
        data = (package / rel).read_bytes()
        assert len(data) == want["size"] and hashlib.sha256(data).hexdigest() == want["sha256"], rel
    model, support = demo_pair[0], demo_pair[1]
    assert (package / meta["weights"]["model"]).read_bytes() == model.read_bytes()
    assert (package / meta["weights"]["support"]).read_bytes() == support.read_bytes()
    assert {t["name"] for t in meta["targets"]} >= {"llvm"} and len(meta["targets"]) == 2


def test_run_from_directory_and_tar_package_equals_the_artifact(package, demo_pair, tmp_path):
    from ds4tvm.package import build_package

    want = _run_json(demo_pair[2], "--dspark")   # the demo artifact: compiled for this CPU, as the package's pick
    got = _run_json(package, "--dspark")
    assert got["tokens"] == want["tokens"] and got["spec"]["accepted_draft"] > 0
    meta = json.loads((package / "package.json").read_text())
    tar = build_package([package / t["dir"] for t in meta["targets"]], tmp_path / "demo.tar")
    assert _run_json(tar, "--dspark")["tokens"] == want["tokens"]
    assert _run_json(tar)["tokens"] == want["tokens"]   # target-only from the same package


@pytest.mark.parametrize("victim", ["library", "tokenizer", "weights", "package.json"])
def test_modified_package_is_refused_with_one_line(package, tmp_path, victim):
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    meta = json.loads((copy / "package.json").read_text())
    target = next(t for t in meta["targets"] if t.get("mcpu"))
    rel = {"library": f"{target['dir']}/lib-{target['name']}.so", "tokenizer": f"{target['dir']}/tokenizer.json",
           "weights": meta["weights"]["model"], "package.json": "package.json"}[victim]
    data = bytearray((copy / rel).read_bytes())
    data[len(data) // 2] ^= 0x01 if victim != "package.json" else 0
    if victim == "package.json":
        meta["name"] = "renamed"
        data = json.dumps(meta).encode()
    (copy / rel).write_bytes(bytes(data))
    r = run_ds4("run", "-m", copy, "-p", "hi", "-n", 2)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and (rel in lines[0] or "content_sha256" in lines[0]), lines


def test_a_library_rewritten_in_place_is_refused_after_it_was_verified(package, tmp_path):
    """Verified once, then overwritten in place with its size and mtime restored: its ctime changed
    (which no one can set back), so it is hashed again and refused before it is loaded."""
    import os

    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    assert run_ds4("run", "-m", copy, "-p", "hi", "-n", 1).returncode == 0   # stamps every file as verified
    meta = json.loads((copy / "package.json").read_text())
    target = next(t for t in meta["targets"] if t.get("mcpu"))
    lib = copy / target["dir"] / f"lib-{target['name']}.so"
    st = lib.stat()
    with open(lib, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert lib.stat().st_mtime_ns == st.st_mtime_ns and lib.stat().st_ino == st.st_ino
    r = run_ds4("run", "-m", copy, "-p", "hi", "-n", 1)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and lib.name in r.stderr, r.stderr


def test_a_package_must_list_its_library(package, tmp_path):
    from ds4tvm.package import content_hash

    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    meta = json.loads((copy / "package.json").read_text())
    target = meta["targets"][0]
    rel = f"{target['dir']}/lib-{target['name']}.so"
    del meta["files"][rel]
    meta["content_sha256"] = content_hash(meta)
    (copy / "package.json").write_text(json.dumps(meta))
    r = run_ds4("run", "-m", copy, "-p", "hi", "-n", 1)
    assert r.returncode == 2 and f"does not list {rel}" in r.stderr, r.stderr


def test_verify_hashes_a_package_in_full(package):
    r = run_ds4("verify", package, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "every file matches" in r.stdout


def test_package_without_a_target_for_this_machine_names_its_targets(package, tmp_path):
    from ds4tvm.package import content_hash

    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    meta = json.loads((copy / "package.json").read_text())
    for t in meta["targets"]:
        t["machine"] = "riscv64"
    meta["content_sha256"] = content_hash(meta)
    (copy / "package.json").write_text(json.dumps(meta))
    r = run_ds4("run", "-m", copy, "-p", "hi", "-n", 2)
    assert r.returncode == 2
    assert "no target for this machine" in r.stderr and "llvm (cpu, riscv64)" in r.stderr, r.stderr


def test_lean_load_uses_tvm_runtime_alone_and_gives_the_same_logits(package, demo_pair, tmp_path):
    """open_engine(lean=True), as the CLI calls it, loads only TVM's runtime library (no compiler,
    no PyTorch) and still picks the package's target for this CPU; the logits equal those of a
    process that imported the whole of TVM."""
    import subprocess
    import sys

    import numpy as np

    snippet = ("import sys, numpy as np; from ds4tvm.runtime.loader import open_engine; "
               "e = open_engine(sys.argv[1], lean=sys.argv[2] == '1'); "
               "np.save(sys.argv[3], e.prefill([5, 6, 7, 8, 9], all_logits=True).logits); import tvm; "
               "print(tvm.base._RUNTIME_ONLY, 'tvm_compiler' in tvm.base._LOADED_LIBS, "
               "sys.modules.get('torch') is not None, e.dir.name)")
    out = {}
    for lean in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", snippet, str(package), lean, str(tmp_path / f"{lean}.npy")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out[lean] = r.stdout.split()
    assert out["1"][:3] == ["True", "False", "False"]
    assert out["0"][:2] == ["False", "True"]
    assert out["1"][3] == out["0"][3]           # the same target chosen (the host CPU's)
    np.testing.assert_array_equal(np.load(tmp_path / "1.npy"), np.load(tmp_path / "0.npy"))
