"""Decode lanes: a CPU batched decode split into independent calls, one per lane, each lane a
thread with its own VirtualMachine and its own share of the cores.

Why: one batched call on the whole pool joins its threads at the end of every parallel kernel
(200-odd per step), so a thread that loses its core for a moment (the server's HTTP side, the
clients, the system) holds the other back at each join, and the pool's other thread idles through
the kernels that run per sequence on one core. Lanes never join each other: each runs its
sequences' kernels start to finish on its own threads. Each lane reads the weights again, which
pays on the 2-core machines measured here (BENCHMARKS.md, "Decode lanes"): a batch of 8 of the
benchmark model in 0.87 of one call's time alone and 0.83 beside a process using a seventh of a
core; of 4, 0.88 and 0.79; of 2, 1.17 (slower: the lanes need MIN_SEQUENCES). A token's logits do
not depend on the rows beside it nor on the pool's size (every kernel keeps each row's sums on one
thread), so a lane gives what one call gives, bit for bit (tests/runtime/test_batching.py).
"""

from __future__ import annotations

import os
import threading

from ..errors import Ds4Error
from . import threads

MIN_SEQUENCES = 4   # a batch split into lanes from this many sequences (2: 1.17x one call's time)
ENV = "DS4TVM_DECODE_LANES"   # lanes of a CPU engine whose pool has 2 threads or more (1: off)


def lanes_for(engine) -> DecodeLanes | None:
    """The lanes the scheduler splits engine's batched decodes into: on the CPU, with a pool of 2
    threads or more and batched functions of MIN_SEQUENCES, 2 lanes (measured on 2 cores only) or
    ENV's count, each with an equal share of the pool's threads; None where a decode call is not
    split."""
    pool = os.environ.get("TVM_NUM_THREADS", "")   # what the engine gave TVM's pool
    pool = int(pool) if pool.isdigit() else 1
    value = os.environ.get(ENV)
    try:
        count = int(value) if value is not None else (2 if pool >= 2 else 1)
    except ValueError:
        raise Ds4Error(f"{ENV}={value!r}: a whole number of lanes is expected (1: off)") from None
    if count < 2 or engine.dev.dlpack_device_type() != 1 or engine.max_batch < MIN_SEQUENCES:
        return None
    return DecodeLanes(engine, count, max(1, pool // count))


class DecodeLanes:
    """`count` lanes over an engine's sequences. run(items, fn) gives each lane a contiguous part of
    items (sizes differing by one at most) and runs fn(view, part) on every lane at once, view being
    that lane's engine (Engine.lane_view); it returns fn's results when all have finished (fn's
    errors raised then). Lane threads start at the first run and end with close()."""

    def __init__(self, engine, count: int, threads_per_lane: int):
        self.count, self.min_sequences = count, MIN_SEQUENCES
        self._engine, self._threads = engine, threads_per_lane
        self._lanes: list[_Lane] = []
        self.runs = 0   # calls split so far

    def takes(self, n: int) -> bool:
        """A call of n sequences is split (and the calling thread's pool is at its full size: where
        another process keeps a core busy, runtime/threads.py shrinks it and one call does better)."""
        return self.count > 1 and n >= self.min_sequences and not threads.shrunk()

    def run(self, items: list, fn) -> list:
        if not self._lanes:
            self._lanes = [_Lane(self._engine.lane_view(), self._threads) for _ in range(self.count)]
        self.runs += 1
        bounds = [len(items) * i // self.count for i in range(self.count + 1)]
        for lane, a, b in zip(self._lanes, bounds, bounds[1:]):
            lane.submit(fn, items[a:b])
        results = [lane.wait() for lane in self._lanes]
        for _, e in results:
            if e is not None:
                raise e
        return [r for r, _ in results]

    def close(self) -> None:
        for lane in self._lanes:
            lane.submit(None, None)
        self._lanes = []


class _Lane:
    """A thread that runs what it is given on its engine view, its TVM pool sized to `threads`
    (TVM keeps one pool per calling thread)."""

    def __init__(self, view, threads: int):
        self.view, self.threads = view, threads
        self._work, self._done = threading.Semaphore(0), threading.Semaphore(0)
        self._job, self._out = None, (None, None)
        threading.Thread(target=self._run, name="ds4-decode-lane", daemon=True).start()

    def submit(self, fn, part) -> None:
        self._job = (fn, part)
        self._work.release()

    def wait(self) -> tuple:
        """(fn's result, None) or (None, what it raised)."""
        self._done.acquire()
        return self._out

    def _run(self) -> None:
        import tvm

        tvm.get_global_func("runtime.config_threadpool")(1, self.threads)   # 1: kBig, the pool's default mode
        while True:
            self._work.acquire()
            fn, part = self._job
            if fn is None:
                return
            try:
                self._out = (fn(self.view, part), None)
            except BaseException as e:   # the caller raises it
                self._out = (None, e)
            self._done.release()
