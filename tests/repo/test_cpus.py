"""The CPUs a process may use, and timings that leave out its threads' waits for them."""

import os

import pytest

from ckptstore.repo import cpus


def test_the_measurement_leaves_out_the_waits_for_a_cpu(monkeypatch):
    """The first auto commit runs inside a training job: timed by the wall clock, its threads' wait for the CPUs
    read as a checkout no faster on two threads than one, and that repository kept keyframes only, for good."""
    import time

    assert cpus.waited_for_cpu() is not None  # Linux: the kernel's figure
    assert 0.25 < cpus.timer(lambda: time.sleep(0.3))() < 1  # a wait of the call's own counts
    ready = iter([5.0, 5.25])  # the kernel says the thread waited 0.25 s for a CPU meanwhile
    monkeypatch.setattr(cpus, "waited_for_cpu", lambda thread=None: next(ready))
    assert 0.04 < cpus.timer(lambda: time.sleep(0.3))() < 0.3
    monkeypatch.setattr(cpus, "waited_for_cpu", lambda thread=None: None)  # elsewhere: the wall clock, as Crew's
    assert 0.25 < cpus.timer(lambda: time.sleep(0.3))() < 1


def test_a_crew_runs_one_call_per_thread_and_leaves_out_their_waits_for_a_cpu(monkeypatch):
    """A pool's idle thread took a second restore while the other waited for a CPU: two threads read as one
    (reviewer 404). Each thread runs the call once per timing; a thread's wait since its wake-up is taken off;
    where the threads waited for CPUs while calling, each call counts its CPU time (reviewer 407)."""
    import threading
    import time

    threads = []
    with cpus.Crew(3, lambda: (threads.append(threading.get_ident()), time.sleep(0.1))) as crew:
        crew.timed()
        assert len(set(threads)) == 3 and len(threads) == 3
        monkeypatch.setattr(cpus, "waited_for_cpu", lambda thread=None: 0.0)  # no waits: the wall clock
        assert 0.09 < crew.timed() < 1 and len(threads) == 6
        # each thread waited 0.08 s for a CPU before it ran: 0 when handed the call, 0.08 from then on
        monkeypatch.setattr(cpus, "waited_for_cpu", lambda thread=None: 0.0 if thread else 0.08)
        assert 0.01 < crew.timed() < 0.08
        readings = threading.local()

        def waits_while_calling(thread=None):  # 0 handed the call, 0 going, 10 ms by the end: another process's load
            if thread:
                return 0.0
            readings.n = getattr(readings, "n", -1) + 1
            return [0.0, 0.0, 0.01][readings.n % 3]

        monkeypatch.setattr(cpus, "waited_for_cpu", waits_while_calling)
        quiet_runs = crew.quiet_runs
        assert crew.timed() < 0.05  # each call's CPU time: a sleep takes none
        assert crew.quiet_runs == quiet_runs  # and no quiet timing: measure() keeps no figures from it


def test_a_crew_thread_that_cannot_start_or_a_failing_call_raises_without_hanging(monkeypatch):
    """The pool's threads that started waited at a barrier for one that could not, and the pool's shutdown for
    them: the commit hung for good (reviewer 402)."""
    import threading

    real_start, started = threading.Thread.start, []

    def start(thread):
        started.append(thread)
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with cpus.Crew(2, lambda: None) as crew, pytest.raises(RuntimeError, match="can't start new thread"):
        crew.timed()
    monkeypatch.undo()
    assert not started[0].is_alive()  # joined as the crew closed: no thread waits at the barrier
    with cpus.Crew(2, lambda: 1 / 0) as crew, pytest.raises(ZeroDivisionError):
        crew.timed()


@pytest.mark.parametrize(("v2", "v1", "expected"), [
    ("150000 100000\n", None, 2), ("50000 100000", None, 1), ("max 100000", None, None), ("damaged", None, None),
    ("1 0", None, None), (None, ("250000", "100000"), 3), (None, ("-1", "100000"), None)])
def test_checkouts_speedup_is_capped_by_the_cpus_a_container_may_use(tmp_path, monkeypatch, v2, v1, expected):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu.cfs_period_us").write_text(v1[1])
    monkeypatch.setattr(cpus, "CGROUP_CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(cpus, "CGROUP_V1_CPU", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpus.usable_cpus() == (expected or 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert cpus.usable_cpus() == 1
