"""Lossy levels on sharded commits: 2 real ranks (gloo, FSDP2 + AdamW) against the same states at 1 rank.

The 2-rank run (tests/dcp/lossy_worker.py) commits two `balanced` states on branch `ws2` and saves
their originals with DCP's FileSystemWriter; this process commits the same originals from one
process on branch `ws1`. Every tensor must be planned alike at both world sizes, restore within the
level's bounds, and `ckpt show` must print the measured figures.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.dcp import CkptSavePlanner, CkptStorageReader, CkptStorageWriter
from ckptstore.errors import CkptError
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.policy import LEVELS, EncodingSettings
from tests.conftest import assert_same, outlier_adam_rounds
from tests.dcp.launch import run_ranks
from tests.dcp.lossy_worker import LABELS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
# measured per shard, not planned
MEASURED = {"rel_error", "chunk_steps", "chunk_errors", "source", "base_error", "cycle"}


@pytest.fixture(scope="module")
def lossy_run(tmp_path_factory):
    """(repository, {label: original flat state}, {label: (2-rank commit, 1-rank commit)})."""
    base = tmp_path_factory.mktemp("dcp-lossy")
    Repository.init(base / "repo", encoding=EncodingSettings(chunk_bytes=4096)).close()
    results = run_ranks("lossy", base / "repo", base / "out", world=2, worker="tests.dcp.lossy_worker")
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((base / "out" / "rank0.json").read_text())
    originals, commits = {}, {}
    with Repository.open(base / "repo") as repo:
        for _, label in LABELS:
            dcp_to_torch_save(base / "out" / f"orig-{label}", base / f"{label}.pt")
            state = torch.load(base / f"{label}.pt", weights_only=False)  # written by this test just now
            writer = CkptStorageWriter(repo, branch="ws1", message=f"{label} at 1 rank", lossy="balanced")
            dcp.save(state, storage_writer=writer, planner=CkptSavePlanner())
            originals[label] = {**{f"model.{k}": v for k, v in state["model"].items()},
                                **{f"optim.state.{p}.{k}": v for p, s in state["optim"]["state"].items()
                                   for k, v in s.items()}}
            commits[label] = (report[label], writer.commit_id)
    return base / "repo", originals, commits


def plans_by_fqn(repo: Repository, ref: str) -> dict[str, tuple]:
    """Each logical tensor's plan: its shards' codec and planned params (one distinct plan per tensor)."""
    manifest = repo.manifest(repo.resolve(ref))
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()}, with_bases=False)
    plans = {}
    for item in manifest.dcp["items"]:
        if item["type"] == "tensor":
            found = set()
            for _, _, key in item["chunks"]:
                record = records[manifest.entries[key].tensor]
                params = {k: v for k, v in record.params.items() if k not in MEASURED and "plane" not in k}
                found.add((record.codec, json.dumps(params, sort_keys=True)))
            assert len(found) == 1, (item["fqn"], found)  # every shard of a tensor planned alike
            plans[item["fqn"]] = found.pop()
    return plans


def restored(repo_dir, ref: str, like: dict) -> dict:
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(state, storage_reader=CkptStorageReader(repo_dir, ref))
    return state


def test_every_tensor_is_planned_alike_at_one_and_two_ranks(lossy_run):
    repo_dir, _, commits = lossy_run
    with Repository.open(repo_dir) as repo:
        for two, one in commits.values():
            at_two, at_one = plans_by_fqn(repo, two), plans_by_fqn(repo, one)
            assert at_two == at_one
            lossy = {fqn for fqn, (codec, _) in at_two.items() if codec in ("deadzone", "normmoment", "log2moment")}
            # 2.weight (32 x 129) is quantized though each rank's shard (16 x 129) is below min_elements
            assert {"model.0.weight", "model.2.weight", "optim.state.2.weight.exp_avg"} <= lossy


def test_a_tensor_whose_shard_layout_changed_is_planned_alike_on_every_shard(tmp_path):
    """Saved at 2 ranks, then at 3, the shard of a 3-row weight that kept its key was planned as a residual on the
    first save and the two new ones as keyframes: one tensor, two plans (auditor 415)."""
    Repository.init(tmp_path / "repo").close()
    for world in (2, 3):
        results = run_ranks("relaid", tmp_path / "repo", tmp_path / "out", world, worker="tests.dcp.lossy_worker")
        assert all(r.returncode == 0 for r in results), [r.stdout[-3000:] for r in results]
    with Repository.open(tmp_path / "repo") as repo:
        assert len(repo.manifest(repo.resolve("relaid")).entries) > len(repo.manifest(repo.resolve("relaid~1")).entries)
        plans = plans_by_fqn(repo, "relaid")  # one plan per tensor, or it fails
        assert plans["model.0.weight"][0] == "deadzone"


def test_lossy_sharded_commits_restore_within_the_levels_bounds(lossy_run):
    repo_dir, originals, commits = lossy_run
    level = LEVELS["balanced"]
    with Repository.open(repo_dir) as repo:
        second = repo.manifest(repo.resolve(commits["second"][0]))
        first = repo.manifest(repo.resolve(commits["first"][0]))
        key = next(k for k in second.entries if k.startswith("model.0.weight/%shard/"))
        with repo.db.read() as tx:
            record = tensor_rows.load_records(tx, {second.entries[key].tensor}, with_bases=False)
        assert record[second.entries[key].tensor].base_id == first.entries[key].tensor  # closed-loop residual
    for label, (two, _) in commits.items():
        original = originals[label]
        state = restored(repo_dir, two, original)
        for fqn in ("model.0.bias", "model.2.bias", "optim.state.0.weight.step"):
            assert torch.equal(state[fqn], original[fqn]), fqn  # lossless where the level is
        for fqn in ("model.0.weight", "model.2.weight"):
            error = float((state[fqn] - original[fqn]).norm() / original[fqn].norm())
            assert 0 < error <= 2 * level.max_weight_error, (fqn, error)  # allowance at most 2x
        for param in ("0.weight", "2.weight"):
            m, v = (original[f"optim.state.{param}.{k}"] for k in ("exp_avg", "exp_avg_sq"))
            m2, v2 = (state[f"optim.state.{param}.{k}"] for k in ("exp_avg", "exp_avg_sq"))
            u, u2 = m / (v + 1e-30).sqrt(), m2 / (v2 + 1e-30).sqrt()
            assert float((u2 - u).norm() / u.norm()) <= level.max_update_error


def test_ckpt_show_prints_the_measured_figures_and_fsck_full_passes(lossy_run, monkeypatch):
    repo_dir, _, commits = lossy_run
    monkeypatch.chdir(repo_dir)
    shown = CliRunner().invoke(cli, ["show", commits["second"][0]], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "lossy commit, level balanced; optimizer pairing: by fully qualified name" in shown.output
    assert "measured weights (and SGD momentum): ||W'-W||/||W||: worst" in shown.output
    assert "of its bound" in shown.output and "model.0.weight  torch.float32 (129, 64)  2 shards" in shown.output
    checked = CliRunner().invoke(cli, ["fsck", "--full"], catch_exceptions=False)  # decodes every lossy shard
    assert checked.exit_code == 0, checked.output


def test_a_lossy_writer_without_its_planner_says_what_to_pass(tmp_path):
    with Repository.init(tmp_path / "repo") as repo:
        writer = CkptStorageWriter(repo, lossy="balanced")
        with pytest.raises(CheckpointException) as caught:
            dcp.save({"w": torch.ones(64, 64)}, storage_writer=writer)
        ((error, _),) = caught.value.failures.values()  # (exception, traceback) per failed rank
        assert isinstance(error, CkptError) and "planner=ckptstore.dcp.CkptSavePlanner()" in str(error)
        assert repo.log() == []


def _two_group_adam(nan: str = "") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A float32 layer and a float16 one whose second moments underflowed to 0 (m / sqrt(v): no integer level)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"wide": torch.nn.Linear(256, 128), "low": torch.nn.Linear(256, 128).half()})
    optimizer = torch.optim.Adam([{"params": model["wide"].parameters()},
                                  {"params": model["low"].parameters(), "eps": 1e-4}], lr=1e-3)
    for seed in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(seed))
        (model["wide"](x).mean() + model["low"](x.half()).float().mean() * 1e-2).backward()
        optimizer.step()
    if nan:  # in the weight (a codec sees it) or in the bias (the level keeps it exact: none does)
        with torch.no_grad():
            getattr(model["wide"], nan).view(-1)[0] = float("nan")
    return model, optimizer


@pytest.mark.parametrize("nan", ["", "weight", "bias"], ids=["float16-moments", "nan-weight", "nan-bias"])
def test_a_save_whose_values_a_level_cannot_quantize_is_saved_with_them_lossless(tmp_path, nan):
    """It used to fail the whole dcp.save (no commit) where a plain commit kept them lossless; a NaN in a bias,
    which no codec sees, let the rest be quantized unsaid (reader 13)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _two_group_adam(nan)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with Repository.init(tmp_path / "repo") as repo:
        writer = CkptStorageWriter(repo, message="s", lossy="balanced")
        warned = "values no step quantizes" if nan else "cannot be quantized at level .*exp_avg"
        with pytest.warns(RuntimeWarning, match=warned) as caught:
            dcp.save(state, storage_writer=writer, planner=CkptSavePlanner())
        assert {w.filename for w in caught if "quantiz" in str(w.message)} == {__file__}  # not a line inside torch
        assert repo.commit_info(writer.commit_id).lossy == (None if nan else "balanced")  # nothing at the level
        model, optimizer = _two_group_adam()  # other values, overwritten by the load
        loaded_model, loaded_optim = get_state_dict(model, optimizer)
        loaded = {"model": loaded_model, "optim": loaded_optim}
        dcp.load(loaded, storage_reader=CkptStorageReader(repo, writer.commit_id))
    low = {k: v for k, v in state["optim"]["state"].items() if k.startswith("low.")}
    for name, moments in low.items():  # m kept whole; v, all zeros, exact at the level too
        assert all(torch.equal(loaded["optim"]["state"][name][k], v) for k, v in moments.items()), name
    wide = loaded["optim"]["state"]["wide.weight"]["exp_avg"]
    assert torch.equal(wide, state["optim"]["state"]["wide.weight"]["exp_avg"]) == bool(nan)  # quantized unless NaN
    if nan:  # the rank's shards all kept whole, NaN included
        assert_same(loaded["model"], state["model"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_show_gives_each_sharded_commits_own_figures_where_a_shards_change_rounded_to_nothing(tmp_path):
    """As tests/repo/test_lossy.py's plain commits: one outlier makes the step coarse, the parent's record stays."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptstore.repo.history import show

    tensors = []
    with Repository.init(tmp_path / "repo") as repo:
        for model, optimizer in outlier_adam_rounds(3):
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = copy.deepcopy({"model": model_state, "optim": optimizer_state})
            writer = CkptStorageWriter(repo, lossy="balanced")
            dcp.save(state, storage_writer=writer, planner=CkptSavePlanner())
            back = copy.deepcopy(state)
            dcp.load(back, storage_reader=CkptStorageReader(repo, writer.commit_id))
            original, restored = state["model"]["0.weight"].double(), back["model"]["0.weight"].double()
            actual = ((restored - original).norm() / original.norm()).item()
            row = next(t for t in show(repo, writer.commit_id)["tensors"] if t["path"].startswith("model.0.weight/"))
            assert row["rel_error"] == pytest.approx(actual, rel=1e-3) and actual <= row["max_error"]
            tensors.append(row["tensor"])
    assert len(set(tensors)) < len(tensors)  # a record was reused: what the test is about


def _balanced_and_back(tmp_path, model_state: dict, optim_state: dict) -> dict:
    """The model and optimizer state saved at `balanced` by a DCP save, and loaded back into zeros."""
    with Repository.init(tmp_path / "repo") as repo:
        writer = CkptStorageWriter(repo, lossy="balanced")
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer, planner=CkptSavePlanner())
        back = {"model": {k: torch.zeros_like(v) for k, v in model_state.items()},
                "optim": {"state": {p: {k: torch.zeros_like(v) for k, v in s.items()}
                                    for p, s in optim_state["state"].items()},
                          "param_groups": optim_state["param_groups"]}}
        dcp.load(back, storage_reader=CkptStorageReader(repo, writer.commit_id))
    return back


def test_a_sharded_save_of_adam_with_amsgrad_keeps_its_moments_exact(tmp_path):
    """3ed2ea6 kept amsgrad's moments exact in file commits only: a DCP save still put v above its exact max."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    for i in range(6):  # big gradients first: the max stays above v afterwards
        optimizer.zero_grad()
        model(torch.randn(64, 256) * (3.0 if i < 3 else 0.1)).pow(2).mean().backward()
        optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    back = _balanced_and_back(tmp_path, model_state, optim_state)
    for name, moments in optim_state["state"].items():
        assert all(torch.equal(back["optim"]["state"][name][k], v) for k, v in moments.items()), name
    assert not torch.equal(back["model"]["0.weight"], model_state["0.weight"])  # the weights take the level


def test_a_sharded_save_keeps_moments_exact_beside_state_no_adam_keeps(tmp_path):
    """Adan's state (exp_avg, exp_avg_sq, exp_avg_diff): its moments were coded as Adam's and a resume drifted 3%."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _adam_trained()
    model_state, optim_state = get_state_dict(model, optimizer)
    for state in optim_state["state"].values():
        state["exp_avg_diff"] = state["exp_avg"] * 0.5
    back = _balanced_and_back(tmp_path, model_state, optim_state)
    for name, moments in optim_state["state"].items():
        assert all(torch.equal(back["optim"]["state"][name][k], v) for k, v in moments.items()), name
    assert not torch.equal(back["model"]["0.weight"], model_state["0.weight"])  # the weights take the level


def test_a_sharded_save_of_rmsprop_keeps_its_momentum_exact_as_a_file_commit_does(tmp_path):
    """RMSprop's momentum_buffer is in its own units: a file commit keeps it exact, a DCP save gave it SGD's bound."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(64, 256)).pow(2).mean().backward()
        optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    with Repository.init(tmp_path / "repo") as repo:
        writer = CkptStorageWriter(repo, lossy="balanced")
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer, planner=CkptSavePlanner())
        back = {"optim": {"state": {p: {k: torch.zeros_like(v) for k, v in s.items()}
                                    for p, s in optim_state["state"].items()},
                          "param_groups": optim_state["param_groups"]}}
        dcp.load(back, storage_reader=CkptStorageReader(repo, writer.commit_id))
    for name, state in optim_state["state"].items():
        assert torch.equal(back["optim"]["state"][name]["momentum_buffer"], state["momentum_buffer"]), name


def _adam_trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(32, 128)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def _lossy_save(repo: Repository, state: dict) -> tuple[str, dict]:
    """A `balanced` sharded save of `state` (tensor dicts, and "optim": an optimizer state dict), loaded back."""
    writer = CkptStorageWriter(repo, lossy="balanced")
    dcp.save(state, storage_writer=writer, planner=CkptSavePlanner())
    back = {key: {name: torch.zeros_like(value) for name, value in part.items()} for key, part in state.items()
            if key != "optim"}
    if "optim" in state:
        back["optim"] = {"state": {p: {n: torch.zeros_like(v) for n, v in s.items()}
                                   for p, s in state["optim"]["state"].items()},
                         "param_groups": state["optim"]["param_groups"]}
    dcp.load(back, storage_reader=CkptStorageReader(repo, writer.commit_id))
    return writer.commit_id, back


def _state_exact(back: dict, saved: dict) -> None:
    for param, entries in saved["optim"]["state"].items():
        for name, value in entries.items():
            assert torch.equal(back["optim"]["state"][param][name], value), (param, name)


def test_an_ema_copy_of_the_model_beside_it_keeps_the_level_for_both(tmp_path):
    """Each moment matched model.w and ema.w: nothing paired, and the whole commit went in lossless (auditor)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _adam_trained()
    model_state, optim_state = get_state_dict(model, optimizer)
    ema = {name: value.clone() * 0.99 for name, value in model_state.items()}
    with Repository.init(tmp_path / "repo") as repo:
        cid, back = _lossy_save(repo, {"model": model_state, "ema": ema, "optim": optim_state})
        assert repo.commit_info(cid).lossy == "balanced"
    for part, original in (("model", model_state), ("ema", ema)):
        weight, restored = original["0.weight"], back[part]["0.weight"]
        error = float((restored - weight).norm() / weight.norm())
        assert 0 < error < LEVELS["balanced"].max_weight_error * 2, (part, error)  # quantized, within its bound


@pytest.mark.parametrize("make", [lambda p: torch.optim.RMSprop(p, lr=1e-3), lambda p: torch.optim.Adagrad(p, lr=1e-2),
                                  lambda p: torch.optim.Adam(p, lr=1e-3)])
def test_optimizer_state_the_level_does_not_pair_stays_exact(tmp_path, make):
    """RMSprop's square_avg, Adagrad's sum and plain state_dict()'s numbered Adam state were taken for weights
    when no moment paired (a regression of the EMA mend, reader)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    optimizer = make(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(32, 128)).pow(2).mean().backward()
        optimizer.step()
    state = {"model": dict(model.state_dict()), "optim": optimizer.state_dict()}  # numbered state: nothing pairs
    with Repository.init(tmp_path / "repo") as repo:
        _, back = _lossy_save(repo, state)
    _state_exact(back, state)
    weight = state["model"]["0.weight"]  # the weights take the level, as in a file commit (reader)
    assert 0 < float((back["model"]["0.weight"] - weight).norm() / weight.norm()) < 0.04


def test_a_lossy_sharded_save_without_optimizer_state_quantizes_its_weights_as_a_file_commit_does(tmp_path):
    """No moment to pair: every tensor was taken for certain not a weight, and stored lossless (auditor)."""
    generator = torch.Generator().manual_seed(0)  # a submodule called `state` (an SSM's) is no optimizer state
    state = {"model": {"big.weight": torch.randn(128, 96, generator=generator),
                       "state.proj.weight": torch.randn(128, 96, generator=generator)}}
    with Repository.init(tmp_path / "repo") as repo:
        cid, back = _lossy_save(repo, state)
        assert repo.commit_info(cid).lossy == "balanced"
    for name, weight in state["model"].items():
        assert 0 < float((back["model"][name] - weight).norm() / weight.norm()) < 0.04, name


def test_optimizer_state_is_told_by_where_it_sits_not_by_its_roles_names(tmp_path):
    """bitsandbytes names Adam's moments state1/state2: they were quantized as weights, and a model submodule called
    `state` with a parameter named like a role (`mu`) was kept exact as if it were optimizer state (reader)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.inp, model.state = torch.nn.Linear(128, 128), torch.nn.Module()
    model.state.mu = torch.nn.Parameter(torch.randn(128, 128))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    (model.inp(torch.randn(32, 128)) @ model.state.mu).pow(2).mean().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    renamed = {"state1": "exp_avg", "state2": "exp_avg_sq"}  # a third-party optimizer's own names for them
    optim_state["state"] = {p: {n: s[renamed.get(n, n)] for n in ("state1", "state2", "step")}
                            for p, s in optim_state["state"].items()}
    state = {"model": model_state, "optim": optim_state}
    with Repository.init(tmp_path / "repo") as repo:
        _, back = _lossy_save(repo, state)
    _state_exact(back, state)
    mu = model_state["state.mu"]
    assert 0 < float((back["model"]["state.mu"] - mu).norm() / mu.norm()) < 0.04  # a weight: it takes the level


def test_an_optimizer_saved_at_the_top_claims_only_its_parameters_state_not_a_models_state_submodule(tmp_path):
    """With the optimizer's state dict at the top (`state.…`, `param_groups`), a model's own `state.proj.weight`
    was taken for optimizer state and kept lossless (reader)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.inp, model.state = torch.nn.Linear(128, 128), torch.nn.Module()
    model.state.proj = torch.nn.Linear(128, 128)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    model.state.proj(model.inp(torch.randn(32, 128))).pow(2).mean().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    with Repository.init(tmp_path / "repo") as repo:
        writer = CkptStorageWriter(repo, lossy="balanced")
        dcp.save({**model_state, **optim_state}, storage_writer=writer, planner=CkptSavePlanner())
        back = {**{n: torch.zeros_like(v) for n, v in model_state.items()},
                "state": {p: {n: torch.zeros_like(v) for n, v in s.items()} for p, s in optim_state["state"].items()},
                "param_groups": optim_state["param_groups"]}
        dcp.load(back, storage_reader=CkptStorageReader(repo, writer.commit_id))
    _state_exact({"optim": back}, {"optim": optim_state})
    for name in ("inp.weight", "state.proj.weight"):
        weight = model_state[name]
        assert 0 < float((back[name] - weight).norm() / weight.norm()) < 0.04, name
