"""runtime/threads.py: the CPU pool shrinks to one thread while other processes keep this
process's cores busy, and grows back when they stop."""

from __future__ import annotations

import os

import pytest

from ds4tvm.runtime import threads


class _Clock:
    """Core seconds of every process and of this one, advanced by hand."""

    def __init__(self):
        self.now = self.busy = self.ours = 0.0

    def advance(self, seconds: float, others: float, ours: float) -> None:
        self.now += seconds
        self.busy += (others + ours) * seconds
        self.ours += ours * seconds


@pytest.fixture
def watch(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(threads.time, "process_time", lambda: clock.ours)
    monkeypatch.setattr(threads._CoreWatch, "_core_seconds", lambda self: clock.busy)
    w = threads._CoreWatch([0, 1], 2, lambda mode, n: calls.append(n))
    return w, clock, calls


def test_a_busy_core_shrinks_the_pool_and_a_quiet_one_grows_it_back(watch):
    w, clock, calls = watch
    clock.advance(1.0, others=0.0, ours=2.0)
    w.step()
    assert calls == [] and w.active == 2
    clock.advance(0.5, others=1.0, ours=0.1)       # a busy loop on one of our cores
    w.step()
    assert calls == [1] and w.active == 1
    clock.advance(0.5, others=1.0, ours=1.0)
    w.step()
    assert calls == [1]                            # still busy: no reconfiguration
    clock.advance(0.5, others=0.0, ours=1.0)
    w.step()
    assert calls == [1, 2] and w.active == 2


def test_looks_are_spaced_and_small_loads_are_tolerated(watch):
    w, clock, calls = watch
    clock.advance(threads.INTERVAL, others=0.2, ours=2.0)
    w.step()
    assert calls == []                             # 0.2 of a core: a shell, a log writer
    clock.advance(threads.INTERVAL / 2, others=2.0, ours=0.0)
    w.step()
    assert calls == []                             # too soon after the last look
    clock.advance(threads.INTERVAL / 2, others=2.0, ours=0.0)
    w.step()
    assert calls == [1]


def test_spare_cores_absorb_other_processes(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(threads.time, "process_time", lambda: clock.ours)
    monkeypatch.setattr(threads._CoreWatch, "_core_seconds", lambda self: clock.busy)
    w = threads._CoreWatch([0, 1, 2, 3], 2, lambda mode, n: calls.append(n))
    clock.advance(1.0, others=1.5, ours=2.0)       # two cores left free for them
    w.step()
    assert calls == []
    clock.advance(1.0, others=2.5, ours=2.0)
    w.step()
    assert calls == [1]


def test_proc_stat_is_read_for_this_process_cores(monkeypatch):
    """The busy ticks of this process's cores only (user, nice, system, irq, softirq, steal; not
    idle or iowait), from a /proc/stat given here, so the reading does not depend on what else the
    machine runs; and the real file parses."""
    import io

    stat = ("cpu  9 9 9 9 9 9 9 9 0 0\n"
            "cpu0 100 1 20 5000 7 3 2 1 0 0\n"
            "cpu1 200 0 40 9000 0 0 0 0 0 0\n"
            "cpu2 999 999 999 0 0 999 999 999 0 0\n"
            "intr 5 5 5\n")
    monkeypatch.setattr(threads, "open", lambda path: io.StringIO(stat), raising=False)
    w = threads._CoreWatch([0, 1], 2, lambda mode, n: None)
    assert w._core_seconds() == pytest.approx((100 + 1 + 20 + 3 + 2 + 1 + 200 + 40) / w.hz)
    monkeypatch.undo()
    if os.path.exists("/proc/stat"):
        assert threads._CoreWatch(sorted(os.sched_getaffinity(0)), 2, lambda mode, n: None)._core_seconds() > 0


@pytest.mark.parametrize("files,cores,want", [
    ({"v2": "200000 100000"}, 8, 2),          # a container of 2 CPUs on an 8-core host
    ({"v2": "150000 100000"}, 8, 2),          # 1.5 CPUs: a second thread still has half a core
    ({"v2": "max 100000"}, 8, 8),             # unlimited
    ({"v1": ("400000", "100000")}, 2, 2),     # more quota than cores
    ({"v1": ("-1", "100000")}, 6, 6),
    ({}, 3, 3),                               # no cgroup files at all
    ({"v2": "abc 100000"}, 4, 4),             # unreadable: as if unlimited
])
def test_default_threads_respect_the_cgroup_quota(tmp_path, monkeypatch, files, cores, want):
    v2, q1, p1 = tmp_path / "cpu.max", tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    if "v2" in files:
        v2.write_text(files["v2"] + "\n")
    if "v1" in files:
        q1.write_text(files["v1"][0] + "\n")
        p1.write_text(files["v1"][1] + "\n")
    monkeypatch.setattr(threads, "CGROUP_QUOTAS", ((str(v2), None), (str(q1), str(p1))))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert threads.default_threads() == want


@pytest.mark.parametrize("value", ["1", "abc", ""])
def test_one_thread_or_an_unreadable_count_is_never_watched(monkeypatch, value):
    monkeypatch.setenv("TVM_NUM_THREADS", value)
    assert threads._CoreWatch.start() is False
