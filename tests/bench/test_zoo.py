"""bench.zoo on tiny versions of held-back runs: real ratios, bit-exact `optimizer` weights, finite eval
changes, and a resume point still at half the peak learning rate; every zoo run saves and loads back."""

import math
import sys

import pytest
import torch

from bench import zoo
from bench.workloads import WORKLOADS, Workload
from bench.zoo_runs import HELD_BACK, TUNED


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models: a second thread only adds waiting, many times over on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rows():
    return zoo.run_zoo(["mlp-tour", "cnn-bn"], ["optimizer", "balanced"], quick=True)


def test_every_row_has_a_real_ratio_and_finite_changes(rows):
    assert [(r["run"], r["level"]) for r in rows] == [
        ("mlp-tour", "optimizer"), ("mlp-tour", "balanced"), ("cnn-bn", "optimizer"), ("cnn-bn", "balanced")]
    for row in rows:
        assert row["half"] == "held-back" and row["ratio"] > 1
        assert len(row["eval_changes_pct"]) == row["checkpoints"] == 3
        assert all(math.isfinite(c) for c in [*row["eval_changes_pct"], row["resume_change_pct"]])
    assert rows[1]["ratio"] > rows[0]["ratio"]  # lossy weights store smaller than lossless ones


def test_optimizer_level_gives_back_bit_exact_weights_and_buffers(rows):
    # cnn-bn's BatchNorm running statistics are buffers: they count as weights here
    for row in rows:
        if row["level"] == "optimizer":
            assert row["weights_exact"] is True and row["worst_eval_change_pct"] == 0.0 and row["pass"] == "pass"


def test_the_resume_point_is_the_last_checkpoint_at_half_the_peak_lr(rows):
    workload = WORKLOADS["mlp-tour"](quick=True)
    files = workload.files()
    lrs = [workload.learning_rate(f)[0] for f in files]
    index, lr, peak = workload.resume_point(files)
    assert lr == lrs[index] and lr >= peak / 2 and all(later < peak / 2 for later in lrs[index + 1 :])
    assert lrs[-1] < lrs[0]  # cosine decay: the last checkpoint is not the resume point by default
    assert rows[0]["resume_index"] == index


def test_the_resume_point_falls_back_to_the_highest_lr(monkeypatch):
    rates = iter([(0.1, 1.0), (0.3, 1.0), (0.2, 1.0)])  # none at half the peak of 1.0
    monkeypatch.setattr(Workload, "learning_rate", lambda self, path: next(rates))
    assert Workload().resume_point([None, None, None]) == (1, 0.3, 1.0)


def test_the_table_judges_each_half_and_level(rows):
    text = zoo.report(rows)
    assert text.startswith("### held-back") and text.count("| mlp-tour |") == 2
    assert "- median ratio, balanced:" in text and "(target 25x:" in text


def test_a_level_ckptstore_does_not_know_fails_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["zoo", "--levels", "no-such-level", "--runs", "mlp-tour"])
    monkeypatch.setattr(zoo, "run_zoo", lambda *a, **k: pytest.fail("trained or committed"))
    with pytest.raises(SystemExit, match="unknown lossy level 'no-such-level'"):
        zoo.main()


def test_the_halves_split_the_zoo():
    assert set(TUNED) | set(HELD_BACK) == set(WORKLOADS) and not set(TUNED) & set(HELD_BACK)


@pytest.mark.parametrize("name", HELD_BACK)
def test_each_held_back_run_saves_and_loads_its_training_state(name, tmp_path):
    workload = WORKLOADS[name](quick=True)
    torch.manual_seed(0)
    state = workload.build()
    workload.train_steps(state, 2)
    workload.save(state, tmp_path / "ckpt.pt")
    loaded = workload.load(tmp_path / "ckpt.pt")
    assert loaded.step == 2 and loaded.scheduler.last_epoch == state.scheduler.last_epoch
    assert workload.eval_loss(loaded.model) == workload.eval_loss(state.model)
    assert loaded.optimizer.state_dict()["param_groups"] == state.optimizer.state_dict()["param_groups"]
