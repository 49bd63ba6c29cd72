"""The module-level API (ckptstore/api.py): values as torch.save takes them, and in a torch.distributed job."""

import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import ckptstore
from ckptstore import Repository


def _save_on(rank: int, root: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            ckptstore.save({"w": torch.ones(4)}, repo=Path(root) / "repo", step=1)
        else:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                dist.barrier()  # rank 0's commit first: this one's would race it
                try:
                    ckptstore.save({"w": torch.ones(4)}, repo=Path(root) / "repo", step=1)
                except ckptstore.errors.CkptError:  # "nothing changed": the commit rank 0 made
                    pass
            (Path(root) / "rank1.txt").write_text("\n".join(str(w.message) for w in said))
        if rank == 0:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_save_off_rank_zero_of_a_distributed_job_is_warned_of(tmp_path):
    """`ckptstore.save` on every rank raced for the branch: one rank's commit failed, or each committed, and the
    docs never said rank 0 only (DDP integrations auditor)."""
    Repository.init(tmp_path / "repo").close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_save_on, args=(str(tmp_path), port), nprocs=2, join=True)
    said = (tmp_path / "rank1.txt").read_text()
    assert said.startswith("ckptstore.save on rank 1 of 2: where every rank commits to one branch"), said
    with Repository.open(tmp_path / "repo") as repo:
        assert len(repo.log()) == 1


def test_save_stores_a_str_as_its_value_not_as_a_path(repo, tmp_path, monkeypatch):
    """save("") committed the current folder's files and save("step 5") failed with "step 5 does not exist":
    Repository.commit's path reading took the object (auditor helper 300)."""
    (tmp_path / "notes.txt").write_text("unrelated file\n")
    monkeypatch.chdir(tmp_path)
    for text in ("", "step 5", "notes.txt"):
        assert ckptstore.load(ckptstore.save(text, repo=repo), repo=repo) == text
    handle = ckptstore.save(".", repo=repo, message="in the background", blocking=False)
    assert ckptstore.load(handle.result(), repo=repo) == "."
    with pytest.raises(ckptstore.errors.CkptError, match=r"no value ckptstore stores; to commit the file or folder"):
        ckptstore.save(tmp_path / "notes.txt", repo=repo)
