"""`ds4-compile --tune TRIALS`: meta-schedule tuning of the static-shape quantized linears (the
decode kernels: one token, every distinct shape x format that the TE schedules in llvm.py cover;
the linears kernels/cpu.py takes are hand-written and not tuned) on the machine compiling.

Each kernel is tuned from scratch for TRIALS candidates, then the best candidate and the hand
schedule are measured side by side with meta-schedule's own builder and runner; only a candidate
that wins is recorded (so applying the database never makes a kernel slower than the hand
schedule, and a later change to a hand schedule is never masked by an old copy of it). Every
kernel's numbers go to report.json beside the database. Records go to a meta-schedule JSON
database, by default ds4tvm/schedules/tuned/<target name>/ (shipped with the package); compiling
for that target applies them before the hand schedules (llvm.pipeline).
Records match kernels by structural hash, so they apply to any model with the same kernel shapes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import tvm
from tvm import s_tir, tirx

from ..kernels.tags import EXPERT_MATMUL, ROW_MATMUL
from .llvm import hand_schedule, legalize_passes

TUNED = Path(__file__).parent / "tuned"
WORKLOADS = "database_workload.json"
REPORT = "report.json"


def records_dir(target_name: str) -> Path:
    return TUNED / target_name


def has_records(path: Path) -> bool:
    f = Path(path) / WORKLOADS
    return f.is_file() and f.stat().st_size > 0


def _legalized(mod: tvm.IRModule, target) -> tvm.IRModule:
    with target:
        return tvm.transform.Sequential(legalize_passes())(mod)


def _static(func: tirx.PrimFunc) -> bool:
    from tvm.tirx.buffer import is_buffer_var

    return all(is_buffer_var(p) and all(isinstance(d, tirx.IntImm) for d in p.shape) for p in func.params)


def _is_linear(func: tirx.PrimFunc) -> bool:
    sch = s_tir.Schedule(func)
    for name in (ROW_MATMUL, EXPERT_MATMUL):
        try:
            sch.get_sblock(name)
            return True
        except Exception:  # noqa: BLE001 - no such block
            pass
    return False


def tunable_kernels(mod: tvm.IRModule, target) -> list[tuple[str, tirx.PrimFunc]]:
    """(name, kernel) of the distinct static-shape TE linears, as the pipeline sees them."""
    import tvm_ffi

    seen, out = set(), []
    for gv, func in _legalized(mod, target).functions_items():
        if isinstance(func, tirx.PrimFunc) and _static(func) and _is_linear(func):
            h = tvm_ffi.structural_hash(func)
            if h not in seen:
                seen.add(h)
                out.append((gv.name_hint, func))
    return out


def _arguments(device, args_info, alloc_repeat):
    """Random kernel arguments ([kind, dtype, shape] each), with int32 tensors (expert ids) all zero so every index is valid."""
    import numpy as np

    rng = np.random.default_rng(0)

    def one(dtype, shape):
        if dtype == "int32":
            return np.zeros(shape, np.int32)
        if dtype.startswith(("int", "uint")):
            return rng.integers(0, 100, shape).astype(dtype)
        return rng.uniform(-1, 1, shape).astype(dtype)

    return [[tvm.runtime.tensor(one(dtype, [int(d) for d in shape]), device) for _, dtype, shape in args_info]
            for _ in range(alloc_repeat)]


def _measure(ms, mods: list, target, args_info, builder, runner) -> list[float]:
    """Mean seconds of each module, built and run by meta-schedule (inf when it fails)."""
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    out = []
    for b in built:
        if b.error_msg is not None:
            out.append(float("inf"))
            continue
        (fut,) = runner.run([ms.runner.RunnerInput(b.artifact_path, "cpu", args_info)])
        r = fut.result()
        out.append(float("inf") if r.error_msg else sum(map(float, r.run_secs)) / len(r.run_secs))
    return out


def tune(mod: tvm.IRModule, target, out_dir: Path, trials: int, progress: bool = False) -> list[dict]:
    """Tunes the module's static linears; records the candidates that beat the hand schedule in the
    database in out_dir, and every kernel's numbers in its report. Returns those lines."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    threads = int(target.attrs.get("num-cores", 1))
    kernels = tunable_kernels(mod, target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(out_dir))
    builder = ms.builder.LocalBuilder(timeout_sec=300)
    runner = ms.runner.LocalRunner(timeout_sec=60, f_alloc_argument=_arguments)
    bar = _Bar(len(kernels), progress)
    report = []
    try:
        for name, func in kernels:
            bar.describe(name)
            kmod = _normalize_mod(func)
            args_info = ms.arg_info.ArgInfo.from_prim_func(kmod["main"])
            hand = hand_schedule(kmod["main"], threads) or s_tir.Schedule(kmod)
            line = {"kernel": name, "kernel_hash": str(tvm_ffi.structural_hash(kmod["main"])), "trials": trials}
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    tdb = ms.tune_tir(kmod, target, tmp, max_trials_global=trials,
                                      num_trials_per_iter=min(trials, 8), builder=builder, runner=runner,
                                      cost_model="random", seed=0)
                    best = tdb.query_schedule(kmod, target, "main")
            except Exception as e:  # noqa: BLE001 - a search-space rule failed on this kernel: keep the hand schedule
                best, line["why"] = None, f"meta-schedule failed: {str(e).strip().splitlines()[-1][:200]}"
            t_hand, *t_best = _measure(ms, [hand.mod] + ([best.mod] if best else []), target, args_info, builder,
                                       runner)
            t_tuned = t_best[0] if t_best else float("inf")
            if best is None:
                line.setdefault("why", "no candidate built and ran")
            else:
                line["tuned_us"] = round(t_tuned * 1e6, 2)
            line["hand_us"] = round(t_hand * 1e6, 2)
            line["schedule"] = "tuned" if t_tuned < t_hand else "hand"
            if t_tuned < t_hand:   # only winners are recorded: without a record the hand schedule applies
                db.commit_tuning_record(ms.database.TuningRecord(best.trace, db.commit_workload(kmod), [t_tuned],
                                                                 target, args_info))
            report.append(line)
            bar.advance()
    finally:
        bar.close()
    _write_report(out_dir, report)
    return report


def _write_report(out_dir: Path, lines: list[dict]) -> None:
    """REPORT: the latest measurement of every kernel tuned into this database, winners or not."""
    path = out_dir / REPORT
    old = {x["kernel_hash"]: x for x in json.loads(path.read_text())} if path.is_file() else {}
    old.update({x["kernel_hash"]: x for x in lines})
    path.write_text(json.dumps(list(old.values()), indent=1) + "\n")
    if not has_records(out_dir):   # no winner yet: no empty database files either
        for name in (WORKLOADS, "database_tuning_record.json"):
            (out_dir / name).unlink(missing_ok=True)


class _Bar:
    """A rich progress bar over the kernels (on stderr), or nothing."""

    def __init__(self, total: int, enabled: bool):
        self.p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.p = Progress(TextColumn("ds4-compile --tune"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True))
            self.p.start()
            self.task = self.p.add_task("", total=total)

    def describe(self, text: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=text)

    def advance(self) -> None:
        if self.p is not None:
            self.p.update(self.task, advance=1)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
