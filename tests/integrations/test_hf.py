"""The Trainer callback, restore and export, on one real transformers.Trainer run of a tiny GPT-2."""

import hashlib
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerState,
    TrainingArguments,
)

from ckptstore import Repository  # noqa: E402
from ckptstore.cli import cli  # noqa: E402
from ckptstore.errors import BackgroundCommitError, CkptError, DirtyWorktreeError  # noqa: E402
from ckptstore.integrations.hf import CkptCallback, latest_metrics, remove_committed_folders, restore  # noqa: E402

VOCAB, LENGTH, STEPS = 64, 16, 8

# restores of earlier commits to compare them, not to resume a run from them
pytestmark = pytest.mark.filterwarnings("ignore:.*is not the tip of HEAD:RuntimeWarning")


def _tokens() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (32, LENGTH), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(output_dir: Path, callbacks=(), steps: int = STEPS, eval_dataset=None, logging_steps: int = 1,
             **extra) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                        eos_token_id=0)
    args = TrainingArguments(output_dir=str(output_dir), run_name="tiny-gpt2", max_steps=steps, save_steps=2,
                             logging_steps=logging_steps, per_device_train_batch_size=4, learning_rate=1e-3, seed=0,
                             use_cpu=True, report_to=[], dataloader_num_workers=0, disable_tqdm=True, **extra)
    return Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=_tokens(), eval_dataset=eval_dataset,
                   callbacks=list(callbacks))


class FolderBytes(TrainerCallback):
    """Each saved folder's file digests, taken before CkptCallback may delete the folder."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, str]] = {}

    def on_save(self, args, state, control, **kwargs):
        self.saved[state.global_step] = _digests(Path(args.output_dir) / f"checkpoint-{state.global_step}")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _losses_after(trainer: Trainer, step: int) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > step]


@dataclass
class Run:
    repo: Path
    out: Path
    history: list[dict]
    saved: dict[int, dict[str, str]]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("hf")
    Repository.init(root / "repo").close()
    out = root / "out"
    (out / "checkpoint-1").mkdir(parents=True)  # not committed by the callback: keep_folders must leave it
    (out / "checkpoint-1" / "notes.txt").write_text("from an earlier run")
    recorder = FolderBytes()
    trainer = _trainer(out, [recorder, CkptCallback(root / "repo", keep_folders=3),
                             CkptCallback(root / "repo", branch="lossy", lossy="balanced", min_elements=1)])
    trainer.train()
    return Run(root / "repo", out, trainer.state.log_history, recorder.saved)


def test_each_saved_folder_is_committed_with_its_step_metrics_and_run_name(run):
    with Repository.open(run.repo) as repo:
        commits = repo.log("main")
    assert [c.step for c in commits] == [8, 6, 4, 2]
    for commit in commits:
        logged = next(e for e in run.history if e["step"] == commit.step and "loss" in e)
        assert commit.message == f"tiny-gpt2: checkpoint-{commit.step}" and commit.kind == "folder"
        assert commit.metrics["loss"] == logged["loss"] and commit.metrics["learning_rate"] == logged["learning_rate"]
        assert not commit.lossy


def test_a_commit_records_no_evaluation_of_an_earlier_step_as_its_own():
    """Step 6's commit recorded step 4's eval_loss: keep-best kept a checkpoint that was never evaluated (auditor)."""
    history = [{"loss": 4.0, "learning_rate": 1e-3, "step": 3}, {"eval_loss": 3.99, "epoch": 0.5, "step": 4},
               {"loss": 3.9, "learning_rate": 9e-4, "step": 6}, {"eval_loss": 3.5, "step": 8}]
    assert latest_metrics(history, 6) == {"loss": 3.9, "learning_rate": 9e-4, "epoch": 0.5}
    assert latest_metrics(history, 4) == {"loss": 4.0, "learning_rate": 1e-3, "eval_loss": 3.99, "epoch": 0.5}
    assert latest_metrics(history, 8)["eval_loss"] == 3.5


def test_keep_folders_deletes_only_older_folders_it_committed(run):
    assert sorted(p.name for p in run.out.iterdir()) == ["checkpoint-1", "checkpoint-4", "checkpoint-6",
                                                         "checkpoint-8"]
    assert (run.out / "checkpoint-1" / "notes.txt").read_text() == "from an earlier run"


def test_restore_is_byte_exact_and_resumes_with_the_same_losses_as_the_original_folder(run, tmp_path):
    with Repository.open(run.repo) as repo:
        at = {c.step: c.id for c in repo.log("main")}
        deleted = restore(repo, at[2], tmp_path / "back")  # its folder is gone from disk: only the store has it
        restored = restore(repo, at[4], tmp_path / "back")
    assert deleted == tmp_path / "back" / "checkpoint-2" and _digests(deleted) == run.saved[2]
    assert restored == tmp_path / "back" / "checkpoint-4" and _digests(restored) == run.saved[4]
    from_original = _trainer(tmp_path / "a")
    from_original.train(resume_from_checkpoint=str(run.out / "checkpoint-4"))
    from_restored = _trainer(tmp_path / "b")
    from_restored.train(resume_from_checkpoint=str(restored))
    expected = _losses_after(from_original, 4)
    assert len(expected) == STEPS - 4 and _losses_after(from_restored, 4) == expected


def test_a_run_resumed_from_a_restored_branch_commits_after_the_commit_it_resumed_from(run, tmp_path):
    """The guide's restore of main~2 then resume: the resumed commits followed the abandoned tip (auditor)."""
    store = tmp_path / "store"
    shutil.copytree(run.repo, store)
    with Repository.open(store) as repo:
        at = {c.step: c.id for c in repo.log("main")}
        with pytest.warns(RuntimeWarning, match="not the tip of HEAD.*pass branch=NAME"):
            restore(repo, at[4], tmp_path / "warned")
        with pytest.raises(CkptError, match="exists at another commit"):
            restore(repo, at[4], tmp_path / "out", branch="lossy")
        folder = restore(repo, at[4], tmp_path / "out", branch="retry")
    _trainer(tmp_path / "out", [CkptCallback(store, branch="retry", blocking=True)]).train(
        resume_from_checkpoint=str(folder))
    with Repository.open(store) as repo:
        assert [c.step for c in repo.log("retry")][:4] == [8, 6, 4, 2] and repo.log("retry")[2].id == at[4]
        assert repo.resolve("main") == at[8]


@pytest.mark.parametrize("branch", [None, "retry"])
def test_a_run_resumed_from_a_folder_left_in_output_dir_behind_the_tip_branches_there_or_says_so(run, tmp_path,
                                                                                                   branch):
    """Resuming from checkpoint-4 still on disk (no restore) went on from main's tip, unsaid, with branch= too:
    main became [8, 6, 8, 6, 4, 2] (auditor 439)."""
    store, out = tmp_path / "store", tmp_path / "out"
    shutil.copytree(run.repo, store)
    shutil.copytree(run.out / "checkpoint-4", out / "checkpoint-4")
    with Repository.open(store) as repo:
        at = {c.step: c.id for c in repo.log("main")}
    resumed = _trainer(out, [CkptCallback(store, branch=branch, blocking=True)])
    if branch is None:
        with pytest.warns(RuntimeWarning, match=r"resumed from checkpoint-4 \(.*not the tip of branch 'main'"):
            resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
        return
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    with Repository.open(store) as repo:
        assert [c.step for c in repo.log("retry")] == [8, 6, 4, 2] and repo.log("retry")[2].id == at[4]
        assert repo.resolve("main") == at[8]


def test_keep_folders_counts_no_earlier_runs_folder_ahead_of_a_resumed_run_among_the_newest(tmp_path):
    """Run 1's checkpoint-8, left on disk, was "newest": the resumed run's own checkpoint-6 was deleted (auditor)."""
    folders = {step: tmp_path / f"checkpoint-{step}" for step in (4, 6, 8)}
    for folder in folders.values():
        folder.mkdir()
    committed = {folders[4].resolve(): "c4", folders[6].resolve(): "c6"}  # the resumed run's; 8 is run 1's
    assert remove_committed_folders(tmp_path, committed, keep=1, step=6) == [folders[4]]
    assert folders[6].is_dir() and folders[8].is_dir() and list(committed) == [folders[6].resolve()]


def _best_of_loss_kept_by(tmp_path: Path, keep_best: str) -> Trainer:
    """A 2-step run whose Trainer counts eval loss best, into a repository whose retention keeps `keep_best`."""
    Repository.init(tmp_path / "store").close()
    config = tmp_path / "store" / ".ckpt" / "config.toml"
    config.write_text(config.read_text() + f'\n[retention]\nkeep_best = "{keep_best}"\n')
    return _trainer(tmp_path / "out", [CkptCallback(tmp_path / "store", blocking=True)], steps=2,
                    eval_dataset=_tokens()[:4], eval_strategy="steps", eval_steps=2, metric_for_best_model="loss")


def test_keep_best_on_the_training_loss_beside_the_trainers_best_eval_loss_is_warned_of(tmp_path):
    """keep_best = "loss" pruned the checkpoint that the Trainer's metric_for_best_model="loss" chose (auditor)."""
    trainer = _best_of_loss_kept_by(tmp_path, "loss")
    with pytest.warns(RuntimeWarning, match="keep_best = 'eval_loss' to keep the checkpoint the Trainer counts best"):
        trainer.train()


def test_keep_best_the_other_way_from_the_trainers_best_is_warned_of(tmp_path):
    """keep_best = "eval_accuracy" keeps the minimum: the Trainer's best (its maximum) was pruned, unsaid (auditor)."""
    trainer = _best_of_loss_kept_by(tmp_path, "eval_loss:max")
    with pytest.warns(RuntimeWarning, match="keeps its maximum, while the Trainer counts the minimum of 'loss' best: "
                                            "write keep_best = 'eval_loss:min'"):
        trainer.train()


def test_restore_over_a_changed_folder_names_its_own_arguments(run, tmp_path):
    with Repository.open(run.repo) as repo:
        at = {c.step: c.id for c in repo.log("main")}
        folder = restore(repo, at[2], tmp_path)
        (folder / "trainer_state.json").write_text("{}")  # not what any commit holds
        with pytest.raises(DirtyWorktreeError, match=r"trainer_state\.json.*output_dir, or pass force=True") as said:
            restore(repo, at[2], tmp_path)
        assert "--force" not in str(said.value) and "-o PATH" not in str(said.value)
        assert restore(repo, at[2], tmp_path, force=True) == folder and _digests(folder) == run.saved[2]


def test_lossy_commits_go_to_their_branch_and_differ_from_the_folder(run, tmp_path):
    with Repository.open(run.repo) as repo:
        commits = repo.log("lossy")[:4]
        assert [(c.step, c.lossy) for c in commits] == [(8, "balanced"), (6, "balanced"), (4, "balanced"),
                                                        (2, "balanced")]
        folder = restore(repo, "lossy", tmp_path)
    original = load_file(run.out / "checkpoint-8" / "model.safetensors")
    lossy = load_file(folder / "model.safetensors")
    assert sorted(lossy) == sorted(original)
    weight = "transformer.h.0.mlp.c_fc.weight"
    error = (lossy[weight] - original[weight]).norm() / original[weight].norm()
    assert 0 < error < 0.1


def test_export_of_a_trainer_commit_loads_with_from_pretrained_bit_for_bit(run, tmp_path, monkeypatch):
    monkeypatch.chdir(run.repo)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    written = CliRunner().invoke(cli, ["export", "main", "--format", "safetensors", "-o",
                                       str(model_dir / "model.safetensors")])
    assert written.exit_code == 0, written.output
    assert "optimizer.pt" in written.output and "--all" in written.output  # says what it left out
    shutil.copy(run.out / "checkpoint-8" / "config.json", model_dir)
    original = load_file(run.out / "checkpoint-8" / "model.safetensors")
    loaded = GPT2LMHeadModel.from_pretrained(model_dir).state_dict()
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name
    assert torch.equal(loaded["lm_head.weight"], original["transformer.wte.weight"])  # tied, as trained
    written = CliRunner().invoke(cli, ["export", "main", "--format", "torch", "-o", str(tmp_path / "w.pt")])
    assert written.exit_code == 0, written.output
    as_torch = torch.load(tmp_path / "w.pt", weights_only=True)
    assert list(as_torch) == list(original) and all(torch.equal(as_torch[k], v) for k, v in original.items())


@pytest.mark.filterwarnings("ignore::ckptstore.repo.background.BackgroundCommitWarning")
def test_the_callback_commits_nothing_off_the_main_process_and_refuses_bad_arguments(run, tmp_path):
    with Repository.open(run.repo) as repo:
        before = repo.resolve("main")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state = TrainerState(global_step=3, is_world_process_zero=False)  # rank 1: no folder, no commit
    CkptCallback(run.repo).on_save(args, state, None)
    with Repository.open(run.repo) as repo:
        assert repo.resolve("main") == before
    with pytest.raises(CkptError, match="keep_folders"):
        CkptCallback(run.repo, keep_folders=-1)
    state.is_world_process_zero = True
    with pytest.raises(CkptError, match="checkpoint-3 is not a folder"):
        CkptCallback(run.repo).on_save(args, state, None)
    again = CkptCallback(run.repo)  # a folder main's head already holds: recorded as committed, no new commit
    args, state = TrainingArguments(output_dir=str(run.out), use_cpu=True, report_to=[]), TrainerState(global_step=8)
    again.on_save(args, state, None)  # in the background: "nothing changed" arrives later, and is no error
    again.on_train_end(args, state, None)
    with Repository.open(run.repo) as repo:
        assert repo.resolve("main") == before and again.committed == {(run.out / "checkpoint-8").resolve(): before}


def test_restore_refuses_a_commit_that_is_not_a_folder(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "w.pt", step=5)
        with pytest.raises(CkptError, match="not a Trainer checkpoint folder"):
            restore(repo, "main", tmp_path / "out")


class HoldAndCheck(TrainerCallback):
    """Holds each background commit until the Trainer is about to save again, checking what is on disk then.

    Placed before CkptCallback: on_save arms a fresh hold for the commit CkptCallback starts next,
    and releases it only when CkptCallback must wait for it. At each save and at the end, every
    saved folder gone from disk (rotated by the Trainer, or pruned) must already be in the store.
    """

    def __init__(self, repo: Path, tmp: Path, monkeypatch) -> None:
        self.repo, self.tmp, self.monkeypatch, self.release = repo, tmp, monkeypatch, None
        self.saved: dict[int, dict[str, str]] = {}
        self.checks = 0

    def on_save(self, args, state, control, **kwargs):
        self._check(args)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.saved[state.global_step] = _digests(folder)
        self.release = self.tmp / f"release-{state.global_step}"
        self.monkeypatch.setenv("CKPT_WAIT_AT", f"background:start={self.release}")

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save and self.release is not None:
            self.release.touch()

    def on_epoch_end(self, args, state, control, **kwargs):  # training stops: CkptCallback waits for the last
        if control.should_training_stop and self.release is not None:
            self.release.touch()

    def on_train_end(self, args, state, control, **kwargs):
        if self.release is not None:
            self.release.touch()

    def _check(self, args):
        with Repository.open(self.repo) as repo:
            in_store = {c.step for c in repo.log("main")} if repo.head()[1] else set()
        for step in self.saved:
            if not (Path(args.output_dir) / f"checkpoint-{step}").exists():
                assert step in in_store, f"checkpoint-{step} was deleted before its commit was recorded"
                self.checks += 1


def test_background_commits_outlive_save_total_limit_rotation(tmp_path, monkeypatch):
    Repository.init(tmp_path / "repo").close()
    checker = HoldAndCheck(tmp_path / "repo", tmp_path, monkeypatch)
    callback = CkptCallback(tmp_path / "repo", keep_folders=1)
    trainer = _trainer(tmp_path / "out", [checker, callback], steps=6, save_total_limit=1)
    trainer.train()
    checker.release.touch()
    checker._check(trainer.args)
    assert checker.checks >= 3  # the Trainer rotated each folder out while the next training ran
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["checkpoint-6"]
    with Repository.open(tmp_path / "repo") as repo:
        commits = {c.step: c.id for c in repo.log("main")}
        assert sorted(commits) == [2, 4, 6]
        for step, cid in commits.items():  # each folder as the Trainer wrote it, though read after the next steps
            assert _digests(restore(repo, cid, tmp_path / "back")) == checker.saved[step]


class SaveFromLog(HoldAndCheck):
    """Asks for a save from on_log at step 3 (not a save step), releasing step 2's held commit a second later."""

    def on_log(self, args, state, control, **kwargs):
        if state.global_step == 3:
            control.should_save = True
            threading.Timer(1.0, self.release.touch).start()


def test_a_save_asked_for_from_on_log_waits_for_the_commit_its_rotation_would_delete(tmp_path, monkeypatch):
    """With save_total_limit=1 the save that a callback asked for in on_log rotated the folder that the commit in
    flight was still reading (HF auditor, stop 54: documented then as 'pass blocking=True')."""
    Repository.init(tmp_path / "repo").close()
    checker = SaveFromLog(tmp_path / "repo", tmp_path, monkeypatch)
    trainer = _trainer(tmp_path / "out", [checker, CkptCallback(tmp_path / "repo")], steps=6, save_total_limit=1)
    trainer.train()
    checker.release.touch()
    checker._check(trainer.args)
    with Repository.open(tmp_path / "repo") as repo:
        commits = {c.step: c.id for c in repo.log("main")}
        assert sorted(commits) == [2, 3, 4, 6]
        for step, cid in commits.items():
            assert _digests(restore(repo, cid, tmp_path / "back")) == checker.saved[step]


@pytest.mark.filterwarnings("ignore::ckptstore.repo.background.BackgroundCommitWarning")
def test_a_failed_background_commit_stops_training_and_keeps_its_folder(tmp_path, monkeypatch):
    Repository.init(tmp_path / "repo").close()
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")  # the disk fills up in the first commit
    trainer = _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo", keep_folders=0)], steps=4)
    with pytest.raises(BackgroundCommitError, match="checkpoint-2") as raised:
        trainer.train()
    assert "disk is full" in str(raised.value) and "ckpt commit" in str(raised.value)
    assert trainer.state.global_step == 4 and not (tmp_path / "out" / "checkpoint-4").exists()  # before the save
    assert (tmp_path / "out" / "checkpoint-2" / "model.safetensors").is_file()
    with Repository.open(tmp_path / "repo") as repo:
        assert repo.head()[1] is None  # nothing of it recorded


class StopAtFour(TrainerCallback):
    """Early stopping made deterministic: training ends after the evaluation at step 4."""

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == 4:
            control.should_training_stop = True


class StopAtFive(TrainerCallback):
    """A time budget: training ends at step 5, between saves, after CkptCallback's own step-end hook ran."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            control.should_training_stop = True


class HoldFromStepFour(TrainerCallback):
    """Holds a background commit started at step 4 until on_train_end, as a real-sized commit would still run."""

    def __init__(self, release: Path, monkeypatch) -> None:
        self.release, self.monkeypatch = release, monkeypatch

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 4:
            self.monkeypatch.setenv("CKPT_WAIT_AT", f"background:start={self.release}")
            threading.Timer(1.0, self.release.touch).start()  # a commit that waits must end (as a real one does)

    def on_train_end(self, args, state, control, **kwargs):
        self.release.touch()


@pytest.mark.parametrize("stop", [StopAtFour, StopAtFive])
def test_an_early_stopped_runs_last_folder_is_committed_before_the_trainer_deletes_it(tmp_path, monkeypatch, stop):
    Repository.init(tmp_path / "repo").close()
    callbacks = [HoldFromStepFour(tmp_path / "release", monkeypatch), CkptCallback(tmp_path / "repo"), stop()]
    # the best model stays step 2's (greater is better), so _finalize_training deletes checkpoint-4
    trainer = _trainer(tmp_path / "out", callbacks, steps=10, eval_dataset=_tokens()[:4], save_total_limit=1,
                       eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                       metric_for_best_model="eval_loss", greater_is_better=True)
    trainer.train()
    assert not (tmp_path / "out" / "checkpoint-4").exists()
    with Repository.open(tmp_path / "repo") as repo:
        assert sorted(c.step for c in repo.log("main")) == [2, 4]


class WritesTokenizer(TrainerCallback):
    """A callback after CkptCallback that adds a file to each checkpoint folder in its own on_save."""

    def on_save(self, args, state, control, **kwargs):
        (Path(args.output_dir) / f"checkpoint-{state.global_step}" / "tokenizer.json").write_text(
            f'{{"step": {state.global_step}}}')


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.parametrize("extra", [{"steps": 4}, {"steps": 16, "save_strategy": "epoch"}], ids=["steps", "epoch"])
def test_files_a_later_callback_writes_in_its_on_save_are_committed_before_the_folder_goes(tmp_path, extra, blocking):
    """The commit read the folder in CkptCallback's own on_save, and keep_folders then deleted the file a later
    callback wrote there: it was in no commit (HF auditor, stop 54)."""
    Repository.init(tmp_path / "repo").close()
    callbacks = [CkptCallback(tmp_path / "repo", keep_folders=0, blocking=blocking), WritesTokenizer()]
    trainer = _trainer(tmp_path / "out", callbacks, **extra)
    trainer.train()
    assert not list((tmp_path / "out").iterdir())
    with Repository.open(tmp_path / "repo") as repo:
        commits = {c.step: c.id for c in repo.log("main")}
        assert sorted(commits) == ([2, 4] if "save_strategy" not in extra else [8, 16])
        for step, cid in commits.items():
            back = restore(repo, cid, tmp_path / f"back{step}")
            assert (back / "tokenizer.json").read_text() == f'{{"step": {step}}}'


def test_restore_over_a_file_a_job_saves_meanwhile_keeps_the_whole_refusal(tmp_path, monkeypatch):
    """Its advice swap cut "nothing was replaced or deleted: commit it first" down to "pass force=True", which
    would overwrite the job's new save (reader)."""
    import json

    from ckptstore.errors import DirtyWorktreeError
    from ckptstore.integrations import hf
    from ckptstore.repo import checkout

    folder = tmp_path / "out" / "checkpoint-3"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(4)}, folder / "model.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(folder, step=3)
        torch.save({"w": torch.zeros(4)}, folder / "model.pt")
        repo.commit(folder, step=3, message="b")
        real = checkout.restore

        def saving_meanwhile(*args, **kwargs):
            torch.save({"w": torch.full((4,), 7.0)}, folder / "model.pt")  # a job's new save, in no commit
            return real(*args, **kwargs)

        monkeypatch.setattr(checkout, "restore", saving_meanwhile)
        with pytest.raises(DirtyWorktreeError, match=r"nothing was replaced or deleted; commit it first to keep it"):
            hf.restore(repo, cid, tmp_path / "out")
    assert torch.equal(torch.load(folder / "model.pt")["w"], torch.full((4,), 7.0))


def _save_at_two_ranks(rank: int, root: str, port: int) -> None:
    """Rank 1 writes its RNG file late (a straggler); both then call on_save and on_train_end, as the Trainer does."""
    import os
    import time

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        folder = Path(root) / "out" / "checkpoint-2"
        if rank == 1:
            time.sleep(1.0)
            torch.save({"cpu": torch.ones(3)}, folder / "rng_state_1.pth")
        args = TrainingArguments(output_dir=str(Path(root) / "out"), use_cpu=True, report_to=[])
        state = TrainerState(global_step=2, is_world_process_zero=rank == 0)
        callback = CkptCallback(Path(root) / "repo", blocking=True)
        callback.on_save(args, state, None)
        callback.on_train_end(args, state, None)
    finally:
        dist.destroy_process_group()


def test_on_save_waits_for_every_ranks_files_before_committing_the_folder(tmp_path):
    """Rank 0 committed checkpoint-N before rank 1 had written rng_state_1.pth; keep_folders then deleted the folder,
    and with it the only copy of that file (DDP integrations auditor)."""
    import socket

    import torch.multiprocessing as mp

    Repository.init(tmp_path / "repo").close()
    folder = tmp_path / "out" / "checkpoint-2"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(4)}, folder / "model.pt")
    torch.save({"cpu": torch.zeros(3)}, folder / "rng_state_0.pth")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_save_at_two_ranks, args=(str(tmp_path), port), nprocs=2, join=True)
    with Repository.open(tmp_path / "repo") as repo:
        assert sorted(f.name for f in repo.manifest(repo.resolve("main")).files) == [
            "model.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]


def test_a_restore_on_every_rank_accepts_the_branch_another_rank_just_made(run, tmp_path, monkeypatch):
    """`restore(..., branch=...)` on each rank raced: the one that found no branch and then failed to make it, another
    rank's being there, killed the job with RefExistsError (DDP integrations auditor)."""
    with Repository.open(run.repo) as repo:
        cid = repo.resolve("main~1")
        branches, reads = Repository.branches, []
        # what this rank read twice before the other rank made it; then what is there
        monkeypatch.setattr(Repository, "branches", lambda self: {} if len(reads.append(1) or reads) <= 2 else
                            branches(self))
        repo.branch("retry", cid)  # the other rank's
        from ckptstore.integrations import hf

        hf._branch_at(repo, "main~1", cid, "retry")
        assert len(reads) == 3 and repo.branches()["retry"] == cid


def test_a_run_resumed_from_a_folder_whose_commit_was_killed_commits_that_folder_first(tmp_path):
    """The run that saved checkpoint-4 died in its commit; the run resumed from the folder committed only its own
    later saves, so checkpoint-4 was in no commit (HF auditor, stop 54)."""
    out = tmp_path / "out"
    _trainer(out, steps=4).train()  # the first run: its commits of checkpoint-2 and -4 did not happen here
    saved = _digests(out / "checkpoint-4")
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(out / "checkpoint-2", step=2)
    _trainer(out, [CkptCallback(tmp_path / "repo")], steps=6).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    _trainer(out, [CkptCallback(tmp_path / "repo")], steps=8).train(resume_from_checkpoint=str(out / "checkpoint-6"))
    with Repository.open(tmp_path / "repo") as repo:
        commits = repo.log("main")
        assert [c.step for c in commits] == [8, 6, 4, 2]  # and no second commit of checkpoint-6 by the last run
        assert _digests(restore(repo, commits[2].id, tmp_path / "back")) == saved


def test_a_resumed_runs_first_commit_pairs_by_the_live_model_as_its_later_ones_do(tmp_path):
    """The folder a resumed run commits at its first step went without the Trainer's model and optimizer: its lossy
    commit left every weight unpaired where the run's later ones paired them by name (reviewer 401, of c0abf73)."""
    out = tmp_path / "out"
    _trainer(out, steps=2).train()  # checkpoint-2, never committed
    Repository.init(tmp_path / "repo").close()
    callback = CkptCallback(tmp_path / "repo", lossy="balanced", min_elements=1)
    _trainer(out, [callback], steps=4).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    with Repository.open(tmp_path / "repo") as repo:
        assert {c.step: repo.show(c.id)["pairing"] for c in repo.log()} == {4: "given by the caller",
                                                                               2: "given by the caller"}


class FailsAfter(torch.utils.data.Dataset):
    """The run's token rows, until the `limit`-th sample read: then a corrupt sample's error."""

    def __init__(self, limit: int) -> None:
        self.rows, self.limit, self.read = _tokens(), limit, 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.read += 1
        if self.read > self.limit:
            raise RuntimeError("corrupt sample")
        return self.rows[index]


_FAILING_RUN = """
import sys
from pathlib import Path
from ckptstore.integrations.hf import CkptCallback
from tests.integrations.test_hf import FailsAfter, _trainer


def main():  # the Trainer and its callback go out of scope with the failure
    root = Path(sys.argv[1])
    trainer = _trainer(root / "out", [CkptCallback(root / "repo")], steps=8)
    trainer.train_dataset = FailsAfter(12)  # step 3's batch fails: the save at step 2 has no next hook
    trainer.train()


try:
    main()
except RuntimeError as exc:
    print(f"training failed: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def test_a_save_whose_next_step_fails_is_committed_at_exit(tmp_path):
    """The commit begins at the hook after on_save (b37bf07): a data loader's error before the next step left
    checkpoint-2 in no commit (reader 21); with the callback gone out of scope, the exit hook's weak set had
    lost it (reader 22)."""
    import subprocess
    import sys

    from tests.conftest import ckpt_env

    Repository.init(tmp_path / "repo").close()
    failed = subprocess.run([sys.executable, "-c", _FAILING_RUN, str(tmp_path)], env=ckpt_env(), capture_output=True,
                            text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert failed.returncode != 0 and "corrupt sample" in failed.stderr
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [2]
        assert _digests(restore(repo, "main", tmp_path / "back")) == _digests(tmp_path / "out" / "checkpoint-2")


def test_a_resumed_run_commits_its_folder_though_another_run_committed_that_step(tmp_path):
    """A commit of the same step by another run (another output_dir) counted as this folder's: the resumed run's
    checkpoint-2, whose first run failed before committing it, was never committed (reader 21)."""
    Repository.init(tmp_path / "repo").close()
    _trainer(tmp_path / "a", [CkptCallback(tmp_path / "repo")], steps=4).train()
    failing = _trainer(tmp_path / "b", [CkptCallback(tmp_path / "repo")], steps=6, weight_decay=0.5)
    failing.train_dataset = FailsAfter(12)
    with pytest.raises(RuntimeError, match="corrupt sample"):
        failing.train()
    saved = _digests(tmp_path / "b" / "checkpoint-2")
    resumed = _trainer(tmp_path / "b", [CkptCallback(tmp_path / "repo")], steps=6, weight_decay=0.5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    with Repository.open(tmp_path / "repo") as repo:
        commits = repo.log("main")
        assert [c.step for c in commits] == [6, 4, 2, 4, 2]
        assert _digests(restore(repo, commits[2].id, tmp_path / "back")) == saved  # b's, not a's (weight decay)


def test_a_failed_runs_waiting_save_is_committed_before_the_next_runs_commits(tmp_path):
    """It was committed at exit, on top of a later run's commits: the branch's head became the failed run's old
    checkpoint (hostile-input auditor)."""
    Repository.init(tmp_path / "repo").close()
    failing = _trainer(tmp_path / "one", [CkptCallback(tmp_path / "repo")], steps=8)
    failing.train_dataset = FailsAfter(12)
    with pytest.raises(RuntimeError, match="corrupt sample"):
        failing.train()
    _trainer(tmp_path / "two", [CkptCallback(tmp_path / "repo")], steps=4).train()
    with Repository.open(tmp_path / "repo") as repo:
        commits = repo.log("main")
        assert [c.step for c in commits] == [4, 2, 2]
        assert _digests(restore(repo, commits[-1].id, tmp_path / "back")) == _digests(
            tmp_path / "one" / "checkpoint-2")


def _a_dataloader_worker() -> None:
    torch.set_num_threads(1)  # before any torch op in a forked child: OpenMP deadlocks otherwise


def test_a_forked_worker_leaves_the_parents_waiting_save_to_the_parent(tmp_path):
    """Each DataLoader worker forked after a failed step (trainer.evaluate()) committed the waiting checkpoint-2 at
    its exit too, racing the parent: the loser said it 'was not committed' (auditor 334)."""
    import multiprocessing

    from ckptstore.integrations import hf

    Repository.init(tmp_path / "repo").close()
    failing = _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo")], steps=8)
    failing.train_dataset = FailsAfter(12)
    with pytest.raises(RuntimeError, match="corrupt sample"):
        failing.train()
    worker = multiprocessing.get_context("fork").Process(target=_a_dataloader_worker)
    try:
        worker.start()
        worker.join(timeout=120)
        assert worker.exitcode == 0
        with Repository.open(tmp_path / "repo") as repo:
            assert repo.branches() == {}  # the worker's exit committed nothing
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
        hf._commit_the_waiting()  # the parent's exit hook, run now: the save is the parent's to commit
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [2]


def test_a_resume_from_a_linked_folder_with_keep_folders_removes_the_link_and_keeps_its_target(tmp_path):
    """keep_folders called rmtree on the resumed checkpoint-2, a link to a folder elsewhere: OSError ended
    training (hostile-input auditor)."""
    Repository.init(tmp_path / "repo").close()
    _trainer(tmp_path / "first", steps=2).train()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint-2").symlink_to(tmp_path / "first" / "checkpoint-2")
    trainer = _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo", keep_folders=1)], steps=6)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-6"]
    assert (tmp_path / "first" / "checkpoint-2" / "trainer_state.json").is_file()
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [6, 4, 2]


def test_a_failed_runs_save_deleted_since_is_passed_over_when_the_next_run_begins(tmp_path):
    """The next train() began by committing it and failed: 'checkpoint-2 does not exist' (reader 22)."""
    Repository.init(tmp_path / "repo").close()
    failing = _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo")], steps=8)
    failing.train_dataset = FailsAfter(12)
    with pytest.raises(RuntimeError, match="corrupt sample"):
        failing.train()
    shutil.rmtree(tmp_path / "out")  # starting over
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo")], steps=4).train()
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [4, 2]
        assert _digests(restore(repo, "main~1", tmp_path / "back")) == _digests(tmp_path / "out" / "checkpoint-2")


def test_a_run_resumed_from_a_restored_lossy_commit_does_not_commit_it_again(tmp_path):
    """Its files differ from the originals the lossy commit records, so it was committed a second time,
    quantized twice: steps 6, 4, 4, 2 (reader 22)."""
    Repository.init(tmp_path / "repo").close()
    callback = {"lossy": "balanced", "min_elements": 1}
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo", **callback)], steps=4).train()
    shutil.rmtree(tmp_path / "out")
    folder = restore(tmp_path / "repo", "main", tmp_path / "out")
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo", **callback)], steps=6).train(
        resume_from_checkpoint=str(folder))
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [6, 4, 2]


@pytest.mark.parametrize("logging_steps", [1, 500])
def test_a_resumed_run_commits_no_other_runs_folder_of_its_step_left_in_output_dir(tmp_path, logging_steps):
    """Resumed from a restored commit with output_dir holding another experiment's checkpoint-4, the run committed
    that folder as its own step 4 (HF auditor 3, high); with nothing logged yet both folders' histories were
    empty, and it still did (reader 23)."""
    logged = {"logging_steps": logging_steps}
    Repository.init(tmp_path / "repo").close()
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo")], steps=4, **logged).train()
    shutil.rmtree(tmp_path / "out")
    _trainer(tmp_path / "out", steps=4, weight_decay=0.5, **logged).train()  # experiment B, committed nowhere
    folder = restore(tmp_path / "repo", "main", tmp_path / "back")
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo")], steps=6, **logged).train(
        resume_from_checkpoint=str(folder))
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [6, 4, 2]


@pytest.mark.parametrize("logging_steps", [1, 500])
def test_a_resumed_lossy_run_commits_its_folder_though_another_runs_lossy_commit_of_the_step_is_head(
        tmp_path, logging_steps):
    """The check for a folder restored from the lossy head went by its name and step: another run's uncommitted
    checkpoint-2 was taken for it and never committed (HF auditor 3); then by trainer_state.json, which two runs
    that logged nothing yet write alike (reader 23)."""
    lossy, logged = {"lossy": "balanced", "min_elements": 1}, {"logging_steps": logging_steps}
    Repository.init(tmp_path / "repo").close()
    _trainer(tmp_path / "a", [CkptCallback(tmp_path / "repo", **lossy)], steps=2, **logged).train()
    _trainer(tmp_path / "b", steps=2, weight_decay=0.5, **logged).train()  # its commit never happened
    _trainer(tmp_path / "b", [CkptCallback(tmp_path / "repo", **lossy)], steps=4, weight_decay=0.5, **logged).train(
        resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    with Repository.open(tmp_path / "repo") as repo:
        assert [(c.step, Path(c.source_path).parent.name) for c in repo.log("main")] == [(4, "b"), (2, "b"), (2, "a")]


@pytest.mark.parametrize("blocking", [True, False])
def test_keep_folders_deletes_no_folder_another_ckpt_callback_has_yet_to_commit(tmp_path, blocking):
    """keep_folders=0 on main's callback deleted each folder before the lossy branch's callback read it: its
    commits failed, 'checkpoint-2 does not exist' (HF auditor 3). Blocking, the lossy branch's first commit
    equalled HEAD's and was refused as unchanged: RefNotFoundError for the branch never made (reader 23)."""
    Repository.init(tmp_path / "repo").close()
    callbacks = [CkptCallback(tmp_path / "repo", keep_folders=0, blocking=blocking),
                 CkptCallback(tmp_path / "repo", branch="lossy", lossy="balanced", min_elements=1, blocking=blocking)]
    _trainer(tmp_path / "out", callbacks, steps=6).train()
    with Repository.open(tmp_path / "repo") as repo:
        for branch in ("main", "lossy"):
            assert [c.step for c in repo.log(branch)][:3] == [6, 4, 2]
        # the Trainer's model and optimizer pair the folder's weights, which model.safetensors lists by name
        assert repo.show("lossy")["pairing"] == "given by the caller"
    assert not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("lossy", [None, "balanced"])
def test_keep_folders_keeps_each_folder_committed_lossy_and_warns_once(tmp_path, lossy):
    """keep_folders deleted folders committed at the repository's default lossy level, or lossy=: the only exact
    copy went, and a resume from the store no longer continued exactly (auditor helper 296)."""
    Repository.init(tmp_path / "repo", lossy="balanced" if lossy is None else "").close()
    recorder = FolderBytes()
    callbacks = [recorder, CkptCallback(tmp_path / "repo", lossy=lossy, keep_folders=1, min_elements=1)]
    with pytest.warns(RuntimeWarning, match=r"checkpoint-2 was committed lossy \(balanced\)") as caught:
        _trainer(tmp_path / "out", callbacks, steps=6).train()
    assert sum("committed lossy" in str(w.message) for w in caught) == 1
    for step in (2, 4, 6):
        assert _digests(tmp_path / "out" / f"checkpoint-{step}") == recorder.saved[step]


def test_keep_folders_deletes_folders_committed_lossless_in_a_lossy_default_repository(tmp_path):
    Repository.init(tmp_path / "repo", lossy="balanced").close()
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo", lossy="none", keep_folders=1)], steps=6).train()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["checkpoint-6"]


@pytest.mark.parametrize("best", [True, False])
def test_the_last_save_of_a_save_total_limit_1_run_is_pruned_only_once_training_ends(tmp_path, best):
    """With keep_folders=0 the last folder was deleted inside on_save, under a later callback's own on_save:
    FileNotFoundError ended train() (HF auditor 3). Without a best model nothing deletes it before on_train_end:
    its commit begins after on_save, so a later callback's files are in it."""
    Repository.init(tmp_path / "repo").close()
    evaluated = {"eval_dataset": _tokens()[:4], "eval_strategy": "steps", "eval_steps": 2,
                 "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "greater_is_better": True}
    _trainer(tmp_path / "out", [CkptCallback(tmp_path / "repo", keep_folders=0), WritesTokenizer()], steps=4,
             save_total_limit=1, **(evaluated if best else {})).train()
    with Repository.open(tmp_path / "repo") as repo:
        last = repo.log("main")[0]
        assert last.step == 4 and ("tokenizer.json" in {f.name for f in repo.manifest(last.id).files}) == (not best)
    assert [p.name for p in (tmp_path / "out").iterdir()] == (["checkpoint-2"] if best else [])


_TERMINATED_RUN = """
import sys
import time
from pathlib import Path
from transformers import TrainerCallback
from ckptstore.integrations.hf import CkptCallback
from tests.integrations.test_hf import _trainer


class SlowUpload(TrainerCallback):  # a callback copying checkpoint-N away in its on_save
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 4:
            (root / "uploading").touch()
            time.sleep(60)


root = Path(sys.argv[1])
_trainer(root / "out", [CkptCallback(root / "repo"), SlowUpload()], steps=8).train()
"""


def test_a_sigterm_between_a_save_and_the_next_hook_commits_the_save_and_exits_143(tmp_path):
    """SLURM's or Kubernetes' SIGTERM while a later callback ran its on_save killed the process at once: the
    save, whose commit begins at the next hook, was in no commit (HF auditor 3)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ckpt_env

    Repository.init(tmp_path / "repo").close()
    job = subprocess.Popen([sys.executable, "-c", _TERMINATED_RUN, str(tmp_path)], env=ckpt_env(),
                           cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "uploading").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 143, err
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [4, 2]


def test_the_folder_a_run_resumed_from_is_known_though_its_history_logged_a_nan_loss(tmp_path):
    """Its trainer_state.json is compared with the loaded state: both read NaN as json's one NaN object, equal."""
    from ckptstore.integrations.hf import _resumed_from

    state = TrainerState(global_step=2, log_history=[{"loss": float("nan"), "step": 2}])
    (tmp_path / "checkpoint-2").mkdir()
    state.save_to_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    loaded = TrainerState.load_from_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    assert _resumed_from(tmp_path / "checkpoint-2", loaded, None)  # no weights file: the state alone tells
    loaded.log_history[0]["loss"] = 1.0
    assert not _resumed_from(tmp_path / "checkpoint-2", loaded, None)


_TERMINATED_IN_A_COMMIT = """
import sys
from pathlib import Path
from ckptstore.integrations.hf import CkptCallback
from tests.integrations.test_hf import _trainer

root = Path(sys.argv[1])
callbacks = [CkptCallback(root / "repo", blocking=True),
             CkptCallback(root / "repo", branch="lossy", lossy="balanced", min_elements=1, blocking=True)]
_trainer(root / "out", callbacks, steps=8).train()
"""


def test_a_sigterm_inside_a_blocking_commit_leaves_it_to_the_exit_which_commits_every_waiting_save(tmp_path):
    """The SIGTERM's exit cut main's blocking commit of checkpoint-2 short while the lossy branch's waited: exit
    143, the lossy branch committed and main's save in no commit, unsaid (reader 23)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ckpt_env

    Repository.init(tmp_path / "repo").close()
    gate = tmp_path / "gate"
    job = subprocess.Popen([sys.executable, "-c", _TERMINATED_IN_A_COMMIT, str(tmp_path)],
                           env=ckpt_env(CKPT_WAIT_AT=f"commit:read={gate}"), cwd=Path(__file__).parents[2],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not Path(f"{gate}.reached").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    gate.touch()
    _, err = job.communicate(timeout=120)
    assert job.returncode == 143, err
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [2] and [c.step for c in repo.log("lossy")][0] == 2


_TERMINATED_TWICE = """
import os
import sys
import time
from pathlib import Path
from transformers import TrainerCallback
from ckptstore.integrations.hf import CkptCallback
from tests.integrations.test_hf import _trainer


class SlowUpload(TrainerCallback):  # a callback copying checkpoint-N away in its on_save
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 4:
            os.environ["CKPT_WAIT_AT"] = f"commit:read={root / 'gate'}"  # the exit's commit of it waits there
            (root / "uploading").touch()
            time.sleep(60)


root = Path(sys.argv[1])
callbacks = [CkptCallback(root / "repo"), CkptCallback(root / "repo", branch="lossy", lossy="balanced", min_elements=1),
             SlowUpload()]
_trainer(root / "out", callbacks, steps=8).train()
"""


def test_a_second_sigterm_while_the_exit_commits_the_waiting_saves_leaves_them_on_disk_without_a_traceback(
        tmp_path):
    """The SystemExit of a second SIGTERM (a scheduler's) while the exit hook committed the saves the first one
    left waiting escaped the hook: Python printed it as a traceback through ckptstore and skipped the hooks
    after it (auditor 358). The exit now says which folders it left, and ends with the first SIGTERM's 143."""
    import signal
    import subprocess
    import sys
    import time

    from ckptstore.repo import fsck
    from tests.conftest import ckpt_env, end_left_running

    Repository.init(tmp_path / "repo").close()
    job = subprocess.Popen([sys.executable, "-c", _TERMINATED_TWICE, str(tmp_path)], env=ckpt_env(),
                           cwd=Path(__file__).parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "uploading").exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)  # the exit begins, and commits checkpoint-4 in its hook
        while not (tmp_path / "gate.reached").exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        (tmp_path / "gate").touch()
        _, err = job.communicate(timeout=120)
    finally:
        end_left_running([job])
    assert job.returncode == 143 and "Traceback" not in err, err
    assert f"not committed: {tmp_path / 'out' / 'checkpoint-4'}; they stay on disk" in err
    assert (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").exists()
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.step for c in repo.log("main")] == [2] and [c.step for c in repo.log("lossy")] == [2]
        assert fsck(repo).ok


def test_a_wrong_repository_is_said_when_training_begins(tmp_path):
    """A path naming no repository was said at the first save, after its steps had run (DDP integrations auditor)."""
    from ckptstore.errors import RepoNotFoundError

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    with pytest.raises(RepoNotFoundError):
        CkptCallback(tmp_path / "no-repository").on_train_begin(args, TrainerState(), None)
    CkptCallback(tmp_path / "no-repository").on_train_begin(args, TrainerState(is_world_process_zero=False), None)


def test_a_run_resumed_from_a_lossy_commits_own_folder_goes_on_from_that_commit(tmp_path):
    """The folder keep_folders left of a lossy commit is in no file row (the store gives other bytes back): a run
    resumed from it committed it again, on the tip, unsaid (reviewer 441)."""
    store, out = tmp_path / "store", tmp_path / "out"
    Repository.init(store).close()
    _trainer(out, [CkptCallback(store, lossy="balanced", min_elements=1, blocking=True)]).train()
    with Repository.open(store) as repo:
        at = {c.step: c.id for c in repo.log("main")}
    _trainer(out, [CkptCallback(store, branch="retry", lossy="balanced", min_elements=1, blocking=True)]).train(
        resume_from_checkpoint=str(out / "checkpoint-4"))
    with Repository.open(store) as repo:
        assert [c.step for c in repo.log("retry")] == [8, 6, 4, 2] and repo.log("retry")[2].id == at[4]
        assert repo.resolve("main") == at[8]


def test_a_run_resumed_after_restore_made_a_branch_but_committing_to_another_is_warned_of(run, tmp_path):
    """restore(branch=NAME) said nothing (the branch was made) and the callback, not given the branch, took the
    folder as said already: the resumed run went on from main's tip unsaid (reviewer 441)."""
    store = tmp_path / "store"
    shutil.copytree(run.repo, store)
    with Repository.open(store) as repo:
        at = {c.step: c.id for c in repo.log("main")}
        folder = restore(repo, at[4], tmp_path / "out", branch="resumed-here")
    with pytest.warns(RuntimeWarning, match=r"resumed from checkpoint-4 \(.*not the tip of branch 'main'"):
        _trainer(tmp_path / "out", [CkptCallback(store, blocking=True)]).train(resume_from_checkpoint=str(folder))
