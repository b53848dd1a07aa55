"""Qwen3.8's n-gram table is never loaded whole: the tiny model written twice, once with its table
as it is and once padded to 2 GiB (the padding a hole in the file, so nothing is written there),
gives the same logits bit for bit, and `ds4 logits` on the large file peaks within 300 MB of the
small file's run (a loader that read or bound the table would add 2 GiB)."""

import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.compile, pytest.mark.slow]
BIG_ROWS = 1 << 27                  # x 8 F16 values = 2 GiB


def _peak_logits(art, ids, out):
    """(logits, peak RSS in MB) of `ds4 logits` in a process of its own (GNU time's %M)."""
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "ds4tvm.cli", "logits", "-m", str(art), "--tokens",
           ",".join(map(str, ids)), "--mode", "prefill", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return np.load(out), int(r.stderr.strip().splitlines()[-1]) / 1024


def test_a_2_gib_sparse_table_adds_nothing_resident(tmp_path):
    if shutil.which("/usr/bin/time") is None:
        pytest.skip("GNU time is absent")
    from conftest import run_ds4_compile

    from ds4tvm.families.qwen4exp.ple import TABLE
    from ds4tvm.families.qwen4exp.random_model import tiny_config, write_random_qwen4exp
    from ds4tvm.gguf import open_gguf
    from ds4tvm.gguf.writer import SparseData, TensorOut

    small = write_random_qwen4exp(tmp_path / "small.gguf", tiny_config(), seed=1)
    head = np.asarray(open_gguf(small).tensors[TABLE].data)

    def padded(tensors):
        return [TensorOut(t.name, t.qtype, (BIG_ROWS, t.shape[1]), lambda: SparseData(head, BIG_ROWS * head.nbytes // len(head)))
                if t.name == TABLE else t for t in tensors]

    big = write_random_qwen4exp(tmp_path / "big.gguf", tiny_config(ple_table_rows=BIG_ROWS), seed=1, edit_specs=padded)
    assert big.stat().st_size > 2 ** 31 and big.stat().st_blocks * 512 < 2 ** 28   # mostly a hole
    ids = np.random.default_rng(0).integers(0, 512, 200)
    ids[[3, 50, 51, 120]] = 7                                                    # EOS
    runs = {}
    for name, gguf in (("small", small), ("big", big)):
        art = tmp_path / f"art-{name}"
        r = run_ds4_compile(gguf, "--target", "llvm", "-o", art, "--max-context", "256", "--quiet")
        assert r.returncode == 0, r.stderr
        runs[name] = _peak_logits(art, ids, tmp_path / f"{name}.npy")
    (small_logits, small_mb), (big_logits, big_mb) = runs["small"], runs["big"]
    print(f"peak RSS: small table {small_mb:.0f} MB, 2 GiB table {big_mb:.0f} MB")
    assert np.array_equal(small_logits, big_logits)
    assert big_mb <= small_mb + 300
