"""`ckpt watch`: commit what a training job writes, each checkpoint once it is complete, never twice."""

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptstore.cli import cli
from ckptstore.errors import CheckpointFormatError, CkptError
from ckptstore.formats.atomic import atomic_write
from ckptstore.formats.torchfile import numpy_safe_globals
from ckptstore.repo import watch as watch_module
from ckptstore.repo.config import RetentionPolicy
from ckptstore.repo.pruning import prune
from ckptstore.repo.watch import WatchOptions, file_incomplete, step_of
from ckptstore.repo.watch import watch_folder as watch
from tests.conftest import Trainer, assert_same, ckpt_env, ckpt_here

ONCE = WatchOptions(interval=0.05, once=True)


def _load(path):
    with torch.serialization.safe_globals(numpy_safe_globals()):
        return torch.load(path, weights_only=True)


def _keeping_last(folder: Path, count: int) -> None:
    """A repository at `folder` whose [retention] keeps the last `count` commits (pruned after each commit)."""
    from ckptstore import Repository

    Repository.init(folder).close()
    with open(folder / ".ckpt" / "config.toml", "a") as config:
        config.write(f"\n[retention]\nkeep_last = {count}\n")


def _run_with_one_trainer_folder(tmp_path: Path) -> Path:
    """A run folder holding Trainer's checkpoint-10, after one step."""
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer()
    trainer.train(1)
    _trainer_folder(run / "checkpoint-10", trainer)
    return run


def _trainer_folder(folder: Path, trainer: Trainer, with_state: bool = True) -> None:
    """A checkpoint-N folder in the order Trainer._save_checkpoint writes it (trainer_state.json last)."""
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, folder / "model.safetensors")
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    if with_state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer.step}))


def test_half_written_checkpoints_wait_and_are_committed_once_complete(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer()
    trainer.train(2)
    torch.save(trainer.state(), tmp_path / "full.pt")
    whole = (tmp_path / "full.pt").read_bytes()
    (run / "model_step20.pt").write_bytes(whole[: len(whole) // 2])  # torch.save still writing
    _trainer_folder(run / "checkpoint-30", trainer, with_state=False)  # Trainer still writing

    report = watch(repo, run, ONCE)
    assert report.committed == [] and repo.head()[1] is None
    assert "central directory" in report.waiting["model_step20.pt"]
    assert "trainer_state.json" in report.waiting["checkpoint-30"]

    (run / "model_step20.pt").write_bytes(whole)
    (run / "checkpoint-30" / "trainer_state.json").write_text(json.dumps({"global_step": 31}))
    report = watch(repo, run, ONCE)
    assert [(name, step) for name, _, step in report.committed] == [("model_step20.pt", 20), ("checkpoint-30", 31)]
    assert report.waiting == {}
    file_commit, folder_commit = (cid for _, cid, _ in report.committed)
    assert_same(repo.checkout(file_commit), _load(run / "model_step20.pt"))
    out = tmp_path / "out"
    repo.checkout_to(folder_commit, out)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        assert (out / name).read_bytes() == (run / "checkpoint-30" / name).read_bytes()
    assert [c.step for c in repo.log()] == [31, 20]


def _cli_env(repo, **extra):
    return ckpt_env(CKPT_REPO=str(repo.root), **extra)


def test_restart_commits_nothing_twice_even_after_a_kill_between_commit_and_record(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer()
    for step in (1, 2):
        trainer.train(1)
        torch.save(trainer.state(), run / f"step={step}.ckpt")
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "watch", str(run), "--once", "--interval", "0.05"],
                            env=_cli_env(repo, CKPT_CRASH_AT="commit:ref-moved"), capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL  # killed once step=1 was committed, before the watch recorded it
    assert [c.step for c in repo.log()] == [1] and not list((repo.dir / "watch").glob("*.json"))
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["step=2.ckpt"]  # step=1: found committed
    assert watch(repo, run, ONCE).committed == []  # restarted again: the state file says both are done
    assert [c.step for c in repo.log()] == [2, 1]

    trainer.train(1)
    torch.save(trainer.state(), run / "step=2.ckpt")  # rewritten in place (like last.ckpt): a new checkpoint
    (committed,) = watch(repo, run, ONCE).committed
    assert committed[0] == "step=2.ckpt" and len(repo.log()) == 3
    assert_same(repo.checkout(committed[1]), _load(run / "step=2.ckpt"))


def test_a_scan_does_not_read_what_is_already_committed(repo, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer()
    trainer.train(1)
    torch.save(trainer.state(), run / "model_1.pt")
    _trainer_folder(run / "checkpoint-1", trainer)
    assert len(watch(repo, run, ONCE).committed) == 2
    read = []

    def counted(real):
        return lambda path: read.append(Path(path).relative_to(run).as_posix()) or real(path)

    monkeypatch.setattr(watch_module, "file_incomplete", counted(watch_module.file_incomplete))
    monkeypatch.setattr(watch_module, "_trainer_state", counted(watch_module._trainer_state))
    assert watch(repo, run, ONCE).committed == []  # restarted: the state file says both are done
    assert read == []
    torch.save(trainer.state(), run / "model_2.pt")  # a new one is read (twice: two scans), the old ones still not
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["model_2.pt"]
    assert read == ["model_2.pt", "model_2.pt"]


def test_legacy_and_safetensors_files_a_branch_and_steps_from_names(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    legacy = run / "legacy.pt"  # no zip end marker: only stability across two scans can tell
    torch.save({"w": torch.ones(4)}, legacy, _use_new_zipfile_serialization=False)
    assert file_incomplete(legacy) == ""
    (run / "notes.bin").write_bytes(b"not a checkpoint")  # refused, said, and not tried again until it changes
    said = []
    before = watch(repo, run, WatchOptions(interval=0.05, once=True, branch="side"), say=said.append)
    assert len(before.committed) == 1 and repo.head()[1] is None  # --branch: HEAD's branch stays unborn
    assert any(line.startswith("notes.bin: not committed") for line in said)
    said.clear()
    assert watch(repo, run, WatchOptions(interval=0.05, once=True, branch="side"), say=said.append).committed == []
    assert said == []
    save_file({"w": torch.ones(8)}, run / "w.safetensors")
    data = (run / "w.safetensors").read_bytes()
    (run / "w.safetensors").write_bytes(data[:-4])
    assert "not all written" in file_incomplete(run / "w.safetensors")
    assert [step_of(n) for n in ("checkpoint-500", "epoch=3-step=1200.ckpt", "model_7.pt", "last.ckpt",
                                 "run_123456789012345678901.pt")] == [500, 1200, 7, None, None]  # past int64: no step
    # Lightning's "{epoch}-{val_loss:.2f}" template: neither the epoch nor the metric's decimals are a step
    assert [step_of(n) for n in ("epoch=3-val_loss=0.1234.ckpt", "epoch_12.pt", "ckpt_100_loss1.5.pt",
                                 "epoch=0-val_acc=0.95-v1.ckpt", "last-v1.ckpt", "model.5000.pt")] == [
        None, None, 100, None, None, 5000]
    # a number that is part of a word, an exponent or a negative value is no step either
    assert [step_of(n) for n in ("gpt2-final.pt", "gpt2-medium-epoch=3.ckpt", "resnet50_epoch10.pt",
                                 "llama-7b.safetensors", "epoch=3-lr=1e-05.ckpt", "fold2_epoch10.pt", "step=-5.pt",
                                 "ckpt-000123.pt", "run 42.pt")] == [None, None, None, None, None, None, None, 123, 42]
    with pytest.raises(CkptError, match="past what the metadata holds"):
        repo.commit({"w": torch.ones(4)}, step=1 << 70)


def _watching_once_ckpt_1_is_committed(repo, run: Path) -> tuple[subprocess.Popen, list[str]]:
    """A `ckpt watch` of `run` (holding ckpt-1.pt) in its own process, and its lines up to ckpt-1.pt's commit."""
    torch.save({"w": torch.arange(10.0)}, run / "ckpt-1.pt")
    process = subprocess.Popen([sys.executable, "-m", "ckptstore", "watch", str(run), "--interval", "0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_cli_env(repo))
    lines = []
    deadline = time.monotonic() + 60
    while not any("ckpt-1.pt" in line for line in lines) and time.monotonic() < deadline:
        lines.append(process.stdout.readline())
    return process, lines


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_ends_the_watch_after_the_current_commit_with_exit_code_0(repo, tmp_path, signum):
    """And SIGTERM (systemd's stop, scancel) as Ctrl-C: it ended the commit in progress with 'interrupted'
    (reviewer 435)."""
    run = tmp_path / "run"
    run.mkdir()
    process, lines = _watching_once_ckpt_1_is_committed(repo, run)
    try:
        process.send_signal(signum)
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, "".join(lines) + out
    said = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"stopped on {said}: 1 checkpoint(s) committed" in out
    assert "Traceback" not in "".join(lines) + out
    assert len(repo.log()) == 1


def test_a_second_watcher_of_one_folder_is_refused_while_the_first_runs(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first, _ = _watching_once_ckpt_1_is_committed(repo, run)
    try:
        torch.save({"w": torch.arange(11.0)}, run / "ckpt-2.pt")
        with pytest.raises(CkptError, match=rf"another `ckpt watch` \(process {first.pid}\) is watching"):
            watch(repo, run, ONCE)  # two watchers: the second's commit of ckpt-1 could land on top of ckpt-2
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=30)
    finally:
        first.kill()
    assert [c.message for c in repo.log()][-1] == "watch: ckpt-1.pt"
    watch(repo, run, ONCE)  # the first one gone, its lock goes with it
    assert sorted(c.message for c in repo.log()) == ["watch: ckpt-1.pt", "watch: ckpt-2.pt"]


def test_cli_watch_once(repo, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "a.pt")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["watch", str(run), "--once", "--interval", "0.05"])
    assert result.exit_code == 0, result.output
    assert "a.pt" in result.output and "done: 1 checkpoint(s) committed" in result.output



def test_watch_once_whose_commit_met_another_writer_exits_3_naming_what_it_left(repo, tmp_path):
    """--once exited 0 after a checkpoint lost its commit to another writer: nothing said it stayed uncommitted
    (auditor helper 268, left low at stop 61)."""
    from tests.conftest import wait_until_held

    run, gate = tmp_path / "run", tmp_path / "gate"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "a.pt")
    watching = subprocess.Popen([sys.executable, "-m", "ckptstore", "watch", str(run), "--once", "--interval", "0.05"],
                                cwd=tmp_path, env={**ckpt_env(), "CKPT_WAIT_AT": f"commit:manifest-written={gate}"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_held(gate, watching)
    other = repo.commit({"w": torch.zeros(3)})  # another writer moves the branch meanwhile
    gate.touch()
    out, err = watching.communicate(timeout=120)
    assert watching.returncode == 3, (out, err)
    assert "a.pt: not committed, another writer moved the branch meanwhile; run `ckpt watch --once` again" in err
    assert [c.id for c in repo.log()] == [other]
    assert ckpt_here(tmp_path, "watch", str(run), "--once", "--interval", "0.05").returncode == 0
    assert [c.message for c in repo.log()][0] == "watch: a.pt"

def test_a_newline_or_backslash_in_a_watched_name_is_written_out_not_a_line_of_its_own(repo, tmp_path):
    """A file "x\\n[0123456789ab] fake.pt" printed "waiting: x", then a line that looked like a commit (auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "y\n[0123456789ab] forged.pt")
    torch.save({"w": torch.zeros(3)}, run / "z\\n.pt")  # a backslash and an n: not to be read as a newline
    (run / "x\n[0123456789ab] fake.pt").write_bytes(b"PK")  # half-written: waits
    result = ckpt_here(tmp_path, "watch", "run", "--once", "--interval", "0.05", env=_cli_env(repo))
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and not any(line.startswith("[0123456789ab]") for line in lines), lines
    # its digits are part of a word: no step
    assert any(line.endswith("] y\\n[0123456789ab] forged.pt") for line in lines), lines
    assert any(line.endswith("] z\\\\n.pt") for line in lines), lines
    assert any(line.startswith("waiting: x\\n[0123456789ab] fake.pt: ") for line in lines), lines


def test_a_full_disk_after_a_commit_says_the_commit_and_a_restart_finds_it_committed(repo, tmp_path, monkeypatch):
    """The watch's record failing (ENOSPC) after a commit hid the commit's line: only "nothing was lost" (auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "step_2.pt")
    record = watch_module.WatchState.record

    def disk_full(self, source, commit):
        if commit is not None:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        record(self, source, commit)

    monkeypatch.setattr(watch_module.WatchState, "record", disk_full)
    result = ckpt_here(tmp_path, "watch", "run", "--once", "--interval", "0.05", env=_cli_env(repo))
    (cid,) = [c.id for c in repo.log()]
    assert result.returncode == 1 and "the disk is full" in result.stderr, result.stderr
    assert result.stdout.splitlines() == [
        f"[{cid[:12]}] step_2.pt (step 2)",
        f"committed step_2.pt ({cid[:12]}); the watch's record of it could not be written (No space left on "
        "device): a restart finds it committed"], result.stdout
    monkeypatch.setattr(watch_module.WatchState, "record", record)
    assert watch(repo, run, ONCE).committed == [] and len(repo.log()) == 1


def test_a_watch_walks_its_branch_once_and_writes_its_records_once_a_pass(repo, tmp_path, monkeypatch):
    """Each new source walked the branch's history and each commit rewrote the whole record: a first watch of 1,600
    files took 38 s, growing as their square (scale auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    for step in range(6):
        torch.save({"w": torch.full((4,), float(step))}, run / f"step_{step}.pt")
    walks, writes = [], []
    log, atomic_write = type(repo).log, watch_module.atomic_write
    monkeypatch.setattr(type(repo), "log", lambda self, *a, **k: walks.append(a) or log(self, *a, **k))
    monkeypatch.setattr(watch_module, "atomic_write",
                        lambda path, fill: writes.append(path) or atomic_write(path, fill))
    monkeypatch.setattr(watch_module, "SAVE_EVERY_SECONDS", 3600.0)
    assert len(watch(repo, run, ONCE).committed) == 6
    assert len(walks) == 1 and len(writes) == 1, (walks, writes)
    record = json.loads(writes[0].read_text())["sources"]
    assert sorted(record) == [f"step_{step}.pt" for step in range(6)]
    assert {known["commit"] for known in record.values()} == {c.id for c in log(repo)}


def test_a_records_write_failing_after_a_pass_says_its_commits(repo, tmp_path, monkeypatch):
    """The records are written once a pass: a full disk then names the commits a restart will find."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 3):
        torch.save({"w": torch.full((3,), float(step))}, run / f"step_{step}.pt")

    def disk_full(path, fill):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(watch_module, "SAVE_EVERY_SECONDS", 3600.0)
    monkeypatch.setattr(watch_module, "atomic_write", disk_full)
    said = []
    with pytest.raises(OSError, match="No space left"):
        watch(repo, run, ONCE, say=said.append)
    assert said[-1] == ("the watch's record of step_2.pt, step_3.pt could not be written (No space left on device): "
                        "a restart finds them committed"), said
    monkeypatch.undo()
    assert watch(repo, run, ONCE).committed == [] and len(repo.log()) == 2


def test_watch_refuses_a_file(repo, tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x")
    with pytest.raises(CkptError, match="not a folder"):
        watch(repo, tmp_path / "a.pt", ONCE)


def test_a_file_cut_off_after_an_inner_zip_waits_and_a_commit_of_it_is_refused(repo, tmp_path):
    inner = io.BytesIO()
    torch.save({"fp8_meta": torch.ones(3)}, inner)  # a torch.save'd blob kept as a uint8 tensor (TransformerEngine)
    state = {"extra_state": torch.frombuffer(bytearray(inner.getvalue()), dtype=torch.uint8), "w": torch.randn(64, 64)}
    torch.save(state, tmp_path / "full.pt")
    whole = (tmp_path / "full.pt").read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    cut = whole[: whole.find(inner.getvalue()) + len(inner.getvalue())]  # zipfile alone reads this as the inner zip
    (run / "model_step5.pt").write_bytes(cut)
    assert file_incomplete(run / "model_step5.pt")
    report = watch(repo, run, ONCE)
    assert report.committed == [] and "model_step5.pt" in report.waiting
    with pytest.raises(CheckpointFormatError, match="not a whole torch.save file"):
        repo.commit(run / "model_step5.pt")
    (run / "model_step5.pt").write_bytes(whole)
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["model_step5.pt"]
    (tmp_path / "padded.pt").write_bytes(whole + bytes(16))  # bytes after the end record: torch.load reads it
    assert file_incomplete(tmp_path / "padded.pt") == ""
    assert_same(repo.checkout(repo.commit(tmp_path / "padded.pt")), _load(tmp_path / "full.pt"))


def test_a_safetensors_file_with_a_malformed_header_is_reported_and_the_rest_committed(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    header = b"[]"
    (run / "odd.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    torch.save({"w": torch.ones(4)}, run / "model_step3.pt")
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert [name for name, _, _ in report.committed] == ["model_step3.pt"]
    assert any(line.startswith("odd.safetensors: not committed") for line in said)


def test_a_complete_file_named_safetensors_that_is_none_is_reported_not_waited_for(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.safetensors").write_text("this is a note, not tensors\n")
    torch.save({"w": torch.ones(4)}, run / "renamed.safetensors")  # a zip: its first 8 bytes read as a huge length
    assert file_incomplete(run / "notes.safetensors") == file_incomplete(run / "renamed.safetensors") == ""
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert report.waiting == {}  # both were "its header is not written yet" for ever
    assert [name for name, _, _ in report.committed] == ["renamed.safetensors"]  # as `ckpt commit` takes it
    assert [line.split(":")[0] for line in said if ": not committed" in line] == ["notes.safetensors"]


def test_upper_case_suffixes_are_watched_and_an_interval_of_zero_is_refused(repo, tmp_path):
    """MODEL.PT was passed over without a word; `--interval 0` rescanned without pause (auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(4)}, run / "MODEL_7.PT")
    save_file({"w": torch.zeros(4)}, run / "Weights.SafeTensors")
    report = watch(repo, run, ONCE)
    assert sorted((name, step) for name, _, step in report.committed) == [("MODEL_7.PT", 7), ("Weights.SafeTensors",
                                                                                              None)]
    refused = ckpt_here(tmp_path, "watch", "run", "--interval", "0", env=_cli_env(repo))
    assert refused.returncode == 2 and "--interval" in refused.stderr and "Traceback" not in refused.stderr


def test_a_file_rewritten_back_to_an_earlier_content_is_committed_again(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for value in (1.0, 2.0, 1.0):
        torch.save({"w": torch.full((4,), value)}, run / "last.pt")
        assert len(watch(repo, run, ONCE).committed) == 1
        assert_same(repo.checkout("HEAD"), {"w": torch.full((4,), value)})


def test_a_folder_rotated_away_while_it_is_committed_is_refused_not_kept_in_part(repo, tmp_path, monkeypatch):
    """Trainer's rotation removing files as the commit lists the folder: the watch kept the commit without them (the
    branch's tip a checkpoint without its optimizer state) and said so after (auditor 391). Now it is refused."""
    run = _run_with_one_trainer_folder(tmp_path)
    commit = watch_module.commit_whole

    def rotated(repo, source, options):  # rmtree got through one file when the commit lists the folder
        (run / "checkpoint-10" / "optimizer.pt").unlink()
        return commit(repo, source, options)

    monkeypatch.setattr(watch_module, "commit_whole", rotated)
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert report.committed == [] and repo.log() == []
    assert any("checkpoint-10: not committed" in line and "optimizer.pt" in line and "removed while it was committed"
               in line for line in said), said


def test_one_source_that_cannot_be_committed_never_stops_the_others(repo, tmp_path, monkeypatch):
    """A name that is not UTF-8, a step past what the metadata holds, a file rotated away as it is re-checked:
    each ended the whole watch, on every restart too; now each is said and the rest are committed."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(2)}, os.fsdecode(os.fsencode(run) + b"/r\xe9sum\xe9.pt"))  # a Latin-1 name
    trainer = Trainer()
    trainer.train(1)
    _trainer_folder(run / "checkpoint-7", trainer)
    (run / "checkpoint-7" / "trainer_state.json").write_text(json.dumps({"global_step": 1 << 64}))
    torch.save({"w": torch.zeros(2)}, run / "last.pt")
    said = []
    watch(repo, run, ONCE, say=said.append)
    torch.save({"w": torch.full((2,), 2.0)}, run / "last.pt")  # re-saved: checked against the branch first
    torch.save({"w": torch.full((2,), 3.0)}, run / "z_final.pt")
    digest = watch_module.file_digest

    def rotated_as_it_is_read(path):
        if path.endswith("last.pt"):
            os.unlink(path)
        return digest(path)

    monkeypatch.setattr(watch_module, "file_digest", rotated_as_it_is_read)
    report = watch(repo, run, ONCE, say=said.append)
    monkeypatch.undo()
    assert [name for name, _, _ in report.committed] == ["z_final.pt"], said
    assert "r\\xe9sum\\xe9.pt: not committed" in " ".join(said) and "last.pt: not committed" in " ".join(said)
    steps = {c.message: c.step for c in repo.log()}
    assert steps["watch: checkpoint-7"] == 7  # from the name, as the state's step does not fit
    said.clear()
    assert watch(repo, run, ONCE, say=said.append).committed == [] and said == []  # a restart tries none again


def test_a_watched_folder_that_goes_away_ends_the_watch_in_one_line(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(2)}, run / "a.pt")

    def removed_after_the_first_scan(seconds):
        if run.exists():
            (run / "a.pt").unlink()
            run.rmdir()
        return False

    stop = type("Stop", (), {"wait": staticmethod(removed_after_the_first_scan), "is_set": lambda self: False})()
    with pytest.raises(CkptError, match="the watched folder, went away; what was committed stays"):
        watch(repo, run, WatchOptions(interval=0.01), stop=stop)


def _stop_after(scans: int):
    """A stop event that is set after `scans` scans of a watch."""
    import threading

    class Stop(threading.Event):
        def wait(self, timeout=None):
            nonlocal scans
            scans -= 1
            if scans < 0:
                self.set()
            return self.is_set()

    return Stop()


def test_an_unreadable_source_is_tried_again_at_each_scan(repo, tmp_path, monkeypatch):
    """Access given back changes neither size nor time: a source remembered as refused was never committed."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(2)}, run / "a.pt")
    commit = watch_module.commit_whole

    def unreadable_once(repo, source, options):
        monkeypatch.setattr(watch_module, "commit_whole", commit)
        raise PermissionError(13, "Permission denied", str(source.path))

    tries = []

    def unreadable(repo, source, options):
        tries.append(source.path)
        raise PermissionError(13, "Permission denied", str(source.path))

    monkeypatch.setattr(watch_module, "commit_whole", unreadable)
    said = []
    report = watch(repo, run, WatchOptions(interval=0.01), stop=_stop_after(3), say=said.append)
    assert report.committed == [] and len(said) == 1 and "a.pt: not committed" in said[0]  # said once, not per scan
    assert len(tries) == 3  # tried at each of the three scans after the first (ready once two scans agree)
    monkeypatch.setattr(watch_module, "commit_whole", unreadable_once)
    assert watch(repo, run, ONCE).committed == []
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["a.pt"]
    monkeypatch.setattr(watch_module, "commit_whole", lambda *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(repo.dir / "ckpt.db"))))
    torch.save({"w": torch.zeros(2)}, run / "b.pt")
    with pytest.raises(PermissionError):  # the repository's own files: the watch ends
        watch(repo, run, ONCE)


def test_a_file_rewritten_after_retention_pruned_its_last_commit_is_committed(tmp_path):
    """The watch read the pruned commit's manifest (gone) and ended with "object missing", at every rerun.

    Lightning's layout under a policy: `last.ckpt` rewritten beside new `epoch=N` files.
    """
    from ckptstore import Repository

    _keeping_last(tmp_path / "repo", 1)
    run = tmp_path / "run"
    run.mkdir()
    with Repository.open(tmp_path / "repo") as repo:
        torch.save({"w": torch.full((4,), 1.0)}, run / "last.ckpt")
        assert len(watch(repo, run, ONCE).committed) == 1
        torch.save({"w": torch.full((4,), 2.0)}, run / "epoch=2.pt")
        assert len(watch(repo, run, ONCE).committed) == 1  # the policy prunes last.ckpt's commit
        assert repo.log()[1].pruned
        torch.save({"w": torch.full((4,), 3.0)}, run / "last.ckpt")
        assert len(watch(repo, run, ONCE).committed) == 1
        assert_same(repo.checkout("HEAD"), {"w": torch.full((4,), 3.0)})
        assert len(watch(repo, run, ONCE).committed) == 0  # and once only


def _saving_over_in_place(repo, tmp_path) -> tuple[Path, Path, Trainer]:
    """A Trainer folder committed by the watch, then saved again (a resumed run) as far as its new weights."""
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer()
    _trainer_folder(run / "checkpoint-100", trainer)
    assert len(watch(repo, run, ONCE).committed) == 1
    trainer.train(1)
    folder = run / "checkpoint-100"
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, folder / "model.safetensors")
    return run, folder, trainer


def test_a_trainer_folder_saved_over_in_place_is_committed_only_once_whole_again(repo, tmp_path):
    """New weights beside the old optimizer and the old (still parsing) trainer_state.json were committed (auditor)."""
    run, folder, trainer = _saving_over_in_place(repo, tmp_path)
    for _ in range(2):  # a pause of two scans before the optimizer comes
        report = watch(repo, run, ONCE)
        assert report.committed == [] and "saved over in place" in report.waiting["checkpoint-100"]
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer.step}))
    assert len(watch(repo, run, ONCE).committed) == 1
    restored = repo.checkout("HEAD")
    assert_same(restored["optimizer.pt"], trainer.optimizer.state_dict())
    weights = trainer.model.state_dict()
    assert_same(restored["model.safetensors"], {k: weights[k].contiguous() for k in restored["model.safetensors"]})


def test_a_save_over_the_watch_missed_does_not_vouch_for_the_next_ones_first_files(repo, tmp_path):
    """v2 saved over while no watch ran, then a restart amid v3: v3's weights went in with v2's optimizer (reader)."""
    run, folder, trainer = _saving_over_in_place(repo, tmp_path)
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")  # v2, whole, while the watch was stopped
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer.step}))
    earlier = time.time() - 20  # saves 20 s apart: a minute's tolerance let this through (reader)
    for path in folder.iterdir():
        os.utime(path, (earlier, earlier))
    trainer.train(1)  # v3, as far as its weights, then a pause of two scans
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, folder / "model.safetensors")
    for _ in range(2):
        report = watch(repo, run, ONCE)
        assert report.committed == [] and "by a later save" in report.waiting["checkpoint-100"]
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer.step}))
    assert len(watch(repo, run, ONCE).committed) == 1
    assert_same(repo.checkout("HEAD")["optimizer.pt"], trainer.optimizer.state_dict())


def test_symbolic_links_are_listed_as_never_committed(repo, tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    torch.save({"w": torch.ones(3)}, elsewhere / "model_100.pt")
    (run / "model_100.pt").symlink_to(elsewhere / "model_100.pt")
    report = watch(repo, run, ONCE)
    assert report.committed == [] and "symbolic link" in report.waiting["model_100.pt"]


def test_a_folder_saved_over_with_a_file_written_after_trainer_state_is_committed(repo, tmp_path):
    """Older Trainers write rng_state.pth after trainer_state.json, callbacks write adapters: it waited forever."""
    run, folder, trainer = _saving_over_in_place(repo, tmp_path)
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer.step}))
    time.sleep(0.05)  # past the file system's clock tick: a later modification time
    torch.save({"rng": torch.ones(2)}, folder / "rng_state.pth")  # after trainer_state.json
    assert len(watch(repo, run, ONCE).committed) == 1
    assert_same(repo.checkout("HEAD")["optimizer.pt"], trainer.optimizer.state_dict())


def test_a_damaged_entry_in_the_watch_state_is_read_as_no_entry(repo, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _trainer_folder(run / "checkpoint-100", Trainer())
    assert len(watch(repo, run, ONCE).committed) == 1
    (state_file,) = (repo.dir / "watch").glob("*.json")
    record = json.loads(state_file.read_text())
    record["sources"]["checkpoint-100"] = "not a record"
    state_file.write_text(json.dumps(record))
    report = watch(repo, run, ONCE)  # it ended in an AttributeError
    assert report.committed == [] and not report.waiting  # the digests say it is committed already


@pytest.mark.parametrize("weights, optimizer", [("adapter_model.safetensors", "optimizer.pt"),
                                                ("pytorch_model_fsdp.bin", "optimizer.bin")])
def test_a_trainer_folder_of_any_file_names_saved_over_in_place_waits_for_its_trainer_state(repo, tmp_path, weights,
                                                                                         optimizer):
    """6b8f363 judged only files named like Trainer's defaults: PEFT's and FSDP's weights rewritten were committed
    beside the old optimizer (reader)."""
    run = tmp_path / "run"
    folder = run / "checkpoint-100"
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(8)}, folder / weights) if weights.endswith(".safetensors") else \
        torch.save({"w": torch.zeros(8)}, folder / weights)
    torch.save({"m": torch.zeros(8)}, folder / optimizer)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 100}))
    assert len(watch(repo, run, ONCE).committed) == 1
    save_file({"w": torch.ones(8)}, folder / weights) if weights.endswith(".safetensors") else \
        torch.save({"w": torch.ones(8)}, folder / weights)
    report = watch(repo, run, ONCE)
    assert report.committed == [] and "saved over in place" in report.waiting["checkpoint-100"]


def test_a_file_added_to_a_committed_trainer_folder_is_committed_with_it(repo, tmp_path):
    """A callback's file written later, nothing saved over: it waited forever for a new trainer_state.json."""
    run = tmp_path / "run"
    run.mkdir()
    _trainer_folder(run / "checkpoint-100", Trainer())
    assert len(watch(repo, run, ONCE).committed) == 1
    torch.save({"ema": torch.ones(3)}, run / "checkpoint-100" / "extra_state.pt")
    assert len(watch(repo, run, ONCE).committed) == 1
    assert_same(repo.checkout("HEAD")["extra_state.pt"], {"ema": torch.ones(3)})


def test_a_save_over_in_place_under_new_weight_names_waits_for_its_trainer_state(repo, tmp_path):
    """save_pretrained deleted pytorch_model.bin and wrote model.safetensors: that went in with the old
    optimizer and step, the new name taken for a callback's file (auditor)."""
    run, trainer = tmp_path / "run", Trainer()
    folder = run / "checkpoint-4"
    folder.mkdir(parents=True)
    torch.save(trainer.model.state_dict(), folder / "pytorch_model.bin")
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    assert len(watch(repo, run, ONCE).committed) == 1
    trainer.train(1)
    (folder / "pytorch_model.bin").unlink()
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, folder / "model.safetensors")
    report = watch(repo, run, ONCE)
    assert report.committed == [] and "pytorch_model.bin is gone" in report.waiting["checkpoint-4"]
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    assert len(watch(repo, run, ONCE).committed) == 1
    restored = repo.checkout("HEAD")
    assert sorted(restored) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert_same(restored["optimizer.pt"], trainer.optimizer.state_dict())


def test_a_file_added_long_after_an_unchanged_trainer_state_is_taken_for_a_new_saves(repo, tmp_path):
    """A new save's first file under a new name, nothing deleted yet, was committed with the old step's files."""
    run = tmp_path / "run"
    run.mkdir()
    _trainer_folder(run / "checkpoint-100", Trainer())
    earlier = time.time() - 20  # the save 20 s ago: a callback of it would have written by now
    for path in (run / "checkpoint-100").iterdir():
        os.utime(path, (earlier, earlier))
    assert len(watch(repo, run, ONCE).committed) == 1
    torch.save({"w": torch.ones(3)}, run / "checkpoint-100" / "pytorch_model.bin")
    report = watch(repo, run, ONCE)
    assert report.committed == [] and "pytorch_model.bin was written more than 5 s after" in \
        report.waiting["checkpoint-100"]


def test_the_watch_state_forgets_sources_a_rotation_deleted_and_still_commits_nothing_twice(repo, tmp_path):
    """It kept every checkpoint ever seen, and rewrote them all after each commit: O(run) per commit (auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    for step in range(1, 7):
        torch.save({"w": torch.full((64,), float(step))}, run / f"model_{step}.pt")
        for old in sorted(run.glob("model_*.pt"), key=lambda p: int(p.stem.split("_")[1]))[:-2]:
            old.unlink()  # the job keeps its two newest files
        time.sleep(0.05)
        assert len(watch(repo, run, ONCE).committed) == 1
    (state_file,) = (repo.dir / "watch").glob("*.json")
    assert len(json.loads(state_file.read_text())["sources"]) <= 3  # the folder's two, and one gone since
    state_file.unlink()  # a restart with no state at all: the commits themselves say what was done
    assert watch(repo, run, ONCE).committed == [] and len(repo.log()) == 6


def test_a_state_with_more_fields_per_file_still_says_what_is_done(repo, tmp_path):
    """A state written by a version that kept inode and ctime per file (never released: c5594eb, reverted)
    matched nothing, and where the policy had pruned the commits the restarted watch committed them again
    (fourth reader)."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2):
        torch.save({"w": torch.full((4,), float(step))}, run / f"step={step}.ckpt")
    assert len(watch(repo, run, ONCE).committed) == 2
    (state,) = (repo.dir / "watch").glob("*.json")
    record = json.loads(state.read_text())
    for source in record["sources"].values():
        source["signature"] = [entry + [12345, 67890] for entry in source["signature"]]
    state.write_text(json.dumps(record))
    prune(repo, RetentionPolicy(keep_last=1))  # step=1's commit goes: only the state can say it was done
    assert watch(repo, run, ONCE).committed == []


def test_watching_a_trainer_checkpoint_folder_itself_is_refused(repo, tmp_path):
    """`ckpt watch out/checkpoint-10` committed each file alone, before trainer_state.json was written (auditor)."""
    trainer = Trainer()
    trainer.train(1)
    folder = tmp_path / "out" / "checkpoint-10"
    folder.parent.mkdir()
    _trainer_folder(folder, trainer, with_state=False)  # Trainer still saving it
    with pytest.raises(CkptError, match="is a checkpoint folder: watch the folder it is saved in"):
        watch(repo, folder, ONCE)
    result = ckpt_here(tmp_path, "watch", "out/checkpoint-10", "--once", "--interval", "0.05")
    assert result.returncode == 1 and f"({folder.parent})" in result.stderr, result.stderr
    assert f"`ckpt commit {folder}`" in result.stderr and repo.log() == []
    (tmp_path / "out" / "checkpoint_notes").mkdir()  # a name scan() takes for no Trainer folder: watched
    assert watch(repo, tmp_path / "out" / "checkpoint_notes", ONCE).committed == []


def test_watching_a_folder_inside_a_checkpoint_folder_is_refused(repo, tmp_path):
    """`ckpt watch out/checkpoint-30/global_step30` committed DeepSpeed's model and optimizer files apart (auditor)."""
    save = tmp_path / "out" / "checkpoint-30"
    inner = save / "global_step30"
    inner.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(8)}}, inner / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"x": torch.ones(8)}}, inner / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CkptError, match=f"inside the checkpoint folder {save}, whose files are parts of one save"):
        watch(repo, inner, ONCE)
    result = ckpt_here(tmp_path, "watch", "out/checkpoint-30/global_step30", "--once", "--interval", "0.05")
    assert result.returncode == 1 and f"({save.parent})" in result.stderr, result.stderr
    assert f"`ckpt commit {save}`" in result.stderr and repo.log() == []
    deeper = inner / "extra"  # two levels inside the save: refused as well (reader)
    deeper.mkdir()
    with pytest.raises(CkptError, match=f"inside the checkpoint folder {save}"):
        watch(repo, deeper, ONCE)
    project = tmp_path / "checkpoint-2024" / "runs"  # a project named like a save, higher up: watched (reader)
    project.mkdir(parents=True)
    (project.parent / "README.md").write_text("the 2024 runs")
    torch.save({"w": torch.ones(8)}, project / "step_5.pt")
    watch(repo, project, ONCE)
    assert len(repo.log()) == 1


def _denied_on(*paths: Path):
    """A stand-in for a function that opens a file: PermissionError on `paths` (root reads files of any mode)."""
    def opened(real):
        def check(path=".", *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and any(Path(path).is_relative_to(denied) for denied in paths):
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)
        return check
    return opened


def test_an_unreadable_checkpoint_file_is_said_once_and_the_others_are_committed(repo, tmp_path, monkeypatch):
    """One file another user saved under umask 077 ended the watch at its first scan, nothing committed (auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    for step in (10, 20, 30):
        torch.save({"w": torch.full((2,), float(step))}, run / f"step_{step}.pt")
    monkeypatch.setattr(watch_module, "file_incomplete", _denied_on(run / "step_20.pt")(watch_module.file_incomplete))
    said = []
    report = watch(repo, run, WatchOptions(interval=0.01), stop=_stop_after(3), say=said.append)
    assert [name for name, _, _ in report.committed] == ["step_10.pt", "step_30.pt"], said
    denied = [line for line in said if line.startswith("step_20.pt")]
    assert denied == [f"step_20.pt: not committed: permission denied on {run / 'step_20.pt'}; ask for access to it"]
    assert "step_20.pt" not in report.waiting
    monkeypatch.undo()  # access given back: committed, though its size and time are the same
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["step_20.pt"]


def test_an_unreadable_trainer_folder_is_said_once_not_waited_for(repo, tmp_path, monkeypatch):
    """Another user's checkpoint-10 (mode 0700) waited for its trainer_state.json forever, never said (auditor)."""
    run = _run_with_one_trainer_folder(tmp_path)
    torch.save({"w": torch.ones(2)}, run / "step_5.pt")
    folder, listed = run / "checkpoint-10", os.scandir
    monkeypatch.setattr(os, "scandir", _denied_on(folder)(listed))  # it may be neither listed
    monkeypatch.setattr(Path, "read_text", _denied_on(folder)(Path.read_text))  # nor its files read
    said = []
    report = watch(repo, run, WatchOptions(interval=0.01), stop=_stop_after(3), say=said.append)
    assert [name for name, _, _ in report.committed] == ["step_5.pt"] and "checkpoint-10" not in report.waiting
    assert [line for line in said if line.startswith("checkpoint-10")] == [
        f"checkpoint-10: not committed: permission denied on {folder}; ask for access to it"]
    monkeypatch.setattr(os, "scandir", listed)  # listed again, its trainer_state.json still not readable
    said.clear()
    report = watch(repo, run, ONCE, say=said.append)
    assert report.committed == [] and report.waiting == {}
    assert said == [f"checkpoint-10: not committed: permission denied on {folder / 'trainer_state.json'}; "
                    "ask for access to it"]
    monkeypatch.undo()
    assert [(name, step) for name, _, step in watch(repo, run, ONCE).committed] == [("checkpoint-10", 1)]


@pytest.mark.parametrize("signature", ["5", "[[[1], 2, 3]]", None])
def test_a_hand_edited_or_forged_watch_record_is_looked_at_anew(repo, tmp_path, signature):
    """A signature of 5, or entries starting with a list, ended every watch in "unexpected TypeError"; JSON nested
    past reading was called folders nested too deeply (hostile-input auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "step_2.pt")
    assert len(watch(repo, run, ONCE).committed) == 1
    (record,) = (repo.dir / "watch").glob("*.json")
    state = json.loads(record.read_text())
    if signature is None:
        record.write_text("[" * 5_000 + "]" * 5_000)
    else:
        state["sources"]["step_2.pt"]["signature"] = json.loads(signature)
        record.write_text(json.dumps(state))
    torch.save({"w": torch.zeros(3)}, run / "step_3.pt")
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["step_3.pt"]
    assert len(repo.log()) == 2


def test_a_folder_file_still_growing_between_the_two_scans_is_not_committed(repo, tmp_path, monkeypatch):
    """A file of a Trainer folder that grew between the two scans was committed cut short (mutation audit)."""
    run = tmp_path / "run"
    folder = run / "checkpoint-10"
    folder.mkdir(parents=True)
    save_file({"w": torch.ones(8)}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    payload = bytes(range(256)) * 12
    rng = folder / "rng_state.pth"  # an older Trainer writes it after trainer_state.json
    rng.write_bytes(payload[:1024])
    scans, real_scan = [], watch_module.scan

    def scan_as_it_grows(path, state):
        found = real_scan(path, state)
        scans.append(rng.stat().st_size)
        end = {1: 2048, 2: len(payload)}.get(len(scans))  # written on after each of the two scans
        if end is not None:
            with open(rng, "ab") as handle:
                handle.write(payload[rng.stat().st_size:end])
        return found

    monkeypatch.setattr(watch_module, "scan", scan_as_it_grows)
    report = watch(repo, run, ONCE)
    assert scans == [1024, 2048]
    assert report.committed == [] and repo.log() == []
    assert report.waiting == {"checkpoint-10": "changed since the last scan"}
    monkeypatch.undo()
    (committed,) = watch(repo, run, ONCE).committed
    out = tmp_path / "out"
    repo.checkout_to(committed[1], out)
    assert (out / "rng_state.pth").read_bytes() == payload


def test_a_folder_with_an_atomic_writers_temporary_file_waits_until_it_is_renamed(repo, tmp_path):
    """optimizer.pt still in atomic_write's temporary file at both scans: the folder was committed without it
    (mutation audit)."""
    run = tmp_path / "run"
    folder = run / "checkpoint-10"
    folder.mkdir(parents=True)
    save_file({"w": torch.ones(8)}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    reports = []

    def fill(handle):
        handle.write(b"optimizer state")
        handle.flush()
        reports.append(watch(repo, run, ONCE))  # both scans see the temporary file, unchanged

    atomic_write(folder / "optimizer.pt", fill)
    (report,) = reports
    assert report.committed == [] and repo.log() == []
    assert report.waiting["checkpoint-10"].startswith("a file is still being written (.optimizer.pt.")
    (committed,) = watch(repo, run, ONCE).committed
    out = tmp_path / "out"
    repo.checkout_to(committed[1], out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert (out / "optimizer.pt").read_bytes() == b"optimizer state"


def test_shards_of_one_save_training_args_and_deepspeed_step_folders_are_said_and_not_committed(repo, tmp_path):
    """Each shard of a save_pretrained in the watched folder became a checkpoint of its own, with the shard count
    for its step; training_args.bin got advice to pass a --trust-pickle watch does not take; a DeepSpeed
    global_stepN folder committed each file as a checkpoint when watched (other-frameworks auditor)."""
    run = tmp_path / "run"
    run.mkdir()
    for part in (1, 2):
        save_file({f"w{part}": torch.ones(8)}, run / f"model-0000{part}-of-00002.safetensors")
    (run / "model.safetensors.index.json").write_text("{}")
    (run / "training_args.bin").write_bytes(b"\x80\x04pickled arguments")
    (run / "global_step10").mkdir()
    torch.save({"w": torch.ones(4)}, run / "global_step10" / "mp_rank_00_model_states.pt")
    torch.save({"w": torch.ones(4)}, run / "last.pt")
    torch.save({"w": torch.zeros(4)}, run / "fold-1-of-5.pt")  # a k-fold run's: a checkpoint (reader 22)
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert sorted(name for name, _, _ in report.committed) == ["fold-1-of-5.pt", "last.pt"]
    assert report.waiting == {}
    notes = {line.split(":")[0]: line for line in said if "not committed" in line}
    assert set(notes) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                          "training_args.bin", "global_step10"}
    assert "a part of a sharded save" in notes["model-00001-of-00002.safetensors"]
    assert "no checkpoint" in notes["training_args.bin"] and "--trust-pickle" not in notes["training_args.bin"]
    with pytest.raises(CkptError, match="global_step10 is a checkpoint folder: watch the folder it is saved in"):
        watch(repo, run / "global_step10", ONCE)
    assert len(repo.log()) == 2


def test_a_hidden_file_beside_the_checkpoints_is_never_committed(tmp_path):
    """`.scratch_copy.pt` beside model_10.pt became a commit where the hidden-name rule was gone; no test held the
    docstring's promise (mutation audit)."""
    from ckptstore import Repository

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(4)}, run / "model_10.pt")
    torch.save({"w": torch.zeros(4)}, run / ".scratch_copy.pt")
    with Repository.init(tmp_path / "repo") as repo:
        report = watch(repo, run, WatchOptions(interval=0.3, once=True), say=lambda _: None)
    assert [name for name, _, _ in report.committed] == ["model_10.pt"]


def test_a_folder_rotated_away_while_its_files_are_read_is_said_removed_not_still_being_written(repo, tmp_path,
                                                                                             monkeypatch):
    """Trainer's rotation removing the whole folder after the commit listed it: the refusal said the file "changed
    while it was being committed (is a save still writing it?)" and to commit it again (auditor 391)."""
    import shutil

    from ckptstore import faults

    run = _run_with_one_trainer_folder(tmp_path)
    point = faults.point

    def rotation_at_read(name, *args, **kwargs):
        if name == "commit:read" and (run / "checkpoint-10").exists():
            shutil.rmtree(run / "checkpoint-10")
        return point(name, *args, **kwargs)

    monkeypatch.setattr(faults, "point", rotation_at_read)
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert report.committed == [] and repo.log() == []
    assert any("checkpoint-10: not committed" in line and "removed while it was committed" in line
               and "still writing" not in line for line in said), said


def test_a_folder_holding_files_a_commit_leaves_out_is_committed_not_refused_as_rotated(repo, tmp_path):
    """The scan counted a `.git` folder's files, which a commit leaves out, as files the commit must hold: every pass
    refused the folder as "removed while it was committed" and never committed it (reviewer 392)."""
    run = _run_with_one_trainer_folder(tmp_path)
    (run / "checkpoint-10" / ".git").mkdir()
    (run / "checkpoint-10" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert [name for name, _, _ in report.committed] == ["checkpoint-10"], said


@pytest.mark.parametrize("when", ["after the parse", "as it is opened"])
def test_a_file_removed_while_ckpt_commit_reads_its_folder_is_said_in_one_line(repo, tmp_path, monkeypatch, capsys,
                                                                               when):
    """By hand, a tensor file removed as the commit read it reached the user as "unexpected FileNotFoundError …
    please report it", after the parse (reviewer 392) or as the parser opened it (reviewer 393): a refusal."""
    from ckptstore import faults
    from ckptstore.cli.entry import main
    from ckptstore.formats import checkpoint_io

    trainer = Trainer()
    trainer.train(1)
    folder = tmp_path / "checkpoint-10"
    _trainer_folder(folder, trainer)
    point = faults.point

    def removed_at_read(name, *args, **kwargs):
        if name == "commit:read" and (folder / "optimizer.pt").exists():
            (folder / "optimizer.pt").unlink()
        return point(name, *args, **kwargs)

    read_file = checkpoint_io._read_file

    def removed_as_opened(path, name, *args, **kwargs):  # listed by the parser, gone as it comes to open it
        if name == "optimizer.pt":
            (folder / "optimizer.pt").unlink(missing_ok=True)
        return read_file(path, name, *args, **kwargs)

    if when == "after the parse":
        monkeypatch.setattr(faults, "point", removed_at_read)
    else:
        monkeypatch.setattr(checkpoint_io, "_read_file", removed_as_opened)
    monkeypatch.chdir(repo.root)
    with pytest.raises(SystemExit) as ended:
        main(["commit", str(folder)])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and err == f"error: {folder / 'optimizer.pt'} was removed while it was committed " \
        "(a rotation?); nothing was recorded\n", err
    assert repo.log() == []


def test_accelerate_save_state_folders_are_said_and_not_committed_piece_by_piece(repo, tmp_path):
    """Accelerate's checkpoints/checkpoint_N folders were passed over without a word ('0 checkpoints committed'
    beside a training loop), and a watch of one such folder committed model.safetensors and optimizer.bin as two
    checkpoints, neither loadable by load_state (auditor 399)."""
    run = tmp_path / "checkpoints"
    save = run / "checkpoint_0"
    save.mkdir(parents=True)
    save_file({"w": torch.ones(8)}, save / "model.safetensors")
    torch.save({"state": {}}, save / "optimizer.bin")
    torch.save({"python": [1, 2]}, save / "random_states_0.pkl")
    said = []
    report = watch(repo, run, ONCE, say=said.append)
    assert report.committed == [] and any(line.startswith("checkpoint_0:") and "Accelerate save_state" in line
                                          for line in said), said
    with pytest.raises(CkptError, match="checkpoint_0 is a checkpoint folder: watch the folder it is saved in"):
        watch(repo, save, ONCE)
    assert repo.log() == []


def test_a_save_state_into_the_watched_folder_after_the_watch_began_is_passed_over_file_by_file(tmp_path):
    """Refused only when the watch started: a save_state written into the watched folder later was committed as
    model.safetensors and optimizer.bin, two commits load_state could not use (reviewer 400)."""
    from ckptstore.repo.watch import IN_A_SAVE, scan

    save_file({"w": torch.ones(8)}, tmp_path / "model.safetensors")
    assert not scan(tmp_path)["model.safetensors"].passed_over  # a lone weights file: a checkpoint
    torch.save({"state": {}}, tmp_path / "optimizer.bin")
    found = scan(tmp_path)
    assert {name: (s.passed_over, s.incomplete) for name, s in found.items()} == {
        "model.safetensors": (True, IN_A_SAVE), "optimizer.bin": (True, IN_A_SAVE)}


def test_a_restart_whose_record_is_missing_or_named_apart_commits_no_pruned_checkpoint_again(tmp_path):
    """With retention on, a watch restarted as `--branch main` (its record kept under HEAD's unnamed branch) committed
    every checkpoint again: the first's commit was pruned, so it went on top of the newest, which pushed the next
    into the retention's cut, and so on down the run; stopped midway, the branch's tip was an old step (auditor 416).
    """
    from ckptstore import Repository

    _keeping_last(tmp_path / "repo", 2)
    run = tmp_path / "run"
    run.mkdir()
    for step in (12, 14, 16):
        torch.save({"w": torch.full((4,), float(step))}, run / f"step-{step}.pt")
    with Repository.open(tmp_path / "repo") as repo:
        assert len(watch(repo, run, ONCE).committed) == 3
        assert [c.pruned for c in repo.log()] == [False, False, True]
        assert watch(repo, run, WatchOptions(interval=0.05, once=True, branch="main")).committed == []
        for record in (repo.dir / "watch").glob("*.json"):
            record.unlink()
        assert watch(repo, run, ONCE).committed == []
        assert [c.step for c in repo.log()] == [16, 14, 12]
        torch.save({"w": torch.full((4,), 99.0)}, run / "step-12.pt")  # rewritten after its commit: a new one
        assert [step for _, _, step in watch(repo, run, ONCE).committed] == [12]


def test_an_earlier_versions_record_of_a_watch_without_branch_is_read_then_replaced(repo, tmp_path, monkeypatch):
    """Records were kept under "branch": null; named after HEAD's branch now, an upgraded watch hashed every file of
    the run again and left the old record behind (reviewer 421)."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(4)}, run / "step-1.pt")
    assert len(watch(repo, run, ONCE).committed) == 1
    (record,) = (repo.dir / "watch").glob("*.json")
    header = {"folder": str(run.resolve()), "branch": None}
    legacy = repo.dir / "watch" / f"{watch_module._record_name(header)}.json"
    record.rename(legacy)
    legacy.write_text(legacy.read_text().replace('"branch":"main"', '"branch":null'))
    hashed = []
    monkeypatch.setattr(watch_module, "file_digest", lambda path: hashed.append(path) or "")
    torch.save({"w": torch.zeros(4)}, run / "step-2.pt")
    assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["step-2.pt"]
    assert hashed == [] and [p.name for p in (repo.dir / "watch").glob("*.json")] == [record.name]


def test_a_pruned_commits_file_counts_as_committed_only_with_as_many_bytes(tmp_path):
    """A file older than the pruned commit of its path counted as that commit whatever its size: a copy keeping an
    older time (cp -p, rsync -a) was never committed (reviewer 421)."""
    from ckptstore import Repository

    _keeping_last(tmp_path / "repo", 1)
    run = tmp_path / "run"
    run.mkdir()
    with Repository.open(tmp_path / "repo") as repo:
        torch.save({"w": torch.ones(4)}, run / "step-1.pt")
        torch.save({"w": torch.ones(8)}, run / "step-2.pt")
        assert len(watch(repo, run, ONCE).committed) == 2
        for record in (repo.dir / "watch").glob("*.json"):
            record.unlink()
        before = repo.log()[1].created_at - 60
        torch.save({"w": torch.zeros(64)}, run / "step-1.pt")  # new content, its time set back (a copy kept it)
        os.utime(run / "step-1.pt", (before, before))
        assert [name for name, _, _ in watch(repo, run, ONCE).committed] == ["step-1.pt"]


def test_a_folder_holding_git_files_is_found_committed_without_a_record(repo, tmp_path):
    """The watch's listing held .git's files, which a commit leaves out: a restart without a record never matched
    the folder's commit and tried it again."""
    run = _run_with_one_trainer_folder(tmp_path)
    (run / "checkpoint-10" / ".git").mkdir()
    (run / "checkpoint-10" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with pytest.warns(RuntimeWarning, match="git's own files"):
        assert len(watch(repo, run, ONCE).committed) == 1
    for record in (repo.dir / "watch").glob("*.json"):
        record.unlink()
    said = []
    assert watch(repo, run, ONCE, say=said.append).committed == [] and said == []


def test_a_pruned_folder_holding_a_link_counts_as_committed_by_the_bytes_its_commit_read(tmp_path):
    """The size check summed the link itself, the commit the file it leads to: after a restart without a record the
    old folder was committed on top and the retention pruned the newest (reviewer 422)."""
    from ckptstore import Repository

    _keeping_last(tmp_path / "repo", 1)
    run = tmp_path / "run"
    run.mkdir()
    trainer = Trainer()
    trainer.train(1)
    _trainer_folder(run / "checkpoint-10", trainer)
    (run / "checkpoint-10" / "sub").mkdir()
    os.rename(run / "checkpoint-10" / "optimizer.pt", run / "checkpoint-10" / "sub" / "optimizer.pt")
    os.symlink("sub/optimizer.pt", run / "checkpoint-10" / "optimizer.pt")  # a link inside the folder: followed
    trainer.train(1)
    _trainer_folder(run / "checkpoint-20", trainer)
    with Repository.open(tmp_path / "repo") as repo:
        assert len(watch(repo, run, ONCE).committed) == 2
        for record in (repo.dir / "watch").glob("*.json"):
            record.unlink()
        assert watch(repo, run, ONCE).committed == []
        assert [c.pruned for c in repo.log()] == [False, True]  # the newest kept, none committed again


def test_a_watch_under_nohup_goes_on_after_a_hangup(repo, tmp_path):
    """SIGHUP stopped a `nohup ckpt watch`, whose SIGHUP was ignored (reviewer 440)."""
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.arange(10.0)}, run / "ckpt-1.pt")
    process = subprocess.Popen([sys.executable, "-m", "ckptstore", "watch", str(run), "--interval", "0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_cli_env(repo),
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        lines, deadline = [], time.monotonic() + 60
        while not any("ckpt-1.pt" in line for line in lines) and time.monotonic() < deadline:
            lines.append(process.stdout.readline())
        process.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert process.poll() is None, "".join(lines)  # nohup's: ignored, as before the watch
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0 and "stopped on Ctrl-C" in out, "".join(lines) + out
