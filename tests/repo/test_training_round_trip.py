"""Real training runs committed every few steps, branched, and checked out bit-exact."""

import pytest
import torch
from click.testing import CliRunner

from ckptstore import load, save
from ckptstore.cli import cli
from ckptstore.formats.torchfile import numpy_safe_globals
from tests.conftest import Trainer, assert_same


def _load_file(path):
    with torch.serialization.safe_globals(numpy_safe_globals()):
        return torch.load(path, weights_only=True)


@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
def test_api_commits_of_a_training_run_check_out_bit_exact(repo, tmp_path, optimizer_kind):
    trainer = Trainer(optimizer_kind)
    commits, files = [], []
    for i in range(6):
        trainer.train(5)
        path = tmp_path / f"ckpt-{i}.pt"
        torch.save(trainer.state(), path)
        files.append(path)
        commits.append(repo.commit(path, message=f"step {trainer.step}", step=trainer.step, metrics={"i": i}))
    assert len(set(commits)) == 6
    log = repo.log()
    assert [c.id for c in log] == commits[::-1]
    assert [c.step for c in log] == [30, 25, 20, 15, 10, 5]
    assert any(r["depth"] > 0 for r in repo.show(commits[-1])["tensors"]), "later commits should be residuals"
    for cid, path in zip(commits, files):
        assert_same(_load_file(path), repo.checkout(cid))


def test_branch_from_early_commit_and_resume_gives_same_losses(repo, tmp_path):
    trainer = Trainer("adamw")
    trainer.train(4)
    torch.save(trainer.state(), tmp_path / "early.pt")
    early = repo.commit(tmp_path / "early.pt", message="early", step=4)
    trainer.train(4)
    torch.save(trainer.state(), tmp_path / "late.pt")
    repo.commit(tmp_path / "late.pt", message="late", step=8)

    from_file = Trainer("adamw", seed=99)
    from_file.load(_load_file(tmp_path / "early.pt"))
    expected = from_file.train(6)

    repo.branch("experiment", early)
    from_store = Trainer("adamw", seed=123)
    from_store.load(load("experiment", repo=repo))
    resumed = from_store.train(6)
    assert resumed == expected

    torch.save(from_store.state(), tmp_path / "branch.pt")
    branched = repo.commit(tmp_path / "branch.pt", message="on branch", step=10, branch="experiment")
    assert repo.commit_info(branched).parents == [early]
    graph = "\n".join(repo.log_graph(all_refs=True))
    assert "experiment" in graph and "/" in graph, graph


def test_in_memory_save_and_load(repo):
    trainer = Trainer("sgd")
    trainer.train(3)
    state = trainer.state()
    cid = save(state, repo=repo, message="from memory", step=3)
    assert_same(state, load(cid, repo=repo))
    assert repo.commit_info(cid).source_path is None


@pytest.mark.parametrize("blocking", [True, False])
def test_a_folder_given_to_save_and_load_names_its_own_repository_never_one_above(tmp_path, monkeypatch, blocking):
    from ckptstore import Repository
    from ckptstore.errors import RepoNotFoundError

    Repository.init(tmp_path).close()
    (tmp_path / "runs" / "b").mkdir(parents=True)
    for folder in (tmp_path / "runs" / "a", tmp_path / "runs" / "b"):  # missing, and a folder without a repository
        with pytest.raises(RepoNotFoundError, match="names the repository's folder itself"):
            save({"w": torch.ones(2)}, repo=folder, blocking=blocking)
        with pytest.raises(RepoNotFoundError, match="holds no ckptstore repository"):
            load("HEAD", repo=folder)
    with Repository.open(tmp_path) as parent:
        assert parent.head()[1] is None  # nothing went to the repository above
    monkeypatch.chdir(tmp_path / "runs" / "b")  # no folder given: the repository found from here, as `ckpt` does
    cid = save({"w": torch.ones(2)}, blocking=blocking)
    cid = cid if blocking else cid.result()
    assert_same({"w": torch.ones(2)}, load(cid))


def test_cli_training_flow_with_branch_checkout_and_fork(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert run("init").exit_code == 0
    trainer = Trainer("adamw")
    saved = {}
    for step in (3, 6, 9):
        trainer.train(3)
        torch.save(trainer.state(), "ckpt.pt")
        saved[step] = (tmp_path / "ckpt.pt").read_bytes()
        result = run("commit", "ckpt.pt", "-m", f"step {step}", "--step", str(step), "--metric", "loss=1.5")
        assert result.exit_code == 0, result.output
    assert run("branch", "exp", "HEAD~2").exit_code == 0
    out = run("checkout", "exp")
    assert out.exit_code == 0, out.output
    assert_same(_load_file(tmp_path / "ckpt.pt"), torch.load(__import__("io").BytesIO(saved[3]), weights_only=False))
    trainer = Trainer("adamw", seed=5)
    trainer.load(_load_file(tmp_path / "ckpt.pt"))
    trainer.train(3)
    torch.save(trainer.state(), "ckpt.pt")
    assert run("commit", "ckpt.pt", "-m", "branch work", "--step", "6").exit_code == 0
    graph = run("log", "--graph", "--all").output
    assert "HEAD -> exp" in graph and "main" in graph and "/" in graph, graph
    status = run("status").output
    assert "On branch exp" in status and "unchanged" in status
    assert run("tag", "best", "main~1").exit_code == 0
    assert "best" in run("tag").output
    assert run("checkout", "best", "-o", "restored.pt").exit_code == 0
    assert_same(torch.load(__import__("io").BytesIO(saved[6]), weights_only=False), _load_file("restored.pt"))


def test_empty_tensors_round_trip_alone_and_as_residuals(repo):
    states = [{"a": torch.zeros(0), "b": torch.full((3,), float(i)), "c": torch.zeros(0, 4, dtype=torch.bfloat16),
               "d": torch.empty(2, 0, dtype=torch.int64)} for i in range(3)]
    cids = [repo.commit(state) for state in states]
    for cid, state in zip(cids, states):
        assert_same(state, repo.checkout(cid))
