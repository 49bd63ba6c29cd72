"""Peak anonymous memory (RssAnon) of this process while a block runs, sampled by a thread.

Anonymous memory is what a method allocates; file pages it maps (a checkpoint read with mmap) are
page cache the kernel can drop, so they are not counted.
"""

from __future__ import annotations

import threading
import time


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
