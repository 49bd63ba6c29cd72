"""The processes of tests/repo/test_shared_concurrency.py: `python -m tests.repo.shared_workers ROLE REPO ...`.

Each regenerates the state of (writer, index) from its seed, so any process can check any commit.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ckptstore import Repository
from ckptstore.errors import ConflictError
from ckptstore.repo import gc


def state(writer: int, index: int) -> dict:
    g = torch.Generator().manual_seed(writer * 1000 + index)
    return {"w": torch.randn(20_000, generator=g), "b": torch.randn(64, generator=g), "step": index}


def writer(repo_path: str, number: str, commits: str) -> None:
    """Commit `commits` states to branch job<number>."""
    with Repository.open(repo_path) as repo:
        for index in range(int(commits)):
            repo.commit(state(int(number), index), message=f"{number} {index}", branch=f"job{number}")


def reader(repo_path: str) -> None:
    """Check out the newest commits of every branch as they come, 40 in all; prints how many it checked."""
    from tests.conftest import assert_same

    checked = 0
    with Repository.open(repo_path) as repo:
        deadline = time.monotonic() + 600
        while checked < 40 and time.monotonic() < deadline:
            for info in repo.log(all_refs=True)[:3]:
                number, index = map(int, info.message.split())
                assert_same(state(number, index), repo.checkout(info.id))
                checked += 1
    print(json.dumps({"checked": checked}))


def collector(repo_path: str, total: str) -> None:
    """gc until `total` commits exist; prints how many gc runs ended while commits were still coming."""
    during = 0
    with Repository.open(repo_path) as repo:
        deadline = time.monotonic() + 600
        while len(repo.log(all_refs=True)) < int(total) and time.monotonic() < deadline:
            gc(repo)
            during += len(repo.log(all_refs=True)) < int(total)
            time.sleep(0.2)
    print(during)


def one_commit(repo_path: str, number: str) -> None:
    """One commit to branch `same`: prints its id, or `conflict` and why."""
    with Repository.open(repo_path) as repo:
        try:
            print(repo.commit(state(int(number), 0), message=number, branch="same"))
        except ConflictError as exc:
            print("conflict", exc)


def main() -> None:
    role, *args = sys.argv[1:]
    {"writer": writer, "reader": reader, "collector": collector, "one-commit": one_commit}[role](*args)


if __name__ == "__main__":
    main()
