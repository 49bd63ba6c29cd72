"""The CPUs this process may use, and timings that leave out its threads' waits for them.

`max_chain = "auto"` keeps what it measures for good (repo/chaincost.py), and its first measurement
usually runs inside a training job: timed by the wall clock, the job's own threads made a checkout
read as no faster on two threads than one. The kernel counts each thread's wait for a CPU
(`/proc/<pid>/task/<tid>/schedstat`); a timing less that wait is what the work costs on this machine.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2's "QUOTA PERIOD" (or "max PERIOD") for this container
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, and a cgroup's CPU quota (a container's `--cpus`).

    Threads go no faster than these allow, whatever the machine has: a timing that leaves out the
    waits for a CPU does not see them.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, cpus if quota is None else min(cpus, math.ceil(quota)))


def _cgroup_quota() -> float | None:
    """The CPUs a cgroup's quota allows (v2's cpu.max, else v1's cfs quota), None where none is set or readable."""
    try:
        quota, period = Path(CGROUP_CPU_MAX).read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota, period = (int(Path(CGROUP_V1_CPU, name).read_text()) for name in ("cpu.cfs_quota_us",
                                                                                  "cpu.cfs_period_us"))
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def waited_for_cpu(thread: int | None = None) -> float | None:
    """Seconds a thread of this process (this one by default) has waited for a CPU, ready to run; None if unknown."""
    try:
        with open("/proc/thread-self/schedstat" if thread is None else f"/proc/self/task/{thread}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def timer(call: Callable[[], object]) -> Callable[[], float]:
    """A function that runs `call` once and returns the seconds it took, less those its thread waited for a CPU.

    A wait of the call's own (a lock, a page's mapping) still counts. Without the kernel's figure (not
    Linux), the wall clock, as Crew times there: one clock for both (reviewer 411).
    """
    def run() -> float:
        start, waited = time.perf_counter(), waited_for_cpu()
        call()
        if waited is None:
            return time.perf_counter() - start
        # the kernel's figure before the clock, as the clock before it above: a wait between the two readings
        # counts in the call's time (a few ms more), never out of it (a time slice less: once, below zero)
        waited_meanwhile = (waited_for_cpu() or waited) - waited
        return time.perf_counter() - start - waited_meanwhile
    return run


class Crew:
    """`count` pool threads that each run `call` once per `timed()`, timed together less their waits for a CPU.

    As a checkout's pool goes: from handing the calls out to the last one's end, the hand-out (a
    pool's queue, its futures, the GIL: a checkout pays it per chunk) counted, each thread's waits
    for a CPU left out. The calls start together, one per thread: an idle pool thread took a second
    call while another waited for a CPU, and two threads read as one (reviewer 404).
    """

    def __init__(self, count: int, call: Callable[[], object]) -> None:
        self._count, self._call = count, call
        self._pool = ThreadPoolExecutor(count, "ckpt-timing")
        self._threads: set[int] = set()  # native ids, for their waits before a hand-out
        self.quiet_runs = 0  # timings in which no thread waited for a CPU while calling (or nothing tells)
        self.best_quiet = math.inf  # the least of those

    def __enter__(self) -> Crew:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()

    def timed(self) -> float:
        """Seconds from handing the calls out to the last one's end, less the threads' waits for a CPU.

        Where a thread waited for a CPU while calling (another process's load), each call's time is its CPU
        time: a thread that waits for the GIL or a page lock its preempted holder keeps sleeps, not
        waits for a CPU, and two threads read as one again beside a training job (reviewer 407).
        """
        meet = threading.Barrier(self._count, timeout=BARRIER_SECONDS)
        before = {tid: waited_for_cpu(tid) for tid in self._threads}  # a woken thread's wait counts as it runs
        start = time.perf_counter()

        def one(_: int) -> _Run:
            begun, waited_begun = time.perf_counter(), waited_for_cpu()
            meet.wait()
            going, waited_going, cpu = time.perf_counter(), waited_for_cpu(), time.thread_time()
            self._call()
            cpu, waited_end = time.thread_time() - cpu, waited_for_cpu()  # the kernel's figure before the clock
            return _Run(threading.get_native_id(), begun, waited_begun, going, waited_going, time.perf_counter(),
                        waited_end, cpu)

        try:
            runs = list(self._pool.map(one, range(self._count)))
        except BaseException:  # a thread that could not start (a pids limit), a failed call, Ctrl-C: none waits on
            meet.abort()
            raise
        if any(run.waited_begun is None or run.waited_going is None or run.waited_end is None for run in runs):
            return self._counted(max(run.end for run in runs) - start, False)  # not Linux: the wall clock, load and all
        loaded = any(run.waited_end - run.waited_going > LOADED * (run.end - run.going) for run in runs)
        spans = []
        for run in runs:
            self._threads.add(run.thread)
            since = before.get(run.thread)
            handed_out = run.begun - start - (run.waited_begun - since if since is not None else 0.0)
            call = run.cpu if loaded else run.end - run.going - (run.waited_end - run.waited_going)
            spans.append(handed_out + call)  # the wait at the barrier left out
        return self._counted(max(spans), loaded)

    def _counted(self, seconds: float, loaded: bool) -> float:
        if not loaded:
            self.quiet_runs += 1
            self.best_quiet = min(self.best_quiet, seconds)
        return seconds


@dataclass
class _Run:
    """One thread's call in Crew.timed: clocks and its waits for a CPU (seconds) when handed it, going, done."""

    thread: int
    begun: float
    waited_begun: float | None
    going: float
    waited_going: float | None
    end: float
    waited_end: float | None
    cpu: float


LOADED = 0.05  # a call whose thread waited for a CPU this share of its time or more ran beside another's load
BARRIER_SECONDS = 60  # a thread that never comes breaks the others' wait instead of hanging the commit
