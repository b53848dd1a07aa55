"""The CPU thread pool's size while the engine runs: every core while the cores are ours, one thread
while another process keeps one of them busy.

TVM's pool workers wait for the next kernel by spinning (sched_yield) for
TVM_THREAD_POOL_SPIN_COUNT rounds before they sleep. Spinning saves waking a worker for each of a
decode step's ~100 parallel kernels: q2 decode on this 2-core machine 115 -> 161-168 tok/s with
100-1000 rounds against none. A round is one sched_yield (~0.18 us on a 2-core KVM guest), so
1000 rounds let a worker sleep after ~0.2 ms without a parallel kernel: a batched step's
per-sequence kernels (one core each) ran that long, and the server's gap between rounds too, and
each wake of a sleeping worker (a halted vCPU) cost the next parallel kernel ~40 us; 10000 rounds
(~2 ms): `ds4 serve` under 4 clients 1.10x tok/s, 8 clients 1.08x (BENCHMARKS.md). But beside a
busy process any spinning collapses a 2-thread pool (2.3 tok/s: a worker that spun away its share
of the busy core waits a whole scheduler slice before each kernel can finish; every count tried
from 10 to 30000, BENCHMARKS.md). So the engine spins, and `adapt()`, called before each
compiled function runs, watches the cores this process may use (/proc/stat, at most every INTERVAL
seconds): when other processes used more than the cores the pool leaves free (plus BUSY_MARGIN of
one), the pool shrinks to one thread (runtime.config_threadpool, which TVM applies to the calling
thread's pool at its next kernel); when they stop, it grows back.
One thread beside a busy core keeps its quiet pace."""

from __future__ import annotations

import math
import os
import threading
import time

SPIN_COUNT = "10000"   # TVM_THREAD_POOL_SPIN_COUNT the engine sets unless the environment does
INTERVAL = 0.25       # seconds between looks at /proc/stat
BUSY_MARGIN = 0.3     # cores of other processes' work tolerated beyond the cores the pool leaves free
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user, nice, system, irq, softirq, steal of a /proc/stat cpu line

_local = threading.local()
CGROUP_QUOTAS = (("/sys/fs/cgroup/cpu.max", None),   # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
                 ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))   # v1


def default_threads() -> int:
    """Every core this process may run on, but no more than its CPU quota (a container limited to
    2 CPUs of a 64-core host would otherwise start 64 workers that spin through its quota)."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpus()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_cpus() -> float | None:
    """The CPUs' worth of time this process's cgroup may use, None when unlimited or unknown."""
    for quota_file, period_file in CGROUP_QUOTAS:
        try:
            with open(quota_file) as f:
                fields = f.read().split()
            if period_file is not None:
                with open(period_file) as f:
                    fields.append(f.read().strip())
            if fields[0] in ("max", "-1"):
                return None
            quota, period = float(fields[0]), float(fields[1])
        except (OSError, IndexError, ValueError):
            continue
        return quota / period if period > 0 else None
    return None


def adapt() -> None:
    """Sizes the calling thread's CPU pool for the load on its cores (cheap between looks)."""
    watch = getattr(_local, "watch", None)
    if watch is None:
        watch = _local.watch = _CoreWatch.start()
    if watch:
        watch.step()


class _CoreWatch:
    def __init__(self, cores: list[int], threads: int, configure):
        self.cores, self.threads, self.configure = cores, threads, configure
        self.hz = os.sysconf("SC_CLK_TCK")
        self.active = threads
        self.at, self.busy, self.ours = time.monotonic(), self._core_seconds(), time.process_time()

    @classmethod
    def start(cls) -> _CoreWatch | bool:
        """A watch for this thread's pool, or False where there is nothing to adapt (one thread,
        no /proc/stat)."""
        try:
            threads = int(os.environ.get("TVM_NUM_THREADS", "1"))
        except ValueError:   # TVM makes of it what it does; nothing to adapt here
            return False
        if threads < 2 or not os.path.exists("/proc/stat"):
            return False
        import tvm

        return cls(sorted(os.sched_getaffinity(0)), threads, tvm.get_global_func("runtime.config_threadpool"))

    def _core_seconds(self) -> float:
        """CPU seconds spent busy on this process's cores since boot, by every process."""
        total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *ticks = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cores:
                    total += sum(int(ticks[i]) for i in _BUSY_FIELDS if i < len(ticks))
        return total / self.hz

    def step(self) -> None:
        now = time.monotonic()
        if now - self.at < INTERVAL:
            return
        busy, ours = self._core_seconds(), time.process_time()
        others = ((busy - self.busy) - (ours - self.ours)) / (now - self.at)   # cores' worth
        self.at, self.busy, self.ours = now, busy, ours
        free = len(self.cores) - self.threads
        want = 1 if others > free + BUSY_MARGIN else self.threads
        if want != self.active:
            self.configure(1, want)   # 1: TVM's kBig affinity mode, the one its pool starts in
            self.active = want
