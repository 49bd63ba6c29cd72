"""repo/warm.py: repositories reopened at a root kept warm share one plane cache and one thread pool."""

import subprocess
import sys
import time

import torch

from ckptstore import Repository
from ckptstore.repo import keep_warm
from ckptstore.repo.planecache import cache_of
from ckptstore.repo.warm import settle


def test_reopened_repositories_share_threads_and_planes_only_where_kept_warm(tmp_path):
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    for root in (warm, cold):
        Repository.init(root).close()
    keep_warm(warm.resolve())
    torch.save({"w": torch.randn(256, 256)}, tmp_path / "a.pt")
    with Repository.open(warm) as first:
        first.commit(tmp_path / "a.pt")
        pool, cache = first.pool, cache_of(first)
    assert cache.held_bytes > 0  # the commit's planes, left for the next one
    torch.save({"w": torch.randn(256, 256)}, tmp_path / "a.pt")
    with Repository.open(warm) as second:
        assert second.pool is pool and cache_of(second) is cache
        second.commit(tmp_path / "a.pt")  # on the threads the first repository's close left running
        assert len(second.log()) == 2
    with Repository.open(cold) as third:
        own = third.pool
        assert own is not pool and cache_of(third) is not cache
    assert own._shutdown  # a repository that is not kept warm stops its threads on close
    assert not pool._shutdown


def test_settle_returns_only_when_every_task_on_the_shared_threads_is_done(tmp_path):
    Repository.init(tmp_path).close()
    keep_warm(tmp_path.resolve())
    finished = []
    with Repository.open(tmp_path) as repo:
        for delay in (0.3, 0.0, 0.2):  # more tasks than threads, the longest first
            repo.pool.submit(lambda d=delay: (time.sleep(d), finished.append(d)))
    settle(tmp_path.resolve())
    assert sorted(finished) == [0.0, 0.2, 0.3]


def test_a_changed_thread_count_replaces_the_warm_pool_and_the_count_is_bounded(tmp_path):
    """Each [core] threads value ever set kept a pool in the daemon, and settle started all of every pool's
    threads: 300, then 500 threads after an edit to 200; any count was taken (auditor)."""
    import pytest

    from ckptstore.errors import CkptError
    from ckptstore.repo.config import RepoConfig
    from ckptstore.repo.warm import shared_pool

    Repository.init(tmp_path).close()
    keep_warm(tmp_path.resolve())
    first = shared_pool(tmp_path.resolve(), 3)
    assert shared_pool(tmp_path.resolve(), 3) is first
    second = shared_pool(tmp_path.resolve(), 5)
    assert second is not first and not first._shutdown  # a repository may still be using it (third reader)
    settle(tmp_path.resolve())  # between commands: the pool of the old count goes
    assert first._shutdown and not second._shutdown
    settle(tmp_path.resolve())  # the one pool left
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace("threads = 0", "threads = 100000"))
    with pytest.raises(CkptError, match=r"threads must be a count up to 1024 \(0: one per CPU\), not 100000"):
        RepoConfig.load(config)


def test_a_repository_whose_warm_pool_of_an_old_thread_count_went_takes_the_new_one(tmp_path):
    """Replaced at once, the old pool failed the next commit of a repository still holding it: "cannot schedule
    new futures after shutdown" (third reader)."""
    Repository.init(tmp_path).close()
    keep_warm(tmp_path.resolve())
    with Repository.open(tmp_path) as first:
        first.commit({"w": torch.ones(3)})
        config = tmp_path / ".ckpt" / "config.toml"
        config.write_text(config.read_text().replace("threads = 0", "threads = 3"))
        with Repository.open(tmp_path) as second:
            second.commit({"w": torch.zeros(3)})
        settle(tmp_path.resolve())
        first.commit({"w": torch.full((3,), 2.0)})  # on the pool it now finds
        assert len(first.log()) == 3


def test_keep_warm_loads_every_module_of_ckptstore_a_commit_runs(tmp_path):
    """The daemon warms up so that its first command pays no imports: a commit after it loads none of ours,
    lossless or lossy, of a file or a folder."""
    code = f"""
import sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from ckptstore import Repository
from ckptstore.repo import keep_warm
root = Path({str(tmp_path)!r}).resolve()
Repository.init(root).close()
keep_warm(root)
model = torch.nn.Linear(16, 8)
optimizer = torch.optim.AdamW(model.parameters())
for name in ("a.pt", "b.pt"):
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    torch.save({{"model": model.state_dict(), "optimizer": optimizer.state_dict()}}, root / name)
(root / "run").mkdir()
save_file({{"w": torch.ones(4)}}, str(root / "run" / "b.safetensors"))
(root / "run" / "trainer_state.json").write_text('{{"global_step": 1}}')
before = {{m for m in sys.modules if m.startswith("ckptstore")}}
with Repository.open(root) as repo:
    repo.commit(root / "a.pt", message="a")
    repo.commit(root / "b.pt", message="b, lossy", lossy="balanced")
    repo.commit(root / "run", message="a folder")
print(" ".join(sorted({{m for m in sys.modules if m.startswith("ckptstore")}} - before)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == []
