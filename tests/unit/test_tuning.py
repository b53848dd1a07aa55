"""Tuning records: a record saved to a database is applied at compile time (the kernel it matches
changes, the hand schedule skips it), kernels without a record keep the hand schedule, and the
shipped records for this machine's target match the benchmark model's kernels."""

import json

import pytest
from conftest import run_ds4_compile

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def tiny_module(tmp_path_factory):
    import tvm

    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import _export
    from ds4tvm.compile.targets import resolve
    from ds4tvm.families import BuildRequest, tensor_types
    from ds4tvm.families.deepseek4.build import build
    from ds4tvm.families.deepseek4.random_model import tiny_config, write_random_deepseek4
    from ds4tvm.gguf import open_gguf

    path = write_random_deepseek4(tmp_path_factory.mktemp("tune") / "tiny.gguf", tiny_config(), seed=3)
    f = open_gguf(path)
    spec = resolve("llvm")
    model = build(BuildRequest(tiny_config(), tensor_types(f), Bounds(512, 8, 256), forms=spec.forms())).module
    mod, _ = _export(model)
    return mod, tvm.target.Target(spec.tvm), path


def _scheduled(mod, target, records):
    from ds4tvm.schedules.llvm import pipeline

    return pipeline(target, records)(mod)


def test_a_saved_record_changes_the_compiled_kernel_and_others_keep_the_hand_schedule(tiny_module, tmp_path):
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    from ds4tvm.kernels.tags import ROW_PARTIAL
    from ds4tvm.schedules.llvm import hand_schedule
    from ds4tvm.schedules.tuning import has_records, tunable_kernels

    mod, target, _ = tiny_module
    kernels = dict(tunable_kernels(mod, target))
    # decode-shaped (static) TE linears: the HC mixes and a linear whose shape the CPU kernels do
    # not take (every other linear is hand-written, so not tunable)
    linears = sorted(n for n in kernels if n.startswith("qlinear"))
    assert linears and "hc_mix1" in kernels, sorted(kernels)
    name = linears[0]
    kmod = _normalize_mod(kernels[name])
    sch = hand_schedule(kmod["main"], 1) or s_tir.Schedule(kmod)
    sch.annotate(sch.get_sblock(ROW_PARTIAL), "ds4.from_record", 1)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(kmod), [1e-6], target,
                                                     ms.arg_info.ArgInfo.from_prim_func(kmod["main"])))
    assert has_records(tmp_path)

    plain = _scheduled(mod, target, None)
    tuned = _scheduled(mod, target, str(tmp_path))
    assert "ds4.from_record" not in plain[name].script()
    assert "ds4.from_record" in tuned[name].script() and tuned[name].attrs["tirx.is_scheduled"]
    # every other kernel is exactly what the hand schedule makes
    for other in sorted(set(kernels) - {name}):
        assert "ds4.from_record" not in tuned[other].script()
        assert tuned[other].script() == plain[other].script()


def test_tune_refuses_gpu_targets_with_one_line(tiny_module):
    r = run_ds4_compile(tiny_module[2], "--target", "cuda:sm_90", "--tune", "4")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--tune" in r.stderr, r.stderr


@pytest.mark.slow   # compiles the benchmark model; the saved-record test covers applying records
def test_shipped_tuning_covers_the_benchmark_models_kernels():
    """ds4tvm/schedules/tuned/<target>/report.json records a `ds4-compile --tune` run on the 127M
    benchmark model (benchmarks/model50m.py) on this project's machine. Every tunable kernel of that
    model must appear in it (a changed kernel means the tuning must be run again), and every
    shipped record must match one of the kernels (else it would silently go unused)."""
    import sys
    from pathlib import Path

    import tvm
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    from ds4tvm.artifact import Bounds
    from ds4tvm.compile.driver import _export
    from ds4tvm.compile.targets import resolve
    from ds4tvm.families import BuildRequest
    from ds4tvm.families.deepseek4.build import build
    from ds4tvm.families.deepseek4.tensors import tensor_specs
    from ds4tvm.schedules.tuning import REPORT, TUNED, has_records, tunable_kernels

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from model50m import config, type_of

    reports = sorted(TUNED.glob(f"*/{REPORT}"))
    assert reports, "no tuning report shipped"
    # the model the shipped report was tuned on: expert width 384, what model50m.py wrote before
    # 2026-12-01 (its width-512 variants change the one-token expert kernels: tune again to move)
    cfg = config(n_ff_exp=384)
    spec = resolve("llvm")
    model = build(BuildRequest(cfg, {s.name: type_of(s, "q8_0") for s in tensor_specs(cfg)}, Bounds(),
                               forms=spec.forms())).module
    mod, _ = _export(model)
    have = {str(tvm_ffi.structural_hash(_normalize_mod(f)["main"])): name
            for name, f in tunable_kernels(mod, tvm.target.Target(spec.tvm))}
    assert have
    for report in reports:
        lines = json.loads(report.read_text())
        assert set(have) <= {x["kernel_hash"] for x in lines}, report
        assert all("hand_us" in x and x["schedule"] in ("hand", "tuned") for x in lines), report
        if has_records(report.parent):
            d = ms.database.JSONDatabase(work_dir=str(report.parent))
            for rec in d.get_all_tuning_records():
                assert str(tvm_ffi.structural_hash(rec.workload.mod["main"])) in have, report
