"""An artifact whose files changed after the compile: a swapped library is refused before it is
loaded, an index tensor out of range or a manifest's vocabulary larger than the model's is refused
before the first call (it used to reach a kernel: a segfault), a malformed manifest or tokenizer is
one line, and `ds4 verify` hashes everything in full. Each case: exit 2, one line, naming the file."""

import json
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import run_ds4
from ds4tvm.artifact import MODEL, file_fingerprint, file_identity

pytestmark = pytest.mark.compile


def _copy(art, tmp_path, **manifest_changes):
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    raw.update(manifest_changes)
    (copy / "manifest.json").write_text(json.dumps(raw))
    return copy, raw


def _refused(art, *needles):
    r = run_ds4("run", "-m", art, "--tokens", "5,6,7", "-n", 2, "--temp", 0)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count("\n") == 1, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    return r.stderr


def test_a_swapped_library_is_refused_before_it_is_loaded(tiny_artifact, tmp_path):
    copy, raw = _copy(tiny_artifact, tmp_path)
    lib = copy / raw["library"]
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 1
    lib.write_bytes(bytes(data))
    _refused(copy, str(lib), "sha256")


def _damaged_index(tiny_artifact, tmp_path, value):
    """The model GGUF with one tid2eid entry set to value, and a copy of the artifact pointing at it
    (as if the fingerprint, which reads the first and last 8 MiB of a file, had not seen the change)."""
    raw = json.loads((tiny_artifact / "manifest.json").read_text())
    src = raw["weights"][MODEL]["gguf_path"]
    gguf = tmp_path / "damaged.gguf"
    shutil.copyfile(src, gguf)
    t = next(t for t in GGUFReader(gguf).tensors if t.name.endswith("ffn_gate_tid2eid.weight"))
    with open(gguf, "r+b") as f:
        f.seek(t.data_offset + t.data.nbytes // 2)
        f.write(np.int32(value).tobytes())
    return _copy(tiny_artifact, tmp_path, weights={**raw["weights"], MODEL: file_identity(gguf)})[0], t.name


@pytest.mark.parametrize("value", [1 << 20, -3])
def test_an_index_tensor_out_of_range_is_refused_at_load(tiny_artifact, tmp_path, value):
    art, name = _damaged_index(tiny_artifact, tmp_path, value)
    _refused(art, "damaged.gguf", name, f"holds {value}")


def test_a_manifest_vocabulary_larger_than_the_model_is_refused(tiny_artifact, tmp_path):
    copy, _ = _copy(tiny_artifact, tmp_path, n_vocab=10 ** 6)
    r = run_ds4("run", "-m", copy, "--tokens", "900000", "-n", 2, "--temp", 0)
    assert r.returncode == 2 and "the artifact's manifest says 1000000" in r.stderr, r.stderr


@pytest.mark.parametrize("change", [
    {"functions": "x"}, {"bounds": {"max_context": "a"}}, {"states": [{"name": 1}]}, {"params": [[1]]},
    {"library": "../lib.so"}, {"n_vocab": -1}])
def test_a_malformed_manifest_is_one_line(tiny_artifact, tmp_path, change):
    copy, _ = _copy(tiny_artifact, tmp_path, **change)
    _refused(copy, "manifest", "malformed")


def test_a_malformed_tokenizer_is_one_line(tiny_artifact, tmp_path):
    copy, raw = _copy(tiny_artifact, tmp_path)
    (copy / raw["tokenizer"]).write_text("[" * 100000)
    _refused(copy, raw["tokenizer"])


def test_verify_hashes_the_weights_in_full(tiny_artifact, tmp_path):
    r = run_ds4("verify", tiny_artifact)
    assert r.returncode == 0 and "every file matches" in r.stdout, r.stderr
    # a byte changed in the middle of a file larger than the fingerprint's spans: made here by giving
    # the manifest the damaged file's fingerprint beside the original sha256
    raw = json.loads((tiny_artifact / "manifest.json").read_text())
    src = raw["weights"][MODEL]["gguf_path"]
    gguf = tmp_path / "flipped.gguf"
    data = bytearray(open(src, "rb").read())
    data[len(data) // 2] ^= 0x10
    gguf.write_bytes(bytes(data))
    ident = {**raw["weights"][MODEL], "gguf_path": str(gguf), "gguf_fingerprint": file_fingerprint(gguf)}
    copy, _ = _copy(tiny_artifact, tmp_path, weights={**raw["weights"], MODEL: ident})
    r = run_ds4("verify", copy, "--quiet")
    assert r.returncode == 2 and "flipped.gguf: does not match the sha256" in r.stderr, r.stderr


def test_two_first_uses_of_one_gguf_compile_it_once(tmp_path):
    """Started together, one compiles (into a temporary directory of its own, renamed when complete)
    while the other waits for its artifact, and both run; `ds4 list` then shows it, `ds4 rm` removes
    it."""
    import os
    import subprocess
    import sys

    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4

    # two window layers: what is tested is the cache, not the model (18 s to compile against 32 s)
    model = write_random_deepseek4(tmp_path / "m.gguf", tiny_config(n_layers=2, compress_ratios=(0,)), seed=8)
    env = {**os.environ, "DS4TVM_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "ds4tvm.cli", "run", "-m", str(model), "--tokens", "5,6,7", "-n", "3", "--temp", "0",
           "--ctx", "256"]   # not --json, which keeps stderr quiet
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    assert outs[0][0] == outs[1][0] != ""
    compiled = sorted("ds4: first use of m.gguf: compiled it for cpu" in err for _, err in outs)
    waited = sorted("ds4: another process is compiling m.gguf for cpu: waiting for its artifact" in err
                    for _, err in outs)
    assert compiled == waited == [False, True], [err[-600:] for _, err in outs]
    cached = [p.name for p in (tmp_path / "cache").rglob("*.tmp")]
    assert cached == [], cached   # no temporary directory left behind
    # ds4 list shows the one artifact made; ds4 rm removes it and nothing else
    listed = json.loads(run_ds4("list", "--json", env=env).stdout)
    assert [(e["kind"], e["source"], e["family"]) for e in listed] == [("artifact", str(model), "deepseek4")]
    r = run_ds4("rm", "nope", env=env)
    assert r.returncode == 2 and "no artifact or package with this key" in r.stderr
    r = run_ds4("rm", listed[0]["key"], env=env)
    assert r.returncode == 0 and json.loads(run_ds4("list", "--json", env=env).stdout) == [] and model.exists()
