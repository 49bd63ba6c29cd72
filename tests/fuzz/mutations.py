"""Hypothesis strategies that damage valid bytes the ways storage and bugs do, and the fuzzers' budget.

Truncations, bit flips, replaced bytes, length fields set huge (or to a neighbour of the real
value), bytes cut out or inserted, a span copied over another (overlapping ranges), junk appended.
The golden fixtures (tests/fixtures) are the valid inputs they start from.
"""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

# Inputs per decoder: a bounded number in the default run, 100,000 in the long mode.
LONG = os.environ.get("CKPT_HYPOTHESIS_PROFILE") == "long"
EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES") or (100_000 if LONG else 25))
# A decode slower than this (seconds) counts as a hang; generous, since ASan builds run 3-10x slower.
HANG_SECONDS = float(os.environ.get("CKPT_FUZZ_HANG_S", "5"))
# Memory the Python and numpy allocations of one decode may take beyond 32x the output's size.
ALLOC_SLACK = 64 << 20

# Values a damaged length or count field most likely takes: zero, one, a bit too big, the limits.
HUGE = (0, 1, 2, 255, 256, 1 << 15, (1 << 16) - 1, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40,
        (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def _apply(data: bytes, op: tuple) -> bytes:
    kind, *args = op
    size = len(data)
    if kind == "truncate":
        return data[: args[0] % (size + 1)]
    if kind == "append":
        return data + args[0]
    if not size:
        return args[-1] if kind == "insert" else data
    at = args[0] % size
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (1 << args[1])]) + data[at + 1 :]
    if kind == "byte":
        return data[:at] + bytes([args[1]]) + data[at + 1 :]
    if kind == "word":
        fmt, value = args[1], args[2]
        width = struct.calcsize(fmt)
        value = (value + (size if args[3] else 0)) % (1 << (8 * width))
        return (data[:at] + struct.pack(fmt.upper(), value) + data[at + width :])[: max(size, at + width)]
    if kind == "cut":
        return data[:at] + data[at + args[1] :]
    if kind == "insert":
        return data[:at] + args[1] + data[at:]
    if kind == "overlap":  # a span copied over another place: overlapping or shifted ranges
        src = args[1] % size
        return data[:at] + data[src : src + args[2]] + data[at + args[2] :]
    raise ValueError(f"unknown damage {kind!r}")


OPS = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("byte"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("word"), st.integers(0, 1 << 20), st.sampled_from(["<H", "<I", "<Q", "<i", "<q"]),
              st.sampled_from(HUGE) | st.integers(0, (1 << 64) - 1), st.booleans()),
    st.tuples(st.just("cut"), st.integers(0, 1 << 20), st.integers(1, 64)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("overlap"), st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.integers(1, 256)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=32)),
)
# Header bytes are where lengths and counts live: aim a third of the damage at the first 64.
HEAD_OPS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 63), st.integers(0, 7)),
    st.tuples(st.just("word"), st.integers(0, 63), st.sampled_from(["<H", "<I", "<Q", "<i", "<q"]),
              st.sampled_from(HUGE), st.booleans()),
)
DAMAGE = st.lists(st.one_of(OPS, OPS, HEAD_OPS), min_size=1, max_size=3)


def damage(data: bytes, ops: list[tuple]) -> bytes:
    """`data` with every op of `ops` applied in order (the result may equal `data`)."""
    for op in ops:
        data = _apply(data, op)
    return data


@contextmanager
def watched(what: str, out_bytes: int = 0):
    """Fail when the block takes longer than HANG_SECONDS or allocates (Python and numpy) far beyond its output.

    Tracing is on only inside the block: traced, hypothesis's own input generation ran 2-3x slower.
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] - before
        if started:
            tracemalloc.stop()
    assert took < HANG_SECONDS, f"{what}: took {took:.1f} s (a hang?)"
    assert peak < ALLOC_SLACK + 32 * out_bytes, f"{what}: allocated {peak} bytes for a {out_bytes}-byte result"


class Tally:
    """Counts each fuzzer's inputs by outcome; written as JSON lines to CKPT_FUZZ_REPORT when set."""

    def __init__(self, name: str) -> None:
        self.name, self.counts = name, {}

    def add(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def write(self) -> None:
        target = os.environ.get("CKPT_FUZZ_REPORT")
        if target:
            with Path(target).open("a") as handle:
                handle.write(json.dumps({"fuzzer": self.name, "inputs": sum(self.counts.values()),
                                         **self.counts}) + "\n")


def run_tallied(name: str, body: Callable[[Tally], Any]) -> Tally:
    """Run `body` with a tally it fills; the tally is written whatever happens."""
    tally = Tally(name)
    try:
        body(tally)
    finally:
        tally.write()
    return tally
