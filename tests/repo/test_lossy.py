"""Lossy commits of a real training run: what may change, by how much, and what never does."""

import copy
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import CkptError, NothingToCommitError
from ckptstore.formats.torchfile import numpy_safe_globals
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.repo import fsck
from ckptstore.repo.manifest import Manifest
from tests.conftest import Trainer, assert_same, outlier_adam_rounds

LOSSY_WEIGHTS = ("fc1.weight", "fc2.weight")


def _load(path):
    with torch.serialization.safe_globals(numpy_safe_globals()):
        return torch.load(path, weights_only=True)


def _run(repo, tmp_path, level, commits=4, steps=5, **knobs):
    trainer, out = Trainer(), []
    for i in range(commits):
        trainer.train(steps)
        path = tmp_path / f"ckpt-{i}.pt"
        torch.save(trainer.state(), path)
        out.append((path, repo.commit(path, lossy=level, step=trainer.step, **knobs)))
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _steps(repo, cid):
    return {t["path"]: t for t in repo.show(cid)["tensors"]}


def test_balanced_level_keeps_everything_but_weights_and_moments_exact(repo, tmp_path):
    # This net trains fast (lr >= 0.5% of its weights' RMS, like a from-scratch run), so `balanced`
    # takes steps of 0.4 of RMS: about 0.12 relative error, up to 2x that with the Fisher factors.
    errors = []
    for path, cid in _run(repo, tmp_path, "balanced"):
        original, restored = _load(path), repo.checkout(cid)
        for name, tensor in original["model"].items():
            if name in LOSSY_WEIGHTS:
                errors.append(_rel(restored["model"][name], tensor))
                assert 0 < errors[-1] < 0.25, name
            else:
                assert_same(tensor, restored["model"][name])
        for index, state in original["optimizer"]["state"].items():
            assert_same(state["step"], restored["optimizer"]["state"][index]["step"])
        assert_same(original["optimizer"]["param_groups"], restored["optimizer"]["param_groups"])
        assert_same(original["scheduler"], restored["scheduler"])
        assert_same(original["rng"], restored["rng"])
        assert original["step"] == restored["step"]
    assert max(errors[-2:]) < 2 * max(errors[:2]), "closed loop: error must not accumulate along the chain"
    shown = repo.show(cid)
    assert shown["lossy"] == "balanced" and shown["pairing"].startswith("optimizer order")
    assert {t["path"] for t in shown["tensors"] if "rel_error" in t} >= {f"model/{n}" for n in LOSSY_WEIGHTS}
    assert "[lossy:balanced]" in "\n".join(repo.log_graph())
    assert repo.commit_info(cid).stored_bytes < 0.5 * repo.commit_info(cid).raw_bytes


@pytest.mark.parametrize("codebooks", [False, True])
def test_every_entry_is_within_its_codec_bound(repo, tmp_path, codebooks):
    """Without pruning, each weight is within half a step, each update m / sqrt(v) within half a step
    (restored m over restored v against the original's), each v within half a grid interval of log2:
    at every commit of a chain (codebook chunks too)."""
    for path, cid in _run(repo, tmp_path, "balanced", prune=0.0, codebooks=codebooks):
        original, restored = _load(path), repo.checkout(cid)
        shown = _steps(repo, cid)
        for name in LOSSY_WEIGHTS:
            params = repo_params(repo, shown[f"model/{name}"])
            assert params.get("codebooks", False) == codebooks
            step = params["step"]  # the planned step; chunks may use finer
            assert (restored["model"][name] - original["model"][name]).abs().max() <= step / 2 * 1.0001
        for index, state in original["optimizer"]["state"].items():
            entry = shown[f"optimizer/state/{index}/exp_avg"]
            if entry["codec"] != "normmoment":
                continue
            v_hat = restored["optimizer"]["state"][index]["exp_avg_sq"]
            m_params = repo_params(repo, entry)
            eps = m_params["eps"]  # the update a resume takes first, each with its own v
            update = state["exp_avg"] / torch.sqrt(state["exp_avg_sq"] + eps)
            restored_update = restored["optimizer"]["state"][index]["exp_avg"] / torch.sqrt(v_hat + eps)
            assert ((restored_update - update).abs() <= m_params["step"] / 2 * 1.0001 + 1e-6).all()
            k = repo_params(repo, shown[f"optimizer/state/{index}/exp_avg_sq"])["k"]
            positive = state["exp_avg_sq"] > 0
            octaves = torch.log2(v_hat[positive] / state["exp_avg_sq"][positive]).abs()
            assert octaves.max() <= 0.5 / 2.0**k + 1e-4


def repo_params(repo, entry):
    with repo.db.read() as tx:
        return tensor_rows.load_records(tx, [entry["tensor"]], with_bases=False)[entry["tensor"]].params


def test_optimizer_level_keeps_weights_bit_exact(repo, tmp_path):
    for path, cid in _run(repo, tmp_path, "optimizer", commits=3):
        original, restored = _load(path), repo.checkout(cid)
        assert_same(original["model"], restored["model"])
        lossy_moments = [repo.show(cid)["tensors"][i] for i in range(len(repo.show(cid)["tensors"]))
                         if repo.show(cid)["tensors"][i]["codec"] in ("normmoment", "log2moment")]
        assert lossy_moments, "the moments of the larger weights are quantized"


def test_resuming_from_a_lossy_commit_tracks_the_original(repo, tmp_path):
    (path, cid), = _run(repo, tmp_path, "balanced", commits=1, steps=8)
    from_file = Trainer(seed=1)
    from_file.load(_load(path))
    expected = from_file.train(5)  # the RNG is global: train each right after loading it
    from_store = Trainer(seed=2)
    from_store.load(repo.checkout(cid))
    got = from_store.train(5)
    assert max(abs(a - b) / a for a, b in zip(expected, got)) < 0.02


def test_unchanged_lossy_checkpoint_is_nothing_to_commit(repo, tmp_path):
    (path, cid), = _run(repo, tmp_path, "extreme", commits=1)
    with pytest.raises(NothingToCommitError):
        repo.commit(path, lossy="extreme")
    with pytest.raises(CkptError, match="unknown lossy level"):
        repo.commit(path, lossy="medium")


def _objects_bytes(root):
    return sum(p.stat().st_size for p in (root / ".ckpt" / "objects").rglob("*") if p.is_file())


def test_a_lossy_commit_that_stores_nothing_new_says_so(tmp_path, monkeypatch):
    """Re-encoding that gives the parent's tensor ids adds nothing: the commit line, stats and commit_info say 0."""
    monkeypatch.chdir(tmp_path)
    generator = torch.Generator().manual_seed(9)
    torch.save({"model": {"w": torch.randn(256, 256, generator=generator)},
                "optimizer": {"state": {0: {"step": torch.tensor(5.0),
                                            "exp_avg": torch.randn(256, 256, generator=generator) * 1e-3,
                                            "exp_avg_sq": torch.rand(256, 256, generator=generator) * 1e-6}},
                              "param_groups": [{"lr": 1e-3, "params": [0]}]}}, "l.pt")
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert run("init").exit_code == 0
    assert run("commit", "l.pt", "--lossy", "optimizer").exit_code == 0
    grew = _objects_bytes(tmp_path)
    assert run("commit", "l.pt", "--lossy", "balanced", "--allow-empty").exit_code == 0
    before = _objects_bytes(tmp_path)
    again = run("commit", "l.pt", "--lossy", "balanced", "--allow-empty", "-m", "again")
    assert _objects_bytes(tmp_path) == before  # every id was known: nothing was written
    assert again.output.rstrip().endswith("-> 0 B new)"), again.output
    with Repository.open(tmp_path) as repo:
        rows = {row["message"]: row for row in repo.stats()["commits"]}
        assert repo.commit_info("HEAD").stored_bytes == rows["again"]["stored_bytes"] == 0
        assert repo.commit_info("HEAD~2").stored_bytes == grew > 0  # what is new still counts, once


def test_a_lossy_commit_repeating_known_reconstructions_leaves_no_object_behind(tmp_path):
    """A tensor whose re-encoding restored as its base's record still had its payload packed: an object
    nothing named, counted as the commit's stored bytes and listed by fsck as unreferenced (auditor)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(32, 96)), torch.randn(32, 8)).backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt")
    with Repository.init(tmp_path) as repo:
        repo.commit(tmp_path / "c.pt")
        repo.commit(tmp_path / "c.pt", lossy="balanced", allow_empty=True)
        before = _objects_bytes(tmp_path)
        again = repo.commit(tmp_path / "c.pt", lossy="balanced", allow_empty=True)
        assert repo.commit_info(again).stored_bytes == 0 and _objects_bytes(tmp_path) == before
        report = fsck(repo)
        assert report.ok and report.unreferenced_objects == 0


def test_show_counts_a_weight_that_restores_as_an_exact_record_among_the_measured_weights(tmp_path):
    """One Adam step rounds to nothing at `balanced`: the weight restores as the lossless parent's record,
    whose codec is exact, so `show`'s summary left out the error this commit measured (auditor)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(96, 96)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        model(torch.randn(4, 96)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with Repository.init(tmp_path) as repo:
        repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        step()
        cid = repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, lossy="balanced")
        shown = repo.show(cid)
    weight = next(t for t in shown["tensors"] if t["path"] == "model/weight")
    assert weight["codec"] != weight["measured_as"] == "deadzone"  # the record is the parent's, exact
    weights = next(row for row in shown["fidelity"] if row["quantity"].startswith("weights"))
    assert weights["worst"] == weight["rel_error"] > 0
    with Repository.open(tmp_path) as repo:  # the codec comes back from the stored manifest
        manifest = repo.manifest(cid)
        assert manifest.measured["model/weight"][2] == "deadzone"
        assert Manifest.from_record(manifest.to_record()).measured == manifest.measured
        assert len(manifest.to_record()["measured"]["model/weight"]) == 2  # what an older ckptstore checks


def test_records_sharing_their_objects_count_them_once(tmp_path):
    """The same 4 MiB under two shapes are two records of one object: 'new' is what the objects folder grew."""
    values = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"flat": values, "square": values.clone().reshape(1024, 1024)})
        assert repo.commit_info(cid).stored_bytes == _objects_bytes(tmp_path)


def test_cli_marks_lossy_commits_and_checkouts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert run("init", "--lossy", "balanced").exit_code == 0
    trainer = Trainer()
    trainer.train(3)
    torch.save(trainer.state(), "ckpt.pt")
    assert "lossy:balanced" in run("commit", "ckpt.pt", "-m", "first").output
    trainer.train(3)
    torch.save(trainer.state(), "ckpt.pt")
    assert "lossy" not in run("commit", "ckpt.pt", "--lossy", "none").output
    assert "Lossy:  balanced" in run("log").output
    show = run("show", "HEAD~1").output
    assert "lossy commit, level balanced" in show and "rel.err" in show
    assert "measured weights (and SGD momentum): ||W'-W||/||W||: worst" in show
    assert "is a lossy commit" in run("checkout", "HEAD~1", "-o", "old.pt").output


def _chunk_steps(repo, entry) -> tuple[list[float], dict]:
    """The steps a lossy tensor's chunks were quantized with, read from their payloads, and its params."""
    from ckptstore.codecs import get_codec
    from ckptstore.replay import ChainSource

    with repo.db.read() as tx:
        record = tensor_rows.load_records(tx, [entry["tensor"]], with_bases=False)[entry["tensor"]]
    source = ChainSource(repo.store, {record.id: record})
    return [get_codec(record.codec).step_of(source.payload(c)) for c in record.chunks], record.params


def _moment_steps(repo, cid) -> dict[str, tuple[set[float], dict]]:
    """Per lossy first moment of a commit: the steps its chunks were quantized with, and its params."""
    found = {}
    for path, entry in _steps(repo, cid).items():
        if entry["codec"] == "normmoment":
            steps, params = _chunk_steps(repo, entry)
            found[path] = (set(steps), params)
    return found


def _moved(state: dict, by: float) -> dict:
    """The checkpoint with each lossy weight moved by `by` of its RMS, and new first moments."""
    later = copy.deepcopy(state)
    for name in LOSSY_WEIGHTS:
        weight = later["model"][name]
        weight += torch.randn_like(weight) * weight.pow(2).mean().sqrt() * by
    for slot in later["optimizer"]["state"].values():
        slot["exp_avg"] += torch.randn_like(slot["exp_avg"]) * slot["exp_avg_sq"].sqrt()
    return later


def _trained_state() -> dict:
    trainer = Trainer()
    trainer.train(5)
    return trainer.state()


def test_first_moment_is_finer_where_its_weight_barely_moved(repo):
    state = _trained_state()
    slow = {"lossy": "balanced", "fast_move": 0.0}  # the tiny net's learning rate is a from-scratch pace
    repo.commit(state, **slow)
    fine, coarse = repo.commit(_moved(state, 1e-4), **slow), repo.commit(_moved(state, 0.2), **slow)
    fine_steps, coarse_steps = _moment_steps(repo, fine), _moment_steps(repo, coarse)
    assert fine_steps and fine_steps.keys() == coarse_steps.keys()
    for path, (steps, params) in fine_steps.items():
        assert steps == {np.float32(params["fine_step"])}, path
        assert params["fine_step"] < params["step"]
        steps, params = coarse_steps[path]
        assert steps == {np.float32(params["step"])}, path


def test_fast_moving_weights_keep_their_planned_steps_however_little_they_moved(repo):
    """A from-scratch pace overtakes quantization error within steps, so a small move since the
    parent (late in a decaying schedule) is not coded at a fine-tune's capped step."""
    state = _trained_state()
    repo.commit(state, lossy="balanced")
    barely = repo.commit(_moved(state, 1e-4), lossy="balanced")
    steps = _moment_steps(repo, barely)
    assert steps
    for path, (found, params) in steps.items():
        assert found == {np.float32(params["step"])}, path
    for path, entry in _steps(repo, barely).items():
        if entry["codec"] == "deadzone":
            params = repo_params(repo, entry)
            assert params["relative_step"] == 0.0 and params["rounding"] == 0.5, path


def test_pruning_spares_fine_tune_sized_moves():
    """Weight residuals are pruned by estimated loss impact, except where the residual step is
    capped because the weights barely moved (a fine-tune): there every update is the signal."""
    from ckptstore.repo.writer import Job, _prune_mask
    from ckptstore.state import RawTensor

    rng = np.random.default_rng(0)
    base = rng.standard_normal(20_000).astype(np.float32)
    v = RawTensor("torch.float32", (20_000,), (rng.random(20_000).astype(np.float32) * 1e-6).view(np.uint8))
    params = {"dtype": "torch.float32", "step": 0.3, "relative_step": 0.5, "fine_below": 0.01, "base_error": 0.0}
    for by, pruned in ((0.2, True), (1e-4, False)):
        data = (base + rng.standard_normal(base.size).astype(np.float32) * by).view(np.uint8)
        job = Job("w", RawTensor("torch.float32", (20_000,), data), "deadzone", params, prune=0.6, importance=v)
        mask = _prune_mask(job, params, data, base.view(np.uint8), 0)
        assert (mask is not None) == pruned, by
        if pruned:
            assert mask.sum() == pytest.approx(0.6 * base.size, abs=1)


@pytest.mark.parametrize("wrapper", [lambda model: model, torch.nn.DataParallel, torch.compile],
                         ids=["plain", "DataParallel", "torch.compile"])
def test_a_calibration_batch_is_measured_on_the_live_model_and_recorded(repo, tmp_path, wrapper):
    """Wrapped, the Fisher was named by the wrapper (`module.`, `_orig_mod.`) and a state saved from the inner
    model names its weights without: nothing was steered ("0 weights"), the level's own plan stood."""
    trainer = Trainer()
    trainer.train(5)
    path = tmp_path / "ckpt.pt"
    torch.save(trainer.state(), path)
    tokens = torch.arange(16 * 8).reshape(16, 8) % 64

    def calibration(model):
        return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), ((tokens + 1) % 64).reshape(-1))

    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    cid = repo.commit(path, lossy="balanced", model=wrapper(trainer.model), calibration=calibration)
    assert repo.show(cid)["importance"] == "measured on a calibration batch (2 weights)"
    assert all(torch.equal(p.detach(), weights[n]) for n, p in trainer.model.named_parameters())
    restored = repo.checkout(cid)
    for name in LOSSY_WEIGHTS:
        assert 0 < _rel(restored["model"][name], trainer.state()["model"][name]) < 0.25  # fast-moving: 0.4 of RMS
    with pytest.raises(CkptError, match="lossy"):
        repo.commit(path, model=trainer.model, calibration=calibration, allow_empty=True)


def _half_moved(state: dict, by: float) -> dict:
    """The checkpoint with the first half of each lossy weight's entries moved by `by` of its RMS."""
    later = copy.deepcopy(state)
    for name in LOSSY_WEIGHTS:
        flat = later["model"][name].view(-1)
        half = flat[: flat.numel() // 2]
        half += torch.randn_like(half) * flat.pow(2).mean().sqrt() * by
    return later


def test_fine_tune_residuals_keep_the_refined_lattice(tmp_path):
    """With fine_grid, a residual after the refining one reuses its steps: entries that did not
    move come back bit for bit as before, every entry stays within half a step, and it is smaller
    than refining the unmoved entries' error once more."""
    from ckptstore import Repository

    state = _trained_state()
    refined = _moved(state, 1e-4)
    later = _half_moved(refined, 1e-4)
    stored = {}
    for lattice in (True, False):
        slow = {"lossy": "balanced", "fast_move": 0.0, "fine_grid": lattice}  # the tiny net's lr: a from-scratch pace
        with Repository.init(tmp_path / f"lattice-{lattice}") as repo:
            repo.commit(state, **slow)
            first, second = repo.commit(refined, **slow), repo.commit(later, **slow)
            before, after = repo.checkout(first)["model"], repo.checkout(second)["model"]
            stored[lattice] = 0
            for name in LOSSY_WEIGHTS:
                entry = _steps(repo, second)[f"model/{name}"]
                steps, params = _chunk_steps(repo, entry)
                (lattice_step,), parent = _chunk_steps(repo, _steps(repo, first)[f"model/{name}"])
                assert entry["codec"] == "deadzone" and lattice_step < parent["step"]  # the refinement was capped
                stored[lattice] += entry["stored_bytes"]
                unmoved = slice(later["model"][name].numel() // 2, None)
                kept = torch.equal(after[name].view(-1)[unmoved], before[name].view(-1)[unmoved])
                error = (after[name] - later["model"][name]).abs().max().item()
                if lattice:
                    assert steps == [lattice_step] and params["chunk_steps"] == parent["chunk_steps"] == steps
                    assert kept
                    assert error <= lattice_step / 2 * (1 + 1e-5)
                else:
                    assert steps != [lattice_step] and not kept
    assert stored[True] < stored[False]


@pytest.mark.parametrize("level", ["balanced", "extreme"])
def test_the_encoder_keeps_every_bound_it_states_whatever_the_rules_chose(repo, tmp_path, level):
    """Coarse rules (a fast keyframe step of 1 RMS, a first-moment step of 12) are tightened per chunk
    until each weight's ||W'-W||/||W|| and each update's ||u'-u||/||u|| keep the bounds, measured here
    with torch on the restored checkpoint against the original; `show` reports the same figures."""
    bounds = {"max_weight_error": 0.01, "max_update_error": 0.3}
    for path, cid in _run(repo, tmp_path, level, commits=3, fast_keyframe_step=1.0, fast_residual_step=1.0,
                          weight_keyframe_step=1.0, weight_residual_step=1.0, **bounds):
        original, restored, shown = _load(path), repo.checkout(cid), _steps(repo, cid)
        for name in LOSSY_WEIGHTS:
            entry = shown[f"model/{name}"]
            assert bounds["max_weight_error"] / 2 <= entry["max_error"] <= bounds["max_weight_error"] * 2
            measured = _rel(restored["model"][name], original["model"][name])
            assert measured <= entry["max_error"] * 1.001
            assert measured == pytest.approx(entry["rel_error"], rel=1e-3, abs=1e-9)
        for index, state in original["optimizer"]["state"].items():
            entry = shown[f"optimizer/state/{index}/exp_avg"]
            if entry["codec"] != "normmoment":
                continue
            got = restored["optimizer"]["state"][index]
            update = state["exp_avg"] / torch.sqrt(state["exp_avg_sq"] + 1e-30)
            restored_update = got["exp_avg"] / torch.sqrt(got["exp_avg_sq"] + 1e-30)
            assert entry["max_error"] == bounds["max_update_error"]
            assert _rel(restored_update, update) <= bounds["max_update_error"] * 1.001
    fidelity = repo.show(cid)["fidelity"]
    assert {row["quantity"].split(":")[0] for row in fidelity} >= {"weights (and SGD momentum)", "Adam updates"}
    assert all(row["worst_of_bound"] is None or row["worst_of_bound"] <= 1.001 for row in fidelity)


@pytest.mark.parametrize("outliers", ["one entry", "a fifth of the columns"])
@pytest.mark.parametrize("level", ["balanced", "extreme"])
def test_a_weight_whose_norm_its_outliers_hold_keeps_the_rest_of_its_entries(repo, level, outliers):
    """A 1e4x entry held the matrix's norm: its RMS step rounded 62% of the other entries to zero (51% error on
    them) while ||W'-W||/||W|| kept the bound and `show` said so (lossy-promises auditor, high). Outliers in a
    fifth of the columns moved the mean the first mend measured from past themselves: all the rest were zeroed
    (hostile-input auditor)."""
    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    rest = torch.ones_like(weight, dtype=torch.bool)
    if outliers == "one entry":
        rest[3, 5] = False
    else:
        rest[:, ::5] = False
    weight[~rest] = 200.0
    optimizer = torch.optim.Adam([torch.nn.Parameter(weight.clone())], lr=1e-3)
    optimizer.param_groups[0]["params"][0].grad = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    optimizer.step()
    cid = repo.commit({"model": {"w": weight}, "optimizer": optimizer.state_dict()}, lossy=level)
    restored = repo.checkout(cid)["model"]["w"]
    bound = _steps(repo, cid)["model/w"]["max_error"]
    assert _rel(restored, weight) <= bound * 1.001
    assert _rel(restored[rest], weight[rest]) <= 2 * bound * 1.001


def test_weights_pruned_between_commits_stay_at_the_level(repo):
    """A residual that zeroed 70% of a weight its base held: its bulk (the zeros, median 0) could keep no bound,
    and the tensor was stored lossless, 6.8x larger (review of 211fba2)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 256, generator=g) * 0.02
    optimizer = torch.optim.Adam([torch.nn.Parameter(weight.clone())], lr=1e-3)
    optimizer.param_groups[0]["params"][0].grad = torch.randn(256, 256, generator=g)
    optimizer.step()
    repo.commit({"model": {"w": weight}, "optimizer": optimizer.state_dict()}, lossy="balanced")
    pruned = torch.where(torch.rand(256, 256, generator=g) < 0.7, 0.0, weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "cannot be quantized at level 'balanced'"
        cid = repo.commit({"model": {"w": pruned}, "optimizer": optimizer.state_dict()}, lossy="balanced")
    restored = repo.checkout(cid)["model"]["w"]
    assert _steps(repo, cid)["model/w"]["codec"] == "deadzone"
    assert _rel(restored, pruned) <= _steps(repo, cid)["model/w"]["max_error"] * 1.001


def test_without_bounds_the_coarse_rules_are_what_they_are(repo, tmp_path):
    """The same coarse steps without a bound do exceed it: the test above measures tightening, not luck."""
    (path, cid), = _run(repo, tmp_path, "resume-only", commits=1, fast_keyframe_step=1.0, weight_keyframe_step=1.0)
    original, restored = _load(path), repo.checkout(cid)
    assert max(_rel(restored["model"][n], original["model"][n]) for n in LOSSY_WEIGHTS) > 0.05
    assert all(row["worst_of_bound"] is None for row in repo.show(cid)["fidelity"])


@pytest.mark.parametrize("level", ["optimizer", "balanced", "extreme"])
def test_moments_that_reconstruct_to_the_same_bytes_restore(repo, level):
    """All-zero Adam moments (a parameter no gradient reached) reconstruct to identical bytes, so the
    first moment's tensor id is its second moment's, its own base: once recorded as a loop, the commit
    could not be checked out. Bit-exact zeros come back, twice along a chain."""
    torch.manual_seed(0)
    for step in (3, 4):
        state = {"model": {"w": torch.randn(64, 64)}, "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(64, 64),
                          "exp_avg_sq": torch.zeros(64, 64)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]}}
        restored = repo.checkout(repo.commit(state, lossy=level))
        for moment in ("exp_avg", "exp_avg_sq"):
            assert_same(restored["optimizer"]["state"][0][moment], torch.zeros(64, 64))


def test_each_chunk_tells_movement_from_its_own_base_error(tmp_path):
    """Chunks of one tensor hold values of different sizes (an embedding's rows of rare and frequent
    tokens), so a keyframe's error differs from chunk to chunk. A residual chunk judges whether the
    weights moved against its own base chunk's error, not the tensor's average: a fine-tune-sized
    move is then refined in every chunk. Against the average, a chunk whose keyframe error was
    above it read that error as movement and kept the coarse planned step, which held the fine-tune's
    updates back in its dead zone for the rest of the chain."""
    from ckptstore import Repository
    from ckptstore.policy import EncodingSettings

    state = _trained_state()
    for name in LOSSY_WEIGHTS:
        flat = state["model"][name].view(-1)
        for start in range(0, flat.numel(), 1024):  # 4096-byte chunks at these scales
            flat[start : start + 1024] *= (0.01, 0.3, 1.0, 1.6)[start // 1024 % 4]
    slow = {"lossy": "balanced", "fast_move": 0.0}  # the tiny net's lr: a from-scratch pace
    with Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=4096)) as repo:
        keyframe = repo.commit(state, **slow)
        residual = repo.commit(_moved(state, 1e-4), **slow)
        for name in LOSSY_WEIGHTS:
            _, base = _chunk_steps(repo, _steps(repo, keyframe)[f"model/{name}"])
            steps, params = _chunk_steps(repo, _steps(repo, residual)[f"model/{name}"])
            before, after = base["chunk_errors"], params["chunk_errors"]
            assert len(before) == len(after) == len(steps) > 1 and max(before) > 3 * min(before[1:])
            assert all(step < params["step"] / 10 for step in steps), (name, steps, params["step"])
            assert all(a <= b / 4 for a, b in zip(after, before)), (name, before, after)  # every chunk refined


def test_a_checkpoint_with_nan_or_inf_weights_is_committed_lossless_with_a_warning(tmp_path):
    """A diverged run's checkpoint is worth keeping whole: no quantization step exists for NaN or inf."""
    weight = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    weight[3, 5], weight[7, 1] = float("nan"), float("inf")
    state = {"model": {"l.weight": weight}}
    with Repository.init(tmp_path) as repo, pytest.warns(RuntimeWarning, match="NaN or infinite.*committed lossless"):
        cid = repo.commit(state, lossy="balanced")
    with Repository.open(tmp_path) as repo:
        assert repo.commit_info(cid).lossy is None
        assert_same(repo.checkout(cid), state)


def test_nan_in_a_tensor_the_level_keeps_exact_keeps_the_whole_checkpoint_lossless_too(tmp_path):
    """A NaN in a bias (no codec sees it: the level keeps biases exact) let the rest be quantized, unsaid
    (stateful auditor)."""
    torch.manual_seed(0)
    state = {"model": {"norm.weight": torch.randn(64, 65), "fc.bias": torch.tensor([1.0, float("nan"), 2.0])}}
    with Repository.init(tmp_path) as repo:
        with pytest.warns(RuntimeWarning, match=r"holds NaN or infinite values \(NaN in model/fc.bias\): committed "
                                                r"lossless"):
            cid = repo.commit(state, lossy="balanced")
        assert repo.commit_info(cid).lossy is None
        assert_same(repo.checkout(cid), state)


@pytest.mark.parametrize("odd", ["numpy_f4", "numpy_big_endian_f8", "complex64"])
def test_nan_in_a_numpy_array_or_a_complex_tensor_keeps_the_whole_checkpoint_lossless(tmp_path, odd):
    """Only torch's float dtypes were looked at: a NaN in a numpy array or a complex tensor let the rest be quantized
    at `balanced`, unsaid (auditor)."""
    import numpy as np

    from ckptstore.codecs import floats
    from ckptstore.state import NUMPY_PREFIX

    assert floats.NUMPY_PREFIX == NUMPY_PREFIX  # codecs keep their own copy (they sit below state)
    torch.manual_seed(0)
    value = {"numpy_f4": np.array([1.0, np.nan], dtype="<f4"), "numpy_big_endian_f8": np.array([np.nan], dtype=">f8"),
             "complex64": torch.tensor([1 + 1j, complex(float("nan"), 0.0)], dtype=torch.complex64)}[odd]
    state = {"model": {"norm.weight": torch.randn(64, 65)}, "extra": value}
    with Repository.init(tmp_path) as repo:
        with pytest.warns(RuntimeWarning, match=r"NaN in extra\): committed lossless"):
            cid = repo.commit(state, lossy="balanced")
        assert repo.commit_info(cid).lossy is None
        assert torch.equal(repo.checkout(cid)["model"]["norm.weight"], state["model"]["norm.weight"])


def test_a_mask_of_minus_infinity_beside_the_weights_keeps_the_level_and_a_float64_nan_does_not(tmp_path):
    """A causal mask buffer of -inf is no diverged run: every commit went lossless (reader 13); a NaN in a float64
    tensor went unseen."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256)).pow(2).mean().backward()
    optimizer.step()
    mask = torch.full((8, 8), float("-inf")).triu(1)
    state = {"model": model.state_dict(), "mask": mask, "optimizer": optimizer.state_dict()}
    with Repository.init(tmp_path) as repo, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cid = repo.commit(state, lossy="balanced")
        assert repo.commit_info(cid).lossy == "balanced" and torch.equal(repo.checkout(cid)["mask"], mask)
        warnings.simplefilter("default", RuntimeWarning)
        with pytest.warns(RuntimeWarning, match=r"NaN in ema"):
            cid = repo.commit({**state, "ema": torch.tensor([1.0, float("nan")], dtype=torch.float64)},
                              lossy="balanced")
        assert repo.commit_info(cid).lossy is None


def test_a_finite_commit_after_a_diverged_one_says_the_parent_holds_nan_and_the_next_is_quantized(tmp_path):
    """Its residual against the NaN parent has no levels: the warning used to say "values up to nan"."""
    weight = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    diverged = weight.clone()
    diverged[3, 5] = float("nan")
    with Repository.init(tmp_path) as repo:
        with pytest.warns(RuntimeWarning, match="NaN or infinite"):
            repo.commit({"model": {"l.weight": diverged}}, lossy="balanced")
        with pytest.warns(RuntimeWarning, match="residual against the parent holds NaN or inf .the parent's values"):
            kept = repo.commit({"model": {"l.weight": weight + 0.01}}, lossy="balanced")
        assert_same(repo.checkout(kept), {"model": {"l.weight": weight + 0.01}})
        after = repo.commit({"model": {"l.weight": weight + 0.02}}, lossy="balanced")  # a finite parent again
        assert repo.commit_info(after).lossy == "balanced"
        assert 0 < _rel(repo.checkout(after)["model"]["l.weight"], weight + 0.02) < 0.05


def test_a_float16_adam_group_whose_second_moment_underflowed_keeps_its_moments_whole_and_the_rest_its_level(
        tmp_path):
    """v underflows to 0 in float16 while m does not: m / sqrt(v) has no int32 level (its signs used to wrap).

    That group's first moments are stored lossless (its v, all zeros, restores exactly at the level); the
    float32 group beside it and every weight keep the level (the whole checkpoint used to go lossless).
    """
    torch.manual_seed(0)
    wide, half = torch.nn.Linear(256, 128), torch.nn.Linear(256, 128).half()
    optimizer = torch.optim.Adam([{"params": wide.parameters()}, {"params": half.parameters(), "eps": 1e-4}], lr=1e-3)
    for seed in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(seed))
        (wide(x).mean() + half(x.half()).float().mean() * 1e-2).backward()
        optimizer.step()
    state = {"model": {"wide": wide.state_dict(), "half": half.state_dict()}, "optimizer": optimizer.state_dict()}
    moments = state["optimizer"]["state"]
    assert (moments[2]["exp_avg_sq"] == 0).float().mean() > 0.5  # the case itself
    with Repository.init(tmp_path / "lossless") as repo:
        whole = repo.commit_info(repo.commit(state)).stored_bytes
    for level in ("optimizer", "balanced"):
        with Repository.init(tmp_path / level) as repo, pytest.warns(
                RuntimeWarning, match=f"cannot be quantized at level '{level}' .*optimizer/state/2/exp_avg: "):
            cid = repo.commit(state, lossy=level)
        with Repository.open(tmp_path / level) as repo:
            info, restored = repo.commit_info(cid), repo.checkout(cid)
        assert info.lossy == level and info.stored_bytes < whole
        assert_same(restored["optimizer"]["state"][2], moments[2])  # the float16 weight's m and v, bit for bit
        assert not torch.equal(restored["optimizer"]["state"][0]["exp_avg"], moments[0]["exp_avg"])  # quantized
        assert _rel(restored["optimizer"]["state"][0]["exp_avg"], moments[0]["exp_avg"]) < 0.5


def test_a_float16_second_moment_that_underflowed_is_named_as_the_cause_in_the_warning(tmp_path):
    """The pair was stored lossless, but the warning blamed the first moment: "values up to 1.43e+12 are 2^31 or more
    steps of 5.33: no integer level holds them" (auditor 382's t9, a float16 model trained by Adam)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(torch.randn(64, 96).half()).float(), torch.randint(0, 10, (64,)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    moments = state["optimizer"]["state"][0]
    assert ((moments["exp_avg_sq"] == 0) & (moments["exp_avg"] != 0)).any()  # the case itself
    with Repository.init(tmp_path) as repo, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cid = repo.commit(copy.deepcopy(state), lossy="balanced", model=model, optimizer=optimizer)
        restored = repo.checkout(cid)
    said = " ".join(str(w.message) for w in caught)
    assert ("optimizer/state/0/exp_avg: its second moment is 0 where the first is not (underflow, as in fp16 "
            "training): stored lossless") in said
    assert "no integer level holds them" not in said
    assert_same(restored["optimizer"]["state"][0], moments)  # the pair, bit for bit


@pytest.mark.parametrize("level", ["balanced", "extreme"])
def test_a_matrixs_bulk_keeps_twice_its_bound_where_its_chunks_differ_in_scale(tmp_path, level):
    """Trained rows in one chunk, near-init rows (1e-3 of their scale) in two more: judged by each chunk's own
    median, every chunk kept its bulk while the matrix's (entries within 10x its median) was off by 45%."""
    from ckptstore.policy import EncodingSettings

    generator = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randn(64, 64, generator=generator), torch.randn(128, 64, generator=generator) * 1e-3])
    state = {"model": {"w": w},
             "optimizer": {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(192, 64) * 1e-3,
                                         "exp_avg_sq": torch.rand(192, 64) * 1e-6 + 1e-8}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    with Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=16384)) as repo:  # three chunks
        cid = repo.commit(state, lossy=level)
        bound = {t["path"]: t for t in repo.show(cid)["tensors"]}["model/w"]["max_error"]
        restored = repo.checkout(cid)["model"]["w"]
    magnitude = w.abs().flatten()
    bulk = magnitude <= 10 * np.median(magnitude[magnitude > 0].numpy())
    assert _rel(restored.flatten()[bulk], w.flatten()[bulk]) <= 2 * bound


@pytest.mark.parametrize("why", ["zeros-in-v", "bfloat16-v"])
def test_a_first_moment_kept_lossless_keeps_the_restored_update_within_the_levels_bound(tmp_path, why):
    """m exact beside v on extreme's grid: m / sqrt(v') was off by 2.7x `max_update_error`, measured nowhere.

    m stays exact where v has zeros under its nonzero entries (no level for m / sqrt(v)) or another item size.
    """
    from ckptstore.policy import level_named

    generator = torch.Generator().manual_seed(0)
    m = torch.randn(128, 64, generator=generator) * 1e-3
    v = torch.full((128, 64), 2.0**-12.25) * (1 + 0.01 * torch.rand(128, 64, generator=generator))
    if why == "zeros-in-v":
        v.view(-1)[:10] = 0
    else:
        v = v.bfloat16()
    state = {"model": {"w": torch.randn(128, 64, generator=generator) * 0.05},
             "optimizer": {"state": {0: {"step": torch.tensor(10.0), "exp_avg": m, "exp_avg_sq": v}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    with Repository.init(tmp_path) as repo, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cid = repo.commit(state, lossy="extreme")
        assert repo.commit_info(cid).lossy == "extreme"
        restored = repo.checkout(cid)
    back = restored["optimizer"]["state"][0]
    kept = v > 0
    update = m.double()[kept] / v.double()[kept].sqrt()
    restored_update = back["exp_avg"].double()[kept] / back["exp_avg_sq"].double()[kept].sqrt()
    assert _rel(restored_update, update) <= level_named("extreme").max_update_error
    assert 0 < _rel(restored["model"]["w"], state["model"]["w"]) < 0.1  # the weight keeps the level


def test_extreme_keeps_sqrt_v_within_its_factor_on_a_chained_commit(tmp_path):
    """The level's promise per entry, on a residual commit too: v is never pruned to its parent's value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.ReLU(), torch.nn.Linear(192, 96))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.Generator().manual_seed(1)
    states = []
    for _ in range(2):
        for _ in range(5):
            x = torch.randn(32, 96, generator=inputs)
            optimizer.zero_grad()
            (model(x) - x).pow(2).mean().backward()
            optimizer.step()
        states.append(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))
    with Repository.init(tmp_path) as repo:
        repo.commit(states[0], lossy="extreme")
        restored = repo.checkout(repo.commit(states[1], lossy="extreme"))
    for index in (0, 2):  # the two weight matrices' second moments
        v = states[1]["optimizer"]["state"][index]["exp_avg_sq"].double().sqrt()
        back = restored["optimizer"]["state"][index]["exp_avg_sq"].double().sqrt()
        assert torch.equal(v == 0, back == 0)
        factor = torch.maximum(back / v, v / back)[v > 0]
        assert factor.max() <= 4.0001, factor.max()


def test_centered_rmsprop_beside_batchnorm_comes_back_exact_and_resumes(tmp_path):
    """BatchNorm leaves the weight pairing uncertain; RMSprop's square_avg >= grad_avg**2 must survive (else NaN)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Flatten(), torch.nn.Linear(320, 10),
                                torch.nn.BatchNorm1d(10))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, centered=True)
    batches = [(torch.randint(0, 100, (16, 5)), torch.randint(0, 10, (16,))) for _ in range(10)]

    def step(inputs, labels):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    for batch in batches[:5]:
        step(*batch)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with Repository.init(tmp_path) as repo:
        restored = repo.checkout(repo.commit(state, lossy="balanced"))
    assert not torch.equal(restored["model"]["0.weight"], state["model"]["0.weight"])  # the level did its work
    assert_same(restored["optimizer"], state["optimizer"])
    model.load_state_dict(restored["model"])
    optimizer.load_state_dict(restored["optimizer"])
    assert all(np.isfinite(step(*batch)) for batch in batches[5:])


def test_a_flat_buffer_and_the_views_of_it_come_back_exact_together(tmp_path):
    """A flat master buffer and per-parameter views of it: quantizing a view would change the buffer."""
    flat = torch.randn(128 * 64 + 64, generator=torch.Generator().manual_seed(0))
    state = {"flat": flat, "model": {"fc.weight": flat[: 128 * 64].view(128, 64), "fc.bias": flat[128 * 64 :],
                                     "other.weight": torch.randn(128, 64)}}
    with Repository.init(tmp_path) as repo:
        restored = repo.checkout(repo.commit(state, lossy="balanced"))
    assert_same(restored["flat"], flat)
    assert restored["model"]["fc.weight"].untyped_storage().data_ptr() == restored["flat"].untyped_storage().data_ptr()
    assert not torch.equal(restored["model"]["other.weight"], state["model"]["other.weight"])


def test_a_second_moment_with_negative_entries_is_kept_whole_with_a_warning(tmp_path):
    """A custom optimizer's signed statistic under the name exp_avg_sq has no log2 level: the moments stay whole."""
    state = {"model": {"w": torch.randn(128, 64)},
             "optimizer": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(128, 64) * 1e-3,
                                         "exp_avg_sq": torch.randn(128, 64) * 1e-6}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    # named once, by itself: exp_avg, coded with it, re-raised its error
    named_once = r"^1 tensor\(s\) cannot be quantized at level 'balanced' \(optimizer/state/0/exp_avg_sq: "
    with Repository.init(tmp_path) as repo, pytest.warns(RuntimeWarning, match=named_once):
        cid = repo.commit(state, lossy="balanced")
        assert repo.commit_info(cid).lossy == "balanced"  # the weight keeps the level, its moments are whole
        restored = repo.checkout(cid)
    assert_same(restored["optimizer"], state["optimizer"])
    assert 0 < _rel(restored["model"]["w"], state["model"]["w"]) < 0.05
    with Repository.init(tmp_path / "optimizer") as repo, pytest.warns(  # it quantizes only the moments
            RuntimeWarning, match="exp_avg_sq: .*negative values; then no other tensor it quantizes.*lossless instead"):
        cid = repo.commit(state, lossy="optimizer")
        assert repo.commit_info(cid).lossy is None
        assert_same(repo.checkout(cid), state)


@pytest.mark.parametrize("dtype, v_range, end", [(torch.bfloat16, (-120, -100), 2.0**-133),
                                                 (torch.float16, (12, 15), 60_000.0)])
def test_a_second_moment_at_the_ends_of_its_dtype_is_kept_whole_not_zeroed_or_infinite(tmp_path, dtype, v_range,
                                                                                      end):
    """`extreme`'s 8-octave grid would round bfloat16's tiniest v to zero; float16 v near 65504 to infinity."""
    generator = torch.Generator().manual_seed(0)
    v = torch.exp2(torch.empty(128, 64).uniform_(*v_range, generator=generator))
    v.view(-1)[:3] = end
    v = v.to(dtype)
    state = {"model": {"w": (torch.randn(128, 64, generator=generator) * 0.02).to(dtype)},
             "optimizer": {"state": {0: {"step": torch.tensor(5.0), "exp_avg_sq": v,
                                         "exp_avg": (torch.randn(128, 64, generator=generator) * v.float().sqrt()
                                                     * 0.5).to(dtype)}},
                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0]}]}}
    with Repository.init(tmp_path) as repo, pytest.warns(RuntimeWarning, match="become zero or infinity"):
        cid = repo.commit(state, lossy="extreme")
        assert repo.commit_info(cid).lossy == "extreme"  # the weight keeps the level, its moments are whole
        restored = repo.checkout(cid)
    assert_same(restored["optimizer"], state["optimizer"])
    assert torch.isfinite(restored["model"]["w"].float()).all()


def test_a_changed_file_whose_lossy_values_equal_the_parents_is_still_the_next_commit(tmp_path):
    """A step that extreme's grid absorbs stores the parent's values; the file itself changed, so it commits."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(4)
    rng.standard_normal((64, 128)), rng.uniform(), rng.standard_normal((64, 128))  # the draws that found it
    weight = torch.tensor(rng.standard_normal((64, 128)) * 0.02, dtype=torch.float32)
    moved = weight + torch.tensor(rng.standard_normal((64, 128)) * 0.02 * 0.0146, dtype=torch.float32)
    save_file({"w": weight}, tmp_path / "m.safetensors")
    with Repository.init(tmp_path / "repo") as repo:
        first = repo.commit(tmp_path / "m.safetensors", lossy="extreme")
        save_file({"w": moved}, tmp_path / "m.safetensors")
        second = repo.commit(tmp_path / "m.safetensors", lossy="extreme", step=2)
        assert second != first and repo.manifest(second).entries == repo.manifest(first).entries
        with pytest.raises(NothingToCommitError, match="the checkpoint equals its parent"):
            repo.commit(tmp_path / "m.safetensors", lossy="extreme")  # the same file again
        repo.commit({"w": weight}, lossy="extreme")
        with pytest.raises(NothingToCommitError, match="at level 'extreme' its stored values equal the parent's"):
            repo.commit({"w": moved}, lossy="extreme")  # a state has no bytes of its own to tell


def test_a_weight_of_tiny_magnitude_keeps_the_same_relative_bound(tmp_path):
    """Squares of values below 1e-19 underflow float32: the bound check must not read them as zero error."""
    weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    state = {"normal": weight, "tiny": weight * 1e-25}
    with Repository.init(tmp_path) as repo:
        restored = repo.checkout(repo.commit(state, lossy="balanced"))
    for name in state:
        assert 0 < _rel(restored[name], state[name]) <= 0.02


def test_show_gives_each_commits_own_figures_where_a_weights_change_rounded_to_nothing(tmp_path):
    """One outlier makes the weight's step coarse: its small moves round away and the parent's record stays."""
    from ckptstore.repo.history import show

    with Repository.init(tmp_path) as repo:
        tensors = []
        for model, optimizer in outlier_adam_rounds(3):
            state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            cid = repo.commit(state, lossy="balanced")
            original, restored = state["model"]["0.weight"].double(), repo.checkout(cid)["model"]["0.weight"].double()
            row = next(t for t in show(repo, cid)["tensors"] if t["path"] == "model/0.weight")
            actual = ((restored - original).norm() / original.norm()).item()
            assert row["rel_error"] == pytest.approx(actual, rel=1e-3) and actual <= row["max_error"]
            tensors.append(row["tensor"])
    assert len(set(tensors)) < len(tensors)  # a record was reused: what the test is about


@pytest.mark.parametrize("entry", ["Repository.commit", "ckptstore.save", "in the background"])
def test_a_lossless_fallback_warns_at_the_callers_line_and_without_numpys_overflow_warning(tmp_path, entry):
    """A bf16 residual past float32's range is refused by name, once; the warning points at the user's code.

    A fixed stacklevel pointed inside ckptstore (commit.py, background.py) for one entry point or
    the other, and numpy's "overflow encountered in subtract" came first.
    """
    import ckptstore

    weight = torch.randn(64, 64).bfloat16()
    weight[0, 0] = 3.0e38
    changed = weight.clone()
    changed[0, 0] = -3.0e38  # the residual, -6e38, passes float32
    with Repository.init(tmp_path) as repo:
        repo.commit({"model": {"w": weight}}, lossy="balanced")
        with pytest.warns(RuntimeWarning) as caught:
            if entry == "ckptstore.save":
                ckptstore.save({"model": {"w": changed}}, repo=repo, lossy="balanced")
            elif entry == "in the background":  # the thread's warning points at the call that started it
                repo.commit({"model": {"w": changed}}, lossy="balanced", blocking=False).result()
            else:
                repo.commit({"model": {"w": changed}}, lossy="balanced")
        assert_same(repo.checkout("HEAD"), {"model": {"w": changed}})
    assert [str(w.message)[:40] for w in caught] == ["the checkpoint cannot be quantized (mode"]
    assert caught[0].filename == __file__


def test_a_pruning_levels_residual_past_float32_warns_only_by_name(tmp_path):
    """extreme's prune mask computed the same bf16 difference as the codec, without numpy's overflow warning held."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).bfloat16()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 256).bfloat16()).square().mean().backward()
    optimizer.step()
    with Repository.init(tmp_path) as repo, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in (3.0e38, -3.0e38):
            with torch.no_grad():
                model.weight[0, 0] = value
            repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, lossy="extreme",
                        model=model, optimizer=optimizer)
        assert repo.checkout("HEAD")["model"]["weight"][0, 0] == -3.0e38
    assert not [w for w in caught if "overflow" in str(w.message)]
    assert any("cannot be quantized" in str(w.message) for w in caught)


@pytest.mark.parametrize("level", ["optimizer", "balanced"])
def test_adam_with_amsgrad_keeps_its_moments_exact_so_v_never_passes_its_max(tmp_path, level):
    """v quantized beside an exact max_exp_avg_sq came back above it at half the entries: the max rose for good."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    for _ in range(10):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    with Repository.init(tmp_path) as repo:
        back = repo.checkout(repo.commit(copy.deepcopy(state), lossy=level, model=model, optimizer=optimizer))
    assert_same(back["optimizer"], state["optimizer"])  # m, v and the max: exact
    if level == "balanced":  # the weights still take the level
        assert not torch.equal(back["model"]["0.weight"], state["model"]["0.weight"])


def test_float64_moments_beside_float32_weights_stay_exact_and_the_weights_take_the_level(tmp_path):
    """The Fisher factors read a float64 v through the lossy float conversion: the commit failed, naming no tensor."""
    torch.manual_seed(0)
    weight = torch.randn(256, 64)
    moments = {"step": torch.tensor(100.0), "exp_avg": (torch.randn(256, 64) * 1e-3).double(),
               "exp_avg_sq": ((torch.randn(256, 64) * 1e-3) ** 2 + 1e-12).double()}
    state = {"model": {"lin.weight": weight},
             "optimizer": {"state": {0: moments}, "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    with Repository.init(tmp_path) as repo:
        back = repo.checkout(repo.commit(copy.deepcopy(state), lossy="extreme"))
    assert_same(back["optimizer"], state["optimizer"])
    assert 0 < _rel(back["model"]["lin.weight"], weight) < 0.05


def _adam_state(weight: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> dict:
    return {"model": {"w": weight.clone()}, "optimizer": {
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]}}


def test_the_same_state_committed_again_is_nothing_to_commit_after_a_lossy_record_was_reused(tmp_path):
    """A first moment whose change rounds to nothing restores as an earlier commit's record, which names that
    commit's input: the identical state committed again (Lightning's last.ckpt beside the top-k file) was coded
    anew against another base and recorded as a second commit, with other values (auditor)."""
    torch.manual_seed(0)
    weight, exp_avg, exp_avg_sq = torch.randn(64, 64), torch.randn(64, 64) * 1e-3, torch.rand(64, 64) * 1e-6 + 1e-7
    with Repository.init(tmp_path) as repo:
        repo.commit(_adam_state(weight, exp_avg, exp_avg_sq, 1), lossy="balanced")
        for step in range(2, 5):
            weight = weight + 0.1 * torch.randn(64, 64)  # a changed state: committed
            exp_avg[0, 0] = torch.nextafter(exp_avg[0, 0], torch.tensor(1.0))  # rounds to the parent's record
            state = _adam_state(weight, exp_avg, exp_avg_sq, step)
            cid = repo.commit(state, lossy="balanced")
            with pytest.raises(NothingToCommitError):
                repo.commit(copy.deepcopy(state), lossy="balanced")
            assert repo.resolve("HEAD") == cid


def _optimizers(model, *makers):
    """Optimizers over consecutive parts of the model's parameters (one each: two, a GAN's), trained 3 steps."""
    params = list(model.parameters())
    optimizers = [make(part) for make, part in zip(makers, [params] if len(makers) == 1 else [params[:2], params[2:]])]
    for _ in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return optimizers


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


@pytest.mark.parametrize("makers, pairing, importance", [
    ([lambda params: torch.optim.RMSprop(params, lr=1e-3)], "weights not paired",
     "none: no Adam second moment to weigh the weights by"),
    ([lambda params: torch.optim.Adagrad(params, lr=1e-2)], "optimizer state of no kind it pairs",
     "none: no Adam second moment to weigh the weights by"),
    ([lambda params: torch.optim.AdamW(params, lr=1e-3)], "optimizer order matches", "estimated from the optimizer"),
    ([_adam, _adam], "several optimizers", "none: the weights were not paired with the optimizer's"),
])
def test_show_says_what_weighed_the_weights_of_each_optimizer(tmp_path, makers, pairing, importance):
    """RMSprop's and Sophia's commits said "importance: estimated from the optimizer state", where nothing was;
    Adagrad's said "no optimizer state found" beside its state (optimizer auditor); a GAN's two unpaired Adams were
    then said to keep no second moment (reader 10)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32))
    optimizers = _optimizers(model, *makers)
    state = {"model": model.state_dict(), **{f"optimizer{i}": o.state_dict() for i, o in enumerate(optimizers)}}
    with Repository.init(tmp_path) as repo:
        shown = repo.show(repo.commit(state, lossy="balanced"))
    assert pairing in shown["pairing"], shown["pairing"]
    assert shown["importance"].startswith(importance), shown["importance"]


class _ThreeLayers(torch.nn.Module):
    """fc1 and fc2 of equal shapes, and out; `extra`: a parameter the optimizer holds, with no gradient yet."""

    def __init__(self, extra: bool):
        super().__init__()
        self.fc1, self.fc2, self.out = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)
        if extra:
            self.extra = torch.nn.Parameter(torch.zeros(3, 7))  # a head not used yet

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _out_of_order_groups(extra: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fc2's fast group listed before fc1's and out's slow one, trained 3 steps."""
    torch.manual_seed(0)
    model = _ThreeLayers(extra)
    slow = [model.fc1.weight, model.fc1.bias, model.out.weight, model.out.bias] + ([model.extra] if extra else [])
    optimizer = torch.optim.Adam([{"params": [model.fc2.weight, model.fc2.bias], "lr": 1e-2},
                                  {"params": slow, "lr": 1e-5}])
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_parameter_with_no_state_yet_keeps_the_callers_pairing_of_the_others(tmp_path):
    """One optimizer parameter without state dropped every live name: the guess from shapes gave fc1's weight fc2's
    moments and fast learning rate, and show said the order matched the model's (auditor 382's t12)."""
    from ckptstore.policy.mapping import map_optimizer, param_ids, param_lrs
    from ckptstore.repo.commit import param_names_of
    from ckptstore.state import flatten

    bounds = {}
    for extra in (False, True):
        model, optimizer = _out_of_order_groups(extra)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        flat = flatten(state)
        pairing = map_optimizer(flat.tensors, param_names_of(model, optimizer), param_ids(flat.skeleton),
                                param_lrs(flat.skeleton))
        assert {s.weight: s.lr for s in pairing.slots if str(s.weight).endswith("weight")} == {
            "model/fc2.weight": 1e-2, "model/fc1.weight": 1e-5, "model/out.weight": 1e-5}
        with Repository.init(tmp_path / str(extra)) as repo:
            shown = repo.show(repo.commit(state, lossy="balanced", model=model, optimizer=optimizer))
        assert shown["pairing"] == "given by the caller"
        bounds[extra] = {t["path"]: t["max_error"] for t in shown["tensors"] if t["path"].startswith("model/fc")
                         and "max_error" in t}
    assert bounds[True] == bounds[False] and len(bounds[True]) == 2  # the stateless head changes no weight's plan


@pytest.mark.parametrize("level", ["balanced", "extreme"])
@pytest.mark.parametrize("told", ["by its module type", "by its name", "DataParallel", "torch.compile"])
def test_a_two_dimensional_norm_weight_and_bias_stay_bit_exact(tmp_path, level, told):
    """A LayerNorm over (16, 512) has a 2-D weight and bias: both were quantized (told from weights only by being
    1-D), though docs/guide.md keeps norm weights and biases exact; balanced lost 59% of the weight's learned
    deviation from 1 (auditor 382's t17). Given `model=`, its module type tells it, through a DDP-like or
    compile wrapper too (reviewer 388: `module.`/`_orig_mod.` names matched nothing); without, the name `ln`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16 * 512), torch.nn.Unflatten(1, (16, 512)),
                                torch.nn.LayerNorm((16, 512)), torch.nn.Flatten(), torch.nn.Linear(16 * 512, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 10, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    names = {"0": "inp", "2": "ln", "4": "out"} if told == "by its name" else {"0": "0", "2": "2", "4": "4"}
    weights = {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in model.state_dict().items()}
    state = {"model": weights, "optimizer": optimizer.state_dict()}
    wrapped = {"DataParallel": torch.nn.DataParallel, "torch.compile": torch.compile}.get(told, lambda m: m)(model)
    live = {"model": wrapped, "optimizer": optimizer} if told != "by its name" else {}
    with Repository.init(tmp_path) as repo:
        back = repo.checkout(repo.commit(copy.deepcopy(state), lossy=level, **live))
    norm = names["2"]
    assert not torch.equal(weights[f"{norm}.weight"], torch.ones(16, 512))  # trained: a deviation from 1 to keep
    assert torch.equal(back["model"][f"{norm}.weight"], weights[f"{norm}.weight"])
    assert torch.equal(back["model"][f"{norm}.bias"], weights[f"{norm}.bias"])
    assert not torch.equal(back["model"][f"{names['0']}.weight"], weights[f"{names['0']}.weight"])  # still lossy


@pytest.mark.parametrize("wrapper", [torch.nn.DataParallel, torch.compile], ids=["DataParallel", "torch.compile"])
@pytest.mark.parametrize("saved_from", ["the wrapper", "the inner model"])
def test_a_wrapped_model_beside_an_ema_copy_pairs_no_copy_by_guess(tmp_path, wrapper, saved_from):
    """With an EMA copy beside the model, a wrapper's names match one copy and the wrapped model's the other: name by
    name, the optimizer's moments went to the EMA (reviewer 390); "as given" on a tie, to torch's AveragedModel's
    (its copy under `.module`, reviewer 393). Matched alike, neither is paired; both copies' norms stay exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16 * 512), torch.nn.Unflatten(1, (16, 512)),
                                torch.nn.LayerNorm((16, 512)), torch.nn.Flatten(), torch.nn.Linear(16 * 512, 10))
    optimizer = torch.optim.AdamW(list(model.parameters())[::-1], lr=1e-3)  # out of the model's order: names pair
    for _ in range(5):
        torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 10, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    wrapped = wrapper(model)
    ema = torch.optim.swa_utils.AveragedModel(model)  # its copy's keys: module.0.weight
    own, copy_of = ((wrapped.state_dict(), copy.deepcopy(model.state_dict())) if saved_from == "the wrapper"
                    else (model.state_dict(), ema.state_dict()))
    state = {"model": own, "ema": copy_of, "optimizer": optimizer.state_dict()}
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(copy.deepcopy(state), lossy="balanced", model=wrapped, optimizer=optimizer)
        back, shown = repo.checkout(cid), repo.show(cid)
    # by its class: Lightning, once imported, replaces torch.compile with a wrapper of its own
    if type(wrapped).__name__ == "OptimizedModule" and saved_from == "the inner model":  # _orig_mod.: no tie
        assert shown["pairing"] == "given by the caller"
        assert not torch.equal(back["model"]["0.weight"], state["model"]["0.weight"])  # the model's: lossy
        assert torch.equal(back["ema"]["module.0.weight"], state["ema"]["module.0.weight"])  # no moments: exact
    else:
        assert shown["pairing"].startswith("the model's names match two copies of it"), shown["pairing"]
    for part in ("model", "ema"):
        norm = next(k for k in state[part] if k.endswith("2.weight"))
        assert torch.equal(back[part][norm], state[part][norm]), (part, norm)


def test_a_wrapped_model_with_a_submodule_named_module_pairs_each_weight_with_its_own_moments():
    """DataParallel around a model that has a submodule named `module` beside `proj` of the same shape: matching each
    name as given, else without `module.`, paired the wrapper's `module.proj.weight` with the inner `module.proj` and
    the rest crosswise, under "given by the caller" (reviewer 392). One naming is chosen for all names."""
    from ckptstore.policy.mapping import map_optimizer, param_ids, param_lrs
    from ckptstore.repo.commit import param_names_of
    from ckptstore.state import flatten

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module, self.proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(self.module(x))

    torch.manual_seed(0)
    inner = Inner()
    optimizer = torch.optim.AdamW([{"params": inner.proj.parameters(), "lr": 1e-2},
                                   {"params": inner.module.parameters(), "lr": 1e-5}])
    inner(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    for state in ({"model": inner.state_dict()}, {"model": torch.nn.DataParallel(inner).state_dict()}):
        flat = flatten({**state, "optimizer": optimizer.state_dict()})
        pairing = map_optimizer(flat.tensors, param_names_of(torch.nn.DataParallel(inner), optimizer),
                                param_ids(flat.skeleton), param_lrs(flat.skeleton))
        prefix = "model/module." if "module.proj.weight" in state["model"] else "model/"  # the wrapper's
        assert pairing.how == "given by the caller"
        assert {s.weight: s.lr for s in pairing.slots} == {
            f"{prefix}proj.weight": 1e-2, f"{prefix}proj.bias": 1e-2,
            f"{prefix}module.weight": 1e-5, f"{prefix}module.bias": 1e-5}


def test_a_state_saved_from_a_middle_wrapper_pairs_by_that_levels_names():
    """DataParallel around a compiled model, its state saved from `.module` (keys `_orig_mod.…`): only the outermost
    and innermost namings were tried, neither matched, and shapes paired layer 2's moments with layer 0 (reviewer
    393). Every wrapper level's naming is tried."""
    from ckptstore.policy.mapping import map_optimizer, param_ids, param_lrs
    from ckptstore.repo.commit import param_names_of
    from ckptstore.state import flatten

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW([{"params": inner[1].parameters(), "lr": 1e-2},
                                   {"params": inner[0].parameters(), "lr": 1e-5}])
    inner(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    wrapped = torch.nn.DataParallel(torch.compile(inner))
    flat = flatten({"model": wrapped.module.state_dict(), "optimizer": optimizer.state_dict()})
    pairing = map_optimizer(flat.tensors, param_names_of(wrapped, optimizer), param_ids(flat.skeleton),
                            param_lrs(flat.skeleton))
    assert pairing.how == "given by the caller"
    assert {s.weight: s.lr for s in pairing.slots} == {"model/_orig_mod.1.weight": 1e-2, "model/_orig_mod.1.bias": 1e-2,
                                                       "model/_orig_mod.0.weight": 1e-5, "model/_orig_mod.0.bias": 1e-5}


def test_an_ema_copy_with_the_models_own_keys_keeps_its_norms_exact_and_gives_no_naming_the_win(tmp_path):
    """A name that matches two copies (the model's and an EMA deepcopy's, same keys) counted as no match: no copy's
    2-D norm was kept exact, and a wrapper's names matching a third copy (an AveragedModel's `module.…`) won 6-0
    and took the optimizer's moments (reviewer 394). Norms stay exact in every copy; such a tie pairs nothing."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.mix = torch.nn.Linear(128, 128), torch.nn.LayerNorm((64, 128))  # not named as a norm

        def forward(self, x):
            return self.mix(self.fc(x).unsqueeze(1).expand(-1, 64, -1))

    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with torch.no_grad():
        net.mix.weight.copy_(torch.randn(64, 128))
    net(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    state = {"model": net.state_dict(), "ema": copy.deepcopy(net).state_dict(), "optimizer": optimizer.state_dict()}
    with Repository.init(tmp_path / "plain") as repo:
        back = repo.checkout(repo.commit(copy.deepcopy(state), lossy="extreme", model=net, optimizer=optimizer))
    for part in ("model", "ema"):
        assert torch.equal(back[part]["mix.weight"], state[part]["mix.weight"]), part
    state["swa"] = torch.optim.swa_utils.AveragedModel(net).state_dict()  # module.fc.weight, ...
    with Repository.init(tmp_path / "wrapped") as repo:
        cid = repo.commit(copy.deepcopy(state), lossy="extreme", model=torch.nn.DataParallel(net), optimizer=optimizer)
        shown, back = repo.show(cid), repo.checkout(cid)
    assert shown["pairing"].startswith("the model's names match two copies of it"), shown["pairing"]
    assert torch.equal(back["swa"]["module.mix.weight"], state["swa"]["module.mix.weight"])


def test_adam_moments_of_the_two_16_bit_types_restore_and_pass_fsck(tmp_path):
    """m in float16 is coded on v in bfloat16 (their sizes match): my check that a base is of its tensor's dtype
    called such a commit damaged, and it could no longer be checked out (reader 14, of f68bb82)."""
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(256, 256)},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": (torch.randn(256, 256) * 1e-3).half(),
                                         "exp_avg_sq": (torch.rand(256, 256) * 1e-6).bfloat16()}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]}}
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(state, lossy="balanced")
        assert fsck(repo, full=True).ok
        restored = repo.checkout(cid)["optimizer"]["state"][0]
    assert restored["exp_avg"].dtype == torch.float16 and restored["exp_avg_sq"].dtype == torch.bfloat16


def test_a_chunk_that_never_keeps_its_bound_is_not_stored_lossy(tmp_path, monkeypatch):
    """After the last finer step the writer raises, and the commit is stored exact; where it stopped trying
    instead, a chunk over its bound was stored, unsaid, and no test noticed (mutation audit)."""
    from ckptstore.policy import fidelity

    state = {"model": {"layer.weight": torch.randn(256, 256, generator=torch.Generator().manual_seed(0))}}
    monkeypatch.setattr(fidelity, "within", lambda *_: False)  # no step is fine enough
    with Repository.init(tmp_path) as repo:
        with pytest.warns(RuntimeWarning, match="cannot keep its level.s error bound.*committed lossless"):
            cid = repo.commit(state, "never within", lossy="balanced")
        assert repo.commit_info(cid).lossy is None
        assert_same(repo.checkout(cid), state)


def _frozen_group_commits(repo, tmp_path, level, commits=2):
    """Commits of an Adam run whose second group has lr 0: its weight never moves, its moments do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    optimizer = torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-3},
                                  {"params": model[2].parameters(), "lr": 0.0}])
    cids = []
    for i in range(commits):
        for _ in range(5):
            x = torch.randn(32, 256)
            (model(x) - x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / f"frozen-{i}.pt")
        cids.append(repo.commit(tmp_path / f"frozen-{i}.pt", lossy=level))
    return cids


def test_the_moments_of_a_frozen_weight_commit_at_a_pruning_level(repo, tmp_path):
    """A weight that did not move keeps its parent's record, so it prunes no moment: its first moment's job took
    the pruning mask of a weight the commit does not encode, and the second commit failed with a KeyError in the
    writer (mutation audit round 11)."""
    cids = _frozen_group_commits(repo, tmp_path, "extreme")
    assert len(repo.log()) == len(cids) == 2 and fsck(repo).ok


def test_the_first_moment_of_a_frozen_weight_is_coded_at_its_fine_step(repo, tmp_path):
    """A weight that did not move at all is as slow as a weight gets: its first moment is coded at the fine step.
    It kept the coarse planned step (an update error of 0.35 in place of 0.07 at `balanced`) (mutation audit
    round 11)."""
    cids = _frozen_group_commits(repo, tmp_path, "balanced")
    moment = _steps(repo, cids[1])["optimizer/state/2/exp_avg"]
    assert moment["codec"] == "normmoment" and moment["rel_error"] < 0.2, moment


def test_an_unchanged_exact_weight_is_not_encoded_again_in_a_lossy_child(tmp_path, monkeypatch):
    """A weight a lossy commit finds unchanged since its lossless parent keeps the parent's exact record unencoded.
    It was encoded again as a lossy residual of zero: a repeat of the same record whose payload the commit's stored
    bytes counted (mutation audit round 11)."""
    from ckptstore.repo import writer

    torch.manual_seed(0)
    w, u = torch.randn(512, 512), torch.randn(512, 512)
    encoded = []
    encode = writer._encode_lossy_chunk

    def spy(job, *args, **kwargs):
        encoded.append(job.key)
        return encode(job, *args, **kwargs)

    with Repository.init(tmp_path / "repo") as repo:
        repo.commit({"model": {"fc1.weight": w, "fc2.weight": u}})
        monkeypatch.setattr(writer, "_encode_lossy_chunk", spy)
        cid = repo.commit({"model": {"fc1.weight": w, "fc2.weight": u + 0.01 * torch.randn_like(u)}}, lossy="balanced")
        assert encoded and not any("fc1" in key for key in encoded), encoded
        assert _steps(repo, cid)["model/fc1.weight"]["tensor"] == repo.manifest(cid).sources["model/fc1.weight"]


# a fine-tune's pace (the tiny net's lr is a from-scratch one), bounded loosely: the chunk steps are the rules' own
_FINE_TUNE_PACE = {"lossy": "balanced", "fast_move": 0.0, "max_weight_error": 0.5}


def _moved_by_halves(state: dict, first: float, second: float, name: str = "fc1.weight") -> dict:
    """The checkpoint with the first half of `name`'s entries moved by `first` of its RMS, the rest by `second`."""
    later = copy.deepcopy(state)
    flat = later["model"][name].view(-1)
    rms, half = flat.pow(2).mean().sqrt(), flat.numel() // 2
    flat[:half] += torch.randn(half) * rms * first
    flat[half:] += torch.randn(flat.numel() - half) * rms * second
    return later


def test_a_chunk_whose_base_kept_the_planned_step_refines_a_later_small_move(tmp_path):
    """With fine_grid, a chunk takes its base chunk's step as its lattice only where that step was refined: a chunk
    whose base was coded at the planned step (a large move) took that coarse step as its lattice, and a later
    fine-tune-sized move there stayed at it (chunk error 2.6e-2 in place of 1.5e-3) (mutation audit round 11)."""
    from ckptstore.policy import EncodingSettings

    state = _trained_state()
    torch.manual_seed(1)
    second = _moved_by_halves(state, 1e-4, 0.3)
    third = _moved_by_halves(second, 1e-4, 1e-4)
    with Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=4096)) as repo:
        repo.commit(state, **_FINE_TUNE_PACE)
        cids = [repo.commit(second, **_FINE_TUNE_PACE), repo.commit(third, **_FINE_TUNE_PACE)]
        before, params = _chunk_steps(repo, _steps(repo, cids[0])["model/fc1.weight"])
        after, _ = _chunk_steps(repo, _steps(repo, cids[1])["model/fc1.weight"])
    planned = np.float32(params["step"])
    coarse = [i for i, step in enumerate(before) if step >= planned]
    assert coarse and len(coarse) < len(before), before  # the set-up: some chunks of the base kept the planned step
    assert all(after[i] < planned for i in coarse), (before, after, planned)


def test_a_first_moment_is_paced_chunk_by_chunk_by_its_weight(tmp_path):
    """A first moment chunked like its weight takes the fine step in the chunks whose weight chunk was coded finer
    than planned, and only there: it took the fine step in every chunk once any weight chunk was (mutation audit
    round 11)."""
    from ckptstore.policy import EncodingSettings

    state = _trained_state()
    torch.manual_seed(1)
    later = _moved_by_halves(_moved(state, 0.0), 1e-4, 0.3)  # new first moments; fc1 moved in its second half
    index = list(state["model"]).index("fc1.weight")  # TinyNet has no buffers: its parameters' order
    with Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=4096)) as repo:
        repo.commit(state, **_FINE_TUNE_PACE)
        shown = _steps(repo, repo.commit(later, **_FINE_TUNE_PACE))
        weight, weight_params = _chunk_steps(repo, shown["model/fc1.weight"])
        moment, params = _chunk_steps(repo, shown[f"optimizer/state/{index}/exp_avg"])
    capped = [step < np.float32(weight_params["step"]) for step in weight]
    assert any(capped) and not all(capped), weight  # the set-up: the weight's chunks moved unlike
    assert len(moment) == len(weight) and params["fine_step"] < params["step"], (moment, params)
    assert [step == np.float32(params["fine_step"]) for step in moment] == capped, (moment, params, weight)


def test_two_identical_moments_in_one_commit_restore_as_the_same_values(tmp_path):
    """Two tensors of one commit with the same reconstruction (layers with equal gradients: equal Adam moments) are
    one record: the second was given its base's record, and its moment restored as an older moment of another
    codec, silently, fsck clean (mutation audit round 11)."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Linear(128, 128) for _ in range(3))
    optimizer = torch.optim.Adam([*a.parameters(), *b.parameters(), *c.parameters()], lr=1e-3)
    with Repository.init(tmp_path) as repo:
        for gate in (1.0, 0.0, 0.0):
            for _ in range(20):
                x = torch.randn(16, 128)
                (a(x) + gate * b(x) + gate * c(x) - x).pow(2).mean().backward()  # b and c: equal gradients
                optimizer.step()
                optimizer.zero_grad()
            cid = repo.commit({"model": {"a": a.state_dict(), "b": b.state_dict(), "c": c.state_dict()},
                               "optimizer": optimizer.state_dict()}, lossy="balanced")
            shown, restored = _steps(repo, cid), repo.checkout(cid)["optimizer"]["state"]
            # b's and c's weights (2 and 4): equal second moments, one record; first moments follow each weight
            assert shown["optimizer/state/4/exp_avg"]["codec"] == "normmoment", gate
            assert shown["optimizer/state/2/exp_avg_sq"]["tensor"] == shown["optimizer/state/4/exp_avg_sq"]["tensor"]
            assert torch.equal(restored[2]["exp_avg_sq"], restored[4]["exp_avg_sq"])


def test_show_says_which_of_its_measured_tensors_the_bound_covers(tmp_path):
    """A frozen weight kept at its `resume-only` reconstruction (no bound) beside a bounded one: show said "worst
    2.6e-02 over 2 tensors, at most 86% of its bound", the worst being the unbounded one (auditor)."""
    from click.testing import CliRunner

    from ckptstore.cli import cli

    torch.manual_seed(0)
    frozen, weight = torch.randn(128, 128), torch.randn(128, 128)
    with Repository.init(tmp_path) as repo:
        repo.commit({"frozen": frozen, "w": weight}, lossy="resume-only")
        # a bound its kept error (2.6e-2) holds: under a finer one it is encoded again (test_a_finer_bound_...)
        cid = repo.commit({"frozen": frozen, "w": weight + 0.05 * torch.randn(128, 128)}, lossy="balanced",
                          max_weight_error=0.1)
        (row,) = [r for r in repo.show(cid)["fidelity"] if r["quantity"].startswith("weights")]
    assert row["tensors"] == 2 and row["bounded"] == 1
    shown = CliRunner().invoke(cli, ["--repo", str(tmp_path), "show", cid]).output
    assert "over 2 tensors; the 1 with a bound at most" in shown, shown


def test_a_finer_bound_on_unchanged_tensors_is_kept_not_the_coarser_stored_reconstruction(repo, tmp_path):
    """Committing the same file again with `--knob max_weight_error=...` kept the coarser record made for those bytes
    (content addressing by the input), so the stricter bound did nothing and nothing said so (fixer helper 329)."""
    (path, first), = _run(repo, tmp_path, "balanced", commits=1)
    original = _load(path)["model"]
    coarse = {name: _rel(repo.checkout(first)["model"][name], original[name]) for name in LOSSY_WEIGHTS}
    assert min(coarse.values()) > 1e-3  # the level's own reconstruction: the finer bound below asks more
    result = CliRunner().invoke(cli, ["--repo", str(repo.root), "commit", str(path), "--lossy", "balanced",
                                      "--knob", "max_weight_error=0.0005"])
    assert result.exit_code == 0, result.output
    finer = repo.resolve("HEAD")
    assert finer != first and repo.manifest(finer).entries != repo.manifest(first).entries
    restored, shown = repo.checkout(finer)["model"], _steps(repo, finer)
    for name in LOSSY_WEIGHTS:  # the bound is the knob times the weight's allowance, at most 2
        bound = shown[f"model/{name}"]["max_error"]
        assert bound <= 0.0005 * 2 and _rel(restored[name], original[name]) <= bound * 1.001 < coarse[name], name
    with pytest.raises(NothingToCommitError):  # the level's looser bound again: the finer record holds it
        repo.commit(path, lossy="balanced")


def _partial_views() -> dict:
    """Tensors that view only part of their storage record: torch.save writes the whole record."""
    gen = torch.Generator().manual_seed(0)
    return {"wte.weight": (torch.randn(1032, 64, generator=gen) * 0.02)[:1000],  # vocab trimmed from its padding
            "off.weight": (torch.randn(400, 30, generator=gen) * 0.05)[100:300],
            "step.weight": (torch.randn(400, 30, generator=gen) * 0.05)[::2],
            "exp.weight": (torch.randn(1, 300, generator=gen) * 0.05).expand(200, 300),
            "other.weight": torch.randn(200, 300, generator=gen) * 0.05}


def test_a_tensor_viewing_part_of_its_record_restores_the_same_from_the_file_and_in_memory(tmp_path, monkeypatch):
    """Its record stays in the container, which `checkout -o` writes: a lossy commit keeps the tensor exact."""
    import ckptstore

    monkeypatch.chdir(tmp_path)
    torch.save(_partial_views(), "ck.pt")
    original = _load("ck.pt")
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert run("init").exit_code == 0
    assert run("commit", "ck.pt", "--lossy", "balanced", "-m", "lossy").exit_code == 0
    assert run("checkout", "HEAD", "-o", "out.pt").exit_code == 0
    from_file, loaded = _load("out.pt"), ckptstore.load("HEAD", repo=".")
    with Repository.open(tmp_path) as repo:
        in_memory = repo.checkout("HEAD")
    for name in ("wte.weight", "off.weight", "step.weight", "exp.weight"):
        for restored in (from_file, loaded, in_memory):
            assert_same(restored[name], original[name])
    assert 0 < _rel(loaded["other.weight"], original["other.weight"]) < 0.25  # the level still holds elsewhere
    assert_same(from_file["other.weight"], loaded["other.weight"])
    show = {line.split()[0]: line for line in run("show", "HEAD").output.splitlines() if ".weight" in line}
    assert "rel.err" not in show["wte.weight"] and "rel.err" in show["other.weight"]


def test_a_peft_models_live_names_pair_with_its_saved_adapters(tmp_path):
    """PEFT names a live adapter `lora_A.default.weight` and saves it as `lora_A.weight`: model= and optimizer= of a
    LoRA model matched no name, and the pairing fell back to a guess from the file's order (auditor 399)."""
    import peft

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    model = peft.get_peft_model(net, peft.LoraConfig(r=4, target_modules=["0", "2"]))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
    state = {"model": peft.get_peft_model_state_dict(model), "optimizer": optimizer.state_dict()}
    assert any(".lora_A.weight" in key for key in state["model"])  # saved without the adapter's name
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(state, lossy="balanced", model=model, optimizer=optimizer)
        assert repo.show(cid)["pairing"] == "given by the caller"


@pytest.mark.parametrize("weights", ["model.safetensors", "weights/model.safetensors", "100%/model.safetensors"])
def test_a_folders_safetensors_weights_pair_only_as_their_shapes_or_given_names_allow(tmp_path, weights):
    """Trainer folders keep weights in model.safetensors, which lists them by name: `k_proj` before `q_proj`, `h.10`
    before `h.2`. Every LoRA projection of one shape was paired with its neighbour's moments, said certain
    (auditor 399, reviewer 400); in a subfolder (a PEFT run's checkpoint-N/), whose paths begin with the name
    escaped, still so (reviewer 406)."""
    from safetensors.torch import save_file

    from ckptstore.policy.mapping import ASK_NAMES, BY_NAME

    torch.manual_seed(0)
    names = [f"layers.{i}.{proj}.weight" for i in range(12) for proj in ("q_proj", "k_proj")]  # the model's order
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in names]
    optimizer = torch.optim.AdamW(params, 1e-3)
    sum(p.square().sum() for p in params).backward()
    optimizer.step()
    folder = tmp_path / "checkpoint-1"
    (folder / weights).parent.mkdir(parents=True)
    save_file({name: p.detach() for name, p in zip(names, params)}, folder / weights)
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    with Repository.init(tmp_path / "repo") as repo:
        cid = repo.commit(folder, lossy="balanced")
        assert repo.show(cid)["pairing"] == BY_NAME + ASK_NAMES


@pytest.mark.parametrize("weight_dtype, moment_dtype", [(torch.bfloat16, torch.float32),
                                                        (torch.float32, torch.bfloat16)])
def test_extreme_prunes_moments_beside_a_weight_of_another_dtype_without_taking_its_chunks_masks(
        tmp_path, weight_dtype, moment_dtype):
    """A bf16 weight beside fp32 moments is cut into chunks at other entries: `extreme` gave the moments the weight's
    prune masks chunk by chunk, IndexError ('unexpected' at the CLI) on the first commit or the residual (auditor
    423)."""
    from ckptstore.policy import EncodingSettings

    torch.manual_seed(0)
    model = torch.nn.Linear(300, 256, bias=False).to(weight_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.weight.grad = torch.randn_like(model.weight)
    optimizer.step()
    state = optimizer.state[model.weight]
    state["exp_avg"], state["exp_avg_sq"] = (state[k].to(moment_dtype) for k in ("exp_avg", "exp_avg_sq"))
    with Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=4096)) as repo:
        for step in range(2):  # a keyframe, then a residual (an Adam step by hand: torch's wants one dtype)
            if step:
                with torch.no_grad():
                    grad = torch.randn(model.weight.shape)
                    state["exp_avg"].mul_(0.9).add_((0.1 * grad).to(moment_dtype))
                    state["exp_avg_sq"].mul_(0.999).add_((0.001 * grad * grad).to(moment_dtype))
                    model.weight.sub_((1e-3 * grad.sign()).to(weight_dtype))
            original = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            cid = repo.commit(original, lossy="extreme", model=model, optimizer=optimizer)
            restored = repo.checkout(cid)
            m, v = (original["optimizer"]["state"][0][k].double() for k in ("exp_avg", "exp_avg_sq"))
            m2, v2 = (restored["optimizer"]["state"][0][k].double() for k in ("exp_avg", "exp_avg_sq"))
            u, u2 = m / (v + 1e-30).sqrt(), m2 / (v2 + 1e-30).sqrt()
            assert float((u2 - u).norm() / u.norm()) <= 1.0  # extreme's update bound
        assert fsck(repo).ok


def test_a_first_moment_of_unchanged_bytes_beside_a_second_moment_coded_anew_is_measured_anew(tmp_path):
    """m's record was kept from the parent for its unchanged bytes, its parent's figures shown, though its error is
    of m / sqrt(v) and v was coded anew: the update 2.8x past extreme's bound, `show` saying 7% of it (auditor 423)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.weight.grad = torch.randn_like(model.weight)
    optimizer.step()
    state = optimizer.state[model.weight]
    state["exp_avg_sq"] = torch.exp(torch.empty(64, 128).uniform_(-20, -10))  # v over four decades
    state["exp_avg"] = torch.randn(64, 128) * 50 * state["exp_avg_sq"].sqrt()
    with Repository.init(tmp_path) as repo:
        repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, lossy="extreme",
                    model=model, optimizer=optimizer)
        state["exp_avg_sq"] = state["exp_avg_sq"] * torch.exp(torch.empty(64, 128).uniform_(-3, 3))  # m's bytes kept
        original = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        cid = repo.commit(original, lossy="extreme", model=model, optimizer=optimizer)
        restored = repo.checkout(cid)["optimizer"]["state"][0]
        u, u2 = ((s["exp_avg"].double() / (s["exp_avg_sq"].double() + 1e-30).sqrt())
                 for s in (original["optimizer"]["state"][0], restored))
        error = float((u2 - u).norm() / u.norm())
        shown = next(t for t in repo.show(cid)["tensors"] if t["path"].endswith("exp_avg"))
        assert error <= 1.0 and shown["rel_error"] == pytest.approx(error, rel=0.05, abs=1e-4), (error, shown)


def test_show_gives_the_error_of_this_commit_where_its_reconstruction_equals_an_older_commits_record(tmp_path):
    """A reconstruction equal to a record of an earlier commit, not the parent's, is stored as that row: `show`
    printed the error measured then (0, where this commit's was 1.0e-3), and the next residual planned from it
    (auditor 443)."""
    import json

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    adam = torch.optim.AdamW(linear.parameters(), lr=1e-5)
    shown, measured = [], []
    with Repository.init(tmp_path) as repo:
        for shift in (0.005, 0.010, 0.004):
            adam.zero_grad()
            linear(torch.randn(4, 128)).sum().backward()
            adam.step()
            with torch.no_grad():
                linear.weight.fill_(1.0 - shift)
            cid = repo.commit({"model": linear.state_dict(), "optimizer": adam.state_dict()}, lossy="extreme")
            back = repo.checkout(cid)["model"]["weight"].double()
            weight = linear.weight.detach().double()
            measured.append(((back - weight).norm() / weight.norm()).item())
            said = CliRunner().invoke(cli, ["--repo", str(tmp_path), "show", cid, "--json"], catch_exceptions=False)
            shown.append(next(t for t in json.loads(said.output)["tensors"] if t["path"] == "model/weight"))
    assert shown[2]["tensor"] == shown[0]["tensor"], shown  # the case itself: c3 restores as c1's record
    assert shown[2]["rel_error"] == pytest.approx(measured[2], rel=1e-3) and measured[2] > 1e-4, (shown, measured)


def test_a_finer_levels_commit_of_an_unchanged_weight_keeps_its_bulk_rule_not_a_coarser_record(tmp_path):
    """`balanced` after `extreme` of the same file kept extreme's record, its error within balanced's bound but
    its bulk entries 6.3e-2 off against balanced's 2 x 0.02 (auditor 443): a looser bound's record is coded again."""
    from ckptstore.policy.fidelity import sample_positions

    torch.manual_seed(0)
    weight = torch.randn(128, 128) * 0.02
    weight.view(-1)[torch.randperm(16384)[:12]] = 3.0 * torch.sign(torch.randn(12))  # most of the norm in 12
    linear = torch.nn.Linear(128, 128)
    linear.weight.data = weight.clone()
    adam = torch.optim.AdamW(linear.parameters(), lr=1e-3)
    for _ in range(3):
        adam.zero_grad()
        linear(torch.randn(8, 128)).pow(2).mean().backward()
        adam.step()
    torch.save({"model": linear.state_dict(), "optimizer": adam.state_dict()}, tmp_path / "c.pt")
    original = linear.weight.detach().double().numpy().ravel()
    sample = np.abs(original)[sample_positions(original.size)]
    bulk = np.abs(original) <= 10 * np.median(sample[sample > 0])
    with Repository.init(tmp_path / "r") as repo:
        coarse = repo.commit(tmp_path / "c.pt", lossy="extreme")
        fine = repo.commit(tmp_path / "c.pt", lossy="balanced", allow_empty=True)
        bound = _recorded_bound(repo, fine)
        back = repo.checkout(fine)["model"]["weight"].double().numpy().ravel()
        ids = [repo.manifest(cid).entries["model/weight"].tensor for cid in (coarse, fine)]
    assert ids[0] != ids[1]
    off = np.linalg.norm(back[bulk] - original[bulk]) / np.linalg.norm(original[bulk])
    assert off <= 2 * bound, (off, bound)


def _recorded_bound(repo, cid):
    """The bound the commit's record of model/weight was coded to."""
    tensor = repo.manifest(cid).entries["model/weight"].tensor
    with repo.db.read() as tx:
        return tensor_rows.load_records(tx, [tensor], with_bases=False)[tensor].params["max_error"]
