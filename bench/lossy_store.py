"""Commit a run's checkpoints at a lossy level and restore them one by one: what the lossy benchmarks share.

bench/lossy_sweep.py (tuning one run) and bench/zoo.py (every run, both halves) measure the same thing:
each checkpoint committed with `repo.commit(path, lossy=level)` into a fresh repository, then each
restored to a file with `checkout_to` and loaded back by the workload as a user would. Both compare the
restored checkpoints' eval loss, and a resume from one of them, with the same from the original files.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.units import metadata_on_disk
from bench.workloads import State, Workload
from ckptstore import Repository


@dataclass
class Timings:
    """Seconds spent committing, checking out into memory, and checking out to a file."""

    encode_s: float = 0.0
    decode_s: float = 0.0
    to_file_s: float = 0.0


@dataclass
class LossyStore:
    """A run's checkpoints committed at one level into a scratch repository."""

    repo: Repository
    work: Path
    files: list[Path]
    commits: list = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)

    @property
    def stored_bytes(self) -> int:
        """The commits' objects and the repository's database (before 6 December 2026: the objects alone)."""
        return sum(self.repo.commit_info(c).stored_bytes for c in self.commits) + metadata_on_disk(self.repo)

    def restored(self, decode: bool = False) -> Iterator[tuple[int, Path]]:
        """Each commit written back to a file (deleted once the caller moves on); `decode` also times a
        checkout into memory first, as the speed figures need."""
        for index, cid in enumerate(self.commits):
            if decode:
                start = time.perf_counter()
                self.repo.checkout(cid)
                self.timings.decode_s += time.perf_counter() - start
            dest = self.work / f"restored{self.files[index].suffix}"
            start = time.perf_counter()
            self.repo.checkout_to(cid, dest, force=True)
            self.timings.to_file_s += time.perf_counter() - start
            try:
                yield index, dest
            finally:
                shutil.rmtree(dest, ignore_errors=True) if dest.is_dir() else dest.unlink(missing_ok=True)


@contextmanager
def lossy_store(workload: Workload, files: list[Path], level: str, knobs: dict | None = None,
                calibrate: bool = False) -> Iterator[LossyStore]:
    """Commit every file at `level` into a fresh repository in a scratch folder (removed afterwards).

    `calibrate` passes the live model at each checkpoint and a fixed calibration batch's loss, so the
    level can measure sensitivity. An unknown level fails here, with ckptstore's own error.
    """
    work = Path(tempfile.mkdtemp(prefix="ckpt-lossy-"))
    try:
        with Repository.init(work / "repo") as repo:
            store = LossyStore(repo, work, files)
            start = time.perf_counter()
            for path in files:
                steer = {}
                if calibrate:
                    steer = {"model": workload.load(path).model, "calibration": workload.calibration()}
                store.commits.append(repo.commit(path, lossy=level, **steer, **(knobs or {})))
            store.timings.encode_s = time.perf_counter() - start
            yield store
    finally:
        shutil.rmtree(work, ignore_errors=True)


def resumed_loss(workload: Workload, state: State, steps: int) -> float:
    """Eval loss after training `steps` more steps from `state` (which it changes)."""
    workload.train_steps(state, steps)
    return workload.eval_loss(state.model)


def change_pct(value: float, reference: float) -> float:
    return (value - reference) / reference * 100


def original_losses(workload: Workload, files: list[Path], resume_index: int, steps: int) -> tuple[list[float], float]:
    """The original files' eval losses, and the eval loss after resuming from files[resume_index]."""
    losses = [workload.eval_loss(workload.load(f).model) for f in files]
    return losses, resumed_loss(workload, workload.load(files[resume_index]), steps)
