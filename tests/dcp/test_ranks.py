"""Sharded saves at 4 ranks, loads at 2 and 1, async_save, DCP directories in and out, and the shared repository.

One module fixture runs everything that needs ranks, so each launch serves several tests: a
4-rank FSDP2 + AdamW run saves (sync and with `dcp.async_save`) to a local repository and with
FileSystemWriter; the test then writes a DCP checkout and commits FileSystemWriter's directories;
a 2-rank run loads every one of them, resumes training from our commit and from FileSystemWriter's
directory, saves and loads on a repository with objects on S3 and metadata on PostgreSQL, and
last starts a save there that one of its ranks is killed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.dcp import CkptStorageReader
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.repo import fsck, gc
from tests.dcp.launch import run_ranks
from tests.dcp.worker import differences

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
WORKER = "tests.dcp.worker_more"


@dataclass
class Runs:
    repo: Path
    out: Path
    saved: list[dict]  # the 4 save ranks' reports
    loaded: list[dict]  # the 2 load ranks' reports
    cli: dict[str, str]  # output of the test's own ckpt commands
    shared: Path


def _reports(out: Path, scenario: str, world: int) -> list[dict]:
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text()) for r in range(world)]


def _ckpt(repo: Path, *args: str):
    return CliRunner().invoke(cli, ["--repo", str(repo), *args])


@pytest.fixture(scope="module")
def shared_repo(tmp_path_factory, s3_server, postgres_server):
    """A repository whose objects are on the test S3 server and metadata on the test PostgreSQL."""
    url = postgres_server.new_database()
    folder = tmp_path_factory.mktemp("shared") / "repo"
    Repository.init(folder, metadata_url=url, objects_url=f"s3://{s3_server.new_bucket()}/repo").close()
    yield folder
    if postgres_server.running:
        postgres_server.drop_database(url)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_repo) -> Runs:
    base = tmp_path_factory.mktemp("ranks")
    Repository.init(base / "repo").close()
    for result in run_ranks("save4", base / "repo", base / "out", world=4, worker=WORKER, timeout=240):
        assert result.returncode == 0, result.stdout[-4000:]
    outputs = {}
    for name, args in {"checkout": ("checkout", "main~1", "-o", str(base / "out" / "checkout-2")),
                       "commit_2": ("commit", str(base / "out" / "fs-2"), "--branch", "imported", "-m", "fs 2"),
                       "commit_4": ("commit", str(base / "out" / "fs-4"), "--branch", "imported", "-m", "fs 4"),
                       "again": ("commit", str(base / "out" / "fs-4"), "--branch", "imported")}.items():
        result = _ckpt(base / "repo", *args)
        assert result.exit_code == (1 if name == "again" else 0), result.output
        outputs[name] = result.output + str(result.exception or "")
    env = {0: {"SHARED_REPO": str(shared_repo)},  # rank 1 dies in its second write (the last save)
           1: {"SHARED_REPO": str(shared_repo), "CKPT_CRASH_AT": "dcp:rank-written@2"}}
    results = run_ranks("load2", base / "repo", base / "out", world=2, env_of_rank=env, worker=WORKER, timeout=240)
    assert results[0].returncode == 0, results[0].stdout[-4000:]
    assert results[1].returncode == -9, results[1].stdout[-4000:]  # SIGKILL at the fault point
    out = base / "out"
    return Runs(base / "repo", out, _reports(out, "save4", 4), _reports(out, "load2", 2), outputs, shared_repo)


def load_one_rank(reader) -> dict:
    """What `reader` holds, loaded in this one process into full-size tensors (and placeholders for plain data)."""
    metadata = reader.read_metadata()
    state = {fqn: torch.zeros(tuple(item.size), dtype=item.properties.dtype) if hasattr(item, "size") else None
             for fqn, item in metadata.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader)
    return state


def one_rank_differences(reader, full: Path) -> list[str]:
    """Where a 1-rank load differs from the whole state the ranks saved (every tensor, and the step)."""
    expected = {k: v for k, v in torch.load(full, weights_only=True).items()
                if isinstance(v, torch.Tensor) or k == "extra.step"}
    loaded = load_one_rank(reader)
    assert len(expected) > 10 and {k for k, v in loaded.items() if isinstance(v, torch.Tensor)} | {"extra.step"} \
        == set(expected)
    return differences({k: loaded[k] for k in expected}, expected)


def test_saved_at_four_ranks_loads_bit_exact_at_two_and_at_one(runs):
    commit = runs.saved[0]["commit_2"]
    assert [r["commit_2"] for r in runs.saved[1:]] == [None, None, None]  # the coordinator names the commit
    assert [r["differences_commit_2"] for r in runs.loaded] == [[], []]
    assert one_rank_differences(CkptStorageReader(runs.repo, commit), runs.out / "full-2.pt") == []
    with Repository.open(runs.repo) as repo:
        shards = sorted(k for k in repo.manifest(commit).entries if k.startswith("model.0.weight/%shard/"))
    assert shards == ["model.0.weight/%shard/0,0/9,16", "model.0.weight/%shard/18,0/9,16",  # 33 rows, 4 ranks
                      "model.0.weight/%shard/27,0/6,16", "model.0.weight/%shard/9,0/9,16"]


def test_async_save_makes_one_commit_that_loads_bit_exact(runs):
    assert {r["async_result"] for r in runs.saved} == {"Metadata"}  # the future's result, on every rank
    commit = runs.saved[0]["commit_4"]
    with Repository.open(runs.repo) as repo:
        log = repo.log("main")
    assert [c.id for c in log] == [commit, runs.saved[0]["commit_2"]]  # one commit per save, the async one on top
    assert log[0].parents == [log[1].id] and log[0].step == 4 and log[0].kind == "dcp"
    assert [r["differences_commit_4"] for r in runs.loaded] == [[], []]
    assert one_rank_differences(CkptStorageReader(runs.repo, commit), runs.out / "full-4.pt") == []


def test_resuming_from_a_commit_matches_resuming_from_filesystem_writer_output(runs):
    for report in runs.loaded:
        assert len(report["resumed_ours"]) == 3 and report["resumed_ours"] == report["resumed_theirs"]
    assert runs.loaded[0]["resumed_ours"] != runs.loaded[1]["resumed_ours"]  # the ranks trained on their own data


def test_checkout_of_a_sharded_commit_is_a_dcp_directory_plain_dcp_load_reads(runs):
    folder = runs.out / "checkout-2"
    assert "Restored" in runs.cli["checkout"]
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp"]
    assert [r["differences_checkout_2"] for r in runs.loaded] == [[], []]  # FileSystemReader at 2 ranks
    assert one_rank_differences(dcp.FileSystemReader(str(folder)), runs.out / "full-2.pt") == []


def test_committed_filesystem_writer_directories_load_bit_exact_the_later_one_as_residuals(runs):
    assert "nothing changed" in runs.cli["again"]
    with Repository.open(runs.repo) as repo:
        later, earlier = repo.log("imported")[:2]
        old, new = repo.manifest(earlier.id), repo.manifest(later.id)
        weights = [k for k in new.entries if k.startswith("model.0.weight/%shard/")]
        with repo.db.read() as tx:
            records = tensor_rows.load_records(tx, {new.entries[k].tensor for k in weights}, with_bases=False)
    assert len(weights) == 4 and later.parents == [earlier.id] and later.kind == "dcp"
    for key in weights:
        assert records[new.entries[key].tensor].base_id == old.entries[key].tensor, key
    assert [r["differences_imported_2"] for r in runs.loaded] == [[], []]
    assert [r["differences_imported_4"] for r in runs.loaded] == [[], []]
    for commit, step in ((earlier.id, 2), (later.id, 4)):
        assert one_rank_differences(CkptStorageReader(runs.repo, commit), runs.out / f"full-{step}.pt") == []


def test_diff_of_one_state_saved_at_four_ranks_and_at_one_compares_logical_tensors(runs, tmp_path):
    """It compared shards: the same values saved at another world size were "removed" and "added" (auditor)."""
    import shutil

    from ckptstore.dcp import CkptStorageWriter
    from ckptstore.repo.diff import diff

    full = {k: v for k, v in torch.load(runs.out / "full-2.pt", weights_only=True).items()
            if isinstance(v, torch.Tensor)}
    shutil.copytree(runs.repo, tmp_path / "repo")
    with Repository.open(tmp_path / "repo") as repo:
        at_four = runs.saved[0]["commit_2"]
        repo.branch("one-rank", at_four)
        writer = CkptStorageWriter(repo, branch="one-rank")
        dcp.save(full, storage_writer=writer)
        rows = {row.path: row for row in diff(repo, at_four, writer.commit_id)}
        full["model.0.weight"] = full["model.0.weight"] + 1
        dcp.save(full, storage_writer=(writer := CkptStorageWriter(repo, branch="one-rank")))
        changed = {row.path: row for row in diff(repo, at_four, writer.commit_id)}
    assert len(full) > 10 and all(rows[fqn].status == "unchanged" for fqn in full)
    assert rows["model.0.weight"].shape == (33, 16) and rows["model.0.weight"].stored_bytes > 0
    assert [fqn for fqn in full if changed[fqn].status != "unchanged"] == ["model.0.weight"]
    assert changed["model.0.weight"].relative_l2 > 0


def test_two_ranks_save_and_load_on_the_shared_s3_and_postgresql_repository(runs):
    reports = [r["shared"] for r in runs.loaded]
    assert [r["differences"] for r in reports] == [[], []] and reports[0]["commit"] == reports[1]["commit"]
    with Repository.open(runs.shared) as repo:
        assert repo.resolve("main") == reports[0]["commit"] and fsck(repo, full=True).ok
        assert repo.config.objects_url.startswith("s3://") and repo.config.metadata_url.startswith("postgresql")
        assert repo.log("main")[0].kind == "dcp"


def test_a_rank_killed_mid_save_on_the_shared_repository_leaves_it_consistent(runs):
    commit = runs.loaded[0]["shared"]["commit"]
    assert (runs.out / "crash-rank0.txt").exists()  # the surviving rank's save failed (rank 1 was killed)
    with Repository.open(runs.shared) as repo:
        assert repo.resolve("main") == commit and [c.message for c in repo.log("main")] == ["shared step 2"]
        checked = fsck(repo, full=True)
        assert checked.ok and not checked.broken_commits and checked.unreferenced_objects > 0
        assert gc(repo).objects_removed == checked.unreferenced_objects  # the dead rank's objects: garbage
        assert fsck(repo).ok and fsck(repo).unreferenced_objects == 0
    assert one_rank_differences(CkptStorageReader(runs.shared, "main"), runs.out / "full-shared.pt") == []
