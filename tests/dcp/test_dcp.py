"""ckptstore as a DCP storage backend, with real ranks: gloo on the CPU, one process per rank.

One 2-rank run (module fixture) trains an FSDP2 model with AdamW and saves two commits, each also
with DCP's own FileSystemWriter, then loads both back at 2 ranks; the tests check its commits and
load them again at 1 rank. The crash test kills a rank in write_data.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.dcp import CkptStorageReader, CkptStorageWriter
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.policy import EncodingSettings
from ckptstore.repo import fsck, gc
from ckptstore.repo.config import RetentionPolicy
from ckptstore.repo.pruning import prune
from tests.dcp.launch import run_ranks
from tests.dcp.worker import differences, full_state
from tests.forked import ROOT

CHUNK = 4096  # small chunks, so shards span several and a rank can read part of a stored item

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The 2-rank `train` run: (repository folder, output folder, rank 0's report, rank 1's report)."""
    base = tmp_path_factory.mktemp("dcp")
    with Repository.init(base / "repo", encoding=EncodingSettings(chunk_bytes=CHUNK)) as repo:
        for step in (1, 2):  # branch `full`: whole tensors from one process, the second commit residual
            dcp.save(full_state(step), storage_writer=CkptStorageWriter(repo, branch="full", message=f"full {step}"))
    results = run_ranks("train", base / "repo", base / "out", world=2)
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    reports = [json.loads((base / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    return base / "repo", base / "out", reports[0], reports[1]


def template(reader: CkptStorageReader) -> dict:
    """A flat state of full-size zero tensors (and placeholders for plain data) shaped like the stored one."""
    metadata = reader.read_metadata()
    return {fqn: torch.zeros(tuple(item.size), dtype=item.properties.dtype) if hasattr(item, "size") else None
            for fqn, item in metadata.state_dict_metadata.items()}


def load_one_rank(repo: Path, ref: str) -> dict:
    reader = CkptStorageReader(repo, ref)
    state = template(reader)
    dcp.load(state, storage_reader=reader)
    reader.close()
    return state


def test_fsdp2_adamw_two_commits_the_second_with_residuals_load_bit_exact_at_two_ranks(trained):
    repo_dir, _, first_rank, second_rank = trained
    assert first_rank["differences_first"] == first_rank["differences_second"] == []
    assert second_rank["differences_first"] == second_rank["differences_second"] == []
    with Repository.open(repo_dir) as repo:
        log = repo.log("main")
        assert [c.id for c in log] == [first_rank["commit_second"], first_rank["commit_first"]]
        assert log[0].parents == [log[1].id] and {c.kind for c in log} == {"dcp"}
        assert log[0].step == 4 and log[0].metrics == {"loss": 4.0}
        old, new = repo.manifest(log[1].id), repo.manifest(log[0].id)
        weights = [k for k in new.entries if k.startswith("model.0.weight/%shard/")]
        assert len(weights) == 2  # one shard per rank, each a residual against the same shard of the parent
        with repo.db.read() as tx:
            records = tensor_rows.load_records(tx, {new.entries[k].tensor for k in weights}, with_bases=False)
        for key in weights:
            assert records[new.entries[key].tensor].base_id == old.entries[key].tensor, key


@pytest.mark.parametrize("label", ["first", "second"])
def test_load_at_one_rank_equals_dcp_filesystem_writer_output(trained, label):
    repo_dir, out, report, _ = trained
    ours = load_one_rank(repo_dir, report[f"commit_{label}"])
    theirs = {k: (torch.full_like(v, 7) if isinstance(v, torch.Tensor) else v) for k, v in ours.items()}
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(out / f"reference-{label}")))
    assert differences(ours, theirs) == []
    assert ours["extra.step"] == (2 if label == "first" else 4)
    assert ours["model.0.weight"].shape == (129, 64) and ours["model.0.weight"].abs().sum() > 0


def test_one_process_save_loads_at_two_ranks_each_reading_about_its_half(trained):
    repo_dir, _, *reports = trained
    whole = sum(v.numel() * v.element_size() for v in full_state(0).values())
    for report in reports:
        assert report["differences_full"] == []
        assert whole / 2 <= report["replayed_full"] <= whole / 2 + 2 * CHUNK * 2  # at most a chunk more per end
    with Repository.open(repo_dir) as repo:
        top = repo.manifest(repo.resolve("full"))
        with repo.db.read() as tx:
            records = tensor_rows.load_records(tx, {e.tensor for e in top.entries.values()}, with_bases=False)
    assert all(r.base_id is not None and len(r.chunks) == 16 for r in records.values())  # chains cut to half


def test_uneven_shards_saved_at_two_ranks_load_at_one(trained):
    repo_dir, _, report, _ = trained
    state = load_one_rank(repo_dir, "uneven")
    expected = {"rows": torch.arange(35, dtype=torch.float32).reshape(7, 5),
                "cols": torch.arange(27, dtype=torch.int64).reshape(3, 9),
                "bias": torch.linspace(0, 1, 6, dtype=torch.bfloat16), "meta.name": "uneven", "meta.sizes": [7, 3]}
    assert differences(state, expected) == []
    with Repository.open(repo_dir) as repo:
        shown = {t["fqn"]: t for t in repo.show("uneven")["sharded"]}
        assert repo.resolve("uneven") == report["commit_uneven"]
    assert shown["rows"]["shards"] == 2 and shown["cols"]["shards"] == 2 and shown["bias"]["shards"] == 1


def test_uneven_shards_saved_at_two_ranks_load_at_three_bit_exact(trained, tmp_path):
    repo_dir = trained[0]
    results = run_ranks("load-uneven", repo_dir, tmp_path / "out", world=3)
    assert [r.returncode for r in results] == [0, 0, 0], [r.stdout[-2000:] for r in results]
    reports = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert all(r["differences"] == [] for r in reports)
    # saved as 4+3 rows and 5+4 columns; loaded as 3+3+1 rows and 3+3+3 columns: every cut crosses a shard
    assert [r["local_sizes"] for r in reports] == [{"rows": 3, "cols": 3}, {"rows": 3, "cols": 3},
                                                  {"rows": 1, "cols": 3}]


def test_cli_log_show_fsck_gc_on_a_repository_with_sharded_commits(trained, tmp_path, monkeypatch):
    repo_dir, _, report, _ = trained
    copy = tmp_path / "repo"
    shutil.copytree(repo_dir, copy)
    monkeypatch.chdir(copy)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)  # noqa: E731
    log = run("log")
    assert log.exit_code == 0 and report["commit_second"] in log.output and "first save" in log.output
    show = run("show", "main")
    assert show.exit_code == 0
    assert "model.0.weight  torch.float32 (129, 64)  2 shards" in show.output
    assert "optim.state.0.weight.exp_avg_sq  torch.float32 (129, 64)  2 shards" in show.output
    assert run("fsck").exit_code == 0
    fsck_full = run("fsck", "--full")
    assert fsck_full.exit_code == 0, fsck_full.output
    assert run("gc", "--prune").exit_code == 0
    assert differences(load_one_rank(copy, "main"), load_one_rank(repo_dir, "main")) == []  # gc kept every shard
    in_place = subprocess.run([sys.executable, "-m", "ckptstore", "checkout", "main~1"],  # HEAD moves, no files
                              cwd=copy, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=60)
    assert in_place.returncode == 0 and "Traceback" not in in_place.stderr
    assert in_place.stdout.startswith(f"HEAD is now at {report['commit_first'][:12]}, a sharded (DCP) commit: "
                                      "nothing is written in place") and "-o DIR" in in_place.stdout
    assert sorted(p.name for p in copy.iterdir()) == [".ckpt"]


@pytest.mark.parametrize("killed, point", [(1, "dcp:rank-written"), (0, "dcp:manifest-written")])
def test_a_rank_killed_before_the_commit_is_recorded_leaves_no_commit(trained, tmp_path, killed, point):
    repo_dir, _, report, _ = trained
    copy = tmp_path / "repo"
    shutil.copytree(repo_dir, copy)
    before = load_one_rank(copy, "main")
    results = run_ranks("crash", copy, tmp_path / "out", world=2, env_of_rank={killed: {"CKPT_CRASH_AT": point}},
                        timeout=60)
    assert results[killed].returncode == -9  # SIGKILL at the fault point, after its objects were written
    assert results[1 - killed].returncode != 0  # the other rank's save fails with it
    with Repository.open(copy) as repo:
        assert repo.resolve("main") == report["commit_second"]
        assert [c.message for c in repo.log("main")] == ["second save", "first save"]
        assert "never recorded" not in {c.message for c in repo.log(all_refs=True)}
        checked = fsck(repo, full=True)
        assert checked.ok and not checked.broken_commits
        assert checked.unreferenced_objects > 0  # the ranks' objects: garbage for gc
        assert gc(repo).objects_removed == checked.unreferenced_objects
        assert fsck(repo).ok and fsck(repo).unreferenced_objects == 0
    assert differences(load_one_rank(copy, "main"), before) == []


def test_export_gathers_a_sharded_commit_into_one_full_state_dict(trained, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    repo_dir, _, _, _ = trained
    expected = {k: v for k, v in load_one_rank(repo_dir, "main").items() if isinstance(v, torch.Tensor)}
    monkeypatch.chdir(repo_dir)
    written = CliRunner().invoke(cli, ["export", "main", "-o", str(tmp_path / "main.safetensors")])
    assert written.exit_code == 0, written.output
    assert f"{len(expected)} tensors" in written.output and "left out" in written.output  # the pickled items
    assert differences(load_file(str(tmp_path / "main.safetensors")), expected) == []
    written = CliRunner().invoke(cli, ["export", "uneven", "--format", "torch", "-o", str(tmp_path / "u.pt")])
    assert written.exit_code == 0, written.output
    gathered = torch.load(tmp_path / "u.pt", weights_only=True)
    assert differences(gathered, {k: v for k, v in load_one_rank(repo_dir, "uneven").items()
                                  if isinstance(v, torch.Tensor)}) == []


def test_prune_of_the_two_rank_history_keeps_its_tip_bit_exact(trained, tmp_path):
    """The second save's shards (two ranks') were residuals on the first's: prune re-encodes them when it goes."""
    repo_dir, _, report, _ = trained
    copy = tmp_path / "repo"
    shutil.copytree(repo_dir, copy)
    with Repository.open(copy) as repo:
        first = {e.tensor for e in repo.manifest(report["commit_first"]).entries.values()}
        second = {e.tensor for e in repo.manifest(report["commit_second"]).entries.values()}

        def on_first() -> int:  # the second save's shards whose base is one of the first's
            with repo.db.read() as tx:
                return sum(r.base_id in first for r in tensor_rows.load_records(tx, second, with_bases=False).values())

        before = on_first()
        pruned = prune(repo, RetentionPolicy(keep_last=1))
        assert report["commit_first"] in pruned.pruned and pruned.bytes_after < pruned.bytes_before
        assert on_first() < before
        checked = fsck(repo, full=True)
        assert checked.ok and not checked.broken_commits and checked.unreferenced_objects == 0, checked
        repo.checkout_to("main", tmp_path / "main")
    theirs = load_one_rank(repo_dir, report["commit_second"])
    written = {k: (torch.full_like(v, 7) if isinstance(v, torch.Tensor) else v) for k, v in theirs.items()}
    dcp.load(written, storage_reader=dcp.FileSystemReader(str(tmp_path / "main")))
    assert differences(load_one_rank(copy, "main"), theirs) == [] and differences(written, theirs) == []
