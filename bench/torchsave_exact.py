"""`python -m bench.torchsave_exact FILE [--runs 5]`: read, commit and checkout time of one torch.save file.

Run it with PYTHONPATH set to each of two source trees to compare them: it prints the minimum and
median of read_checkpoint (CPU seconds, the torch-free read), of a commit into a fresh repository
and of a checkout -o (wall seconds), and whether the file came back byte for byte.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401 - loaded before timing, as in a training process

from ckptstore import Repository, formats


def _times(run, count: int, clock=time.perf_counter) -> str:
    taken = []
    for _ in range(count):
        start = clock()
        run()
        taken.append(clock() - start)
    return f"min {min(taken):.4f} median {statistics.median(taken):.4f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    source = args.file.resolve()
    formats.read_checkpoint(source)  # warm the page cache
    print(f"{source} ({source.stat().st_size / 1e6:.1f} MB), ckptstore from {formats.__file__}")
    print("read_checkpoint (cpu):", _times(lambda: formats.read_checkpoint(source), 10 * args.runs, time.process_time))
    with tempfile.TemporaryDirectory() as scratch:
        repos = iter(range(args.runs))

        def commit() -> None:
            with Repository.init(Path(scratch) / f"r{next(repos)}") as repo:
                repo.commit(source)

        print("commit (fresh repository):", _times(commit, args.runs))
        with Repository.open(Path(scratch) / "r0") as repo:
            cid = repo.resolve("HEAD")
            out = Path(scratch) / "out.pt"
            print("checkout -o:", _times(lambda: repo.checkout_to(cid, out), args.runs))
            print("byte for byte:", out.read_bytes() == source.read_bytes())


if __name__ == "__main__":
    main()
