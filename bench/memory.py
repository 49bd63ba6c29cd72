"""What a block of this process uses: its peak anonymous memory (RssAnon, sampled by a thread), its CPU time.

Anonymous memory is what a method allocates; file pages it maps (a checkpoint read with mmap) are
page cache the kernel can drop, so they are not counted.
"""

from __future__ import annotations

import resource
import threading
import time


def cpu_seconds() -> float:
    """User and system CPU time of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_anon() -> int:
    """Bytes of anonymous resident memory of this process (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """`with PeakMemory() as peak: ...` then `peak.extra` is the peak above the starting level."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.extra = 0

    def __enter__(self) -> PeakMemory:
        self.start = self.peak = rss_anon()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_anon())
        self.extra = self.peak - self.start
