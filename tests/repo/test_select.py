"""Partial loads: `keys=` / `--only` restore the matching values and read only their chains."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptstore
from ckptstore.cli import cli
from ckptstore.errors import CkptError
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.repo.select import NothingSelectedError
from tests.conftest import Trainer, assert_same, ckpt_here


class CountingStore:
    """The repository's store, recording every byte range read from it: (object, offset, length)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, oid, verify=True):
        data = self.inner.get(oid, verify)
        self.reads.append((oid, 0, len(data)))
        return data

    def view(self, oid, verify=True):
        data = self.inner.view(oid, verify)
        self.reads.append((oid, 0, len(data)))
        return data

    def open_ranges(self):
        store, ranges = self, self.inner.open_ranges()

        class Ranges:
            def read(self, oid, offset, length, into=None):
                store.reads.append((oid, offset, length))
                return ranges.read(oid, offset, length, into)

            def close(self):
                ranges.close()

        return Ranges()


def _chain_ranges(repo, manifest, paths):
    """(object, offset, length) of every stored chunk down the chains of the tensors at `paths`."""
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {manifest.entries[p].tensor for p in paths})
    return {(c.object_id, c.offset, c.length if c.length is not None else repo.store.size(c.object_id))
            for r in records.values() for c in r.chunks}


def _commits(repo, tmp_path, lossy=None, n=3):
    trainer, cid = Trainer(), None
    for i in range(n):
        trainer.train(3)
        path = tmp_path / f"c{i}.pt"
        torch.save(trainer.state(), path)
        cid = repo.commit(path, step=trainer.step, lossy=lossy)
    return cid, trainer.state()


def _reads_of(repo, fn):
    counting = CountingStore(repo.store)
    repo.store = counting
    try:
        result = fn()
    finally:
        repo.store = counting.inner
    manifest_oid = repo.commit_info("HEAD").manifest_object
    return result, {r for r in counting.reads if r[0] != manifest_oid}


@pytest.mark.parametrize("lossy", [None, "balanced"])
def test_weights_only_load_reads_only_the_weights_chains(repo, tmp_path, lossy):
    cid, state = _commits(repo, tmp_path, lossy)
    manifest = repo.manifest(cid)
    model = [p for p in manifest.entries if p.startswith("model/")]
    others = [p for p in manifest.entries if not p.startswith("model/")]
    wanted, unwanted = _chain_ranges(repo, manifest, model), _chain_ranges(repo, manifest, others)
    assert wanted and unwanted and not wanted & unwanted  # weights and optimizer state share no chunk

    loaded, data_reads = _reads_of(repo, lambda: ckptstore.load(cid, repo=repo, keys=["model.*"]))
    assert list(loaded) == ["model"] and list(loaded["model"]) == list(state["model"])
    if lossy is None:
        assert_same(loaded["model"], state["model"])
    else:  # the weights as a full checkout of the lossy commit gives them
        assert_same(loaded["model"], repo.checkout(cid)["model"])
    assert data_reads == wanted  # every chunk of the weights' chains, and nothing else
    assert not data_reads & unwanted
    read_bytes = sum(n for _, _, n in data_reads)
    _, full = _reads_of(repo, lambda: repo.checkout(cid))
    assert full & unwanted and read_bytes < sum(n for _, _, n in full)


def test_patterns_select_nested_keys_scalars_and_a_tied_tensor(repo):
    embed = torch.randn(8, 4)
    state = {"model": {"embed.weight": embed, "head.weight": embed, "fc": torch.ones(3)},
             "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}, 1: {"exp_avg": torch.ones(2)}},
                           "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
             "step": 7, "losses": [torch.tensor(1.0), torch.tensor(2.0)]}
    cid = repo.commit(state)
    assert_same(repo.checkout(cid, keys=["optimizer.state.1"]),
                {"optimizer": {"state": {1: {"exp_avg": torch.ones(2)}}}})
    assert repo.checkout(cid, keys=["step", "optimizer.param_groups.*.lr"]) == {
        "step": 7, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    assert_same(repo.checkout(cid, keys=["model/head.weight"]), {"model": {"head.weight": embed}})
    assert_same(repo.checkout(cid, keys=["losses.1", "model.f*"]),
                {"model": {"fc": torch.ones(3)}, "losses": [torch.tensor(2.0)]})
    with pytest.raises(NothingSelectedError, match="no path of commit .* matches nothing.*"):
        repo.checkout(cid, keys=["nothing.*"])
    odd = repo.commit({"emb[1]": torch.ones(2), "emb1": torch.zeros(2), "lr[0]": 0.1, "lr0": 0.2})
    assert_same(repo.checkout(odd, keys=["emb[1]"]), {"emb[1]": torch.ones(2)})  # a path as `ckpt show` lists it
    assert repo.checkout(odd, keys=["lr[0]"]) == {"lr[0]": 0.1}  # selects itself, glob characters and all
    assert repo.checkout(odd, keys=["lr[0-9]"]) == {"lr0": 0.2}  # and a glob that names no path stays a glob


def test_a_path_as_show_lists_it_selects_itself_alone_not_the_paths_it_folds_with(repo, tmp_path):
    """Keys "a.b", "a/b" (stored "a%2Fb") and a nested a -> b (stored "a/b") were one pattern after "/", "." and "%2F"
    were folded: each path `ckpt show` lists selected all three (auditor helper 384). Patterns naming no path fold."""
    state = {"a.b": torch.zeros(1), "a/b": torch.ones(1), "a": {"b": torch.full((1,), 2.0)},
             "l": [torch.full((1,), 3.0)], "l.0": torch.full((1,), 4.0)}
    cid = repo.commit(state)
    shown = CliRunner().invoke(cli, ["--repo", str(repo.root), "show", cid]).output
    assert {"a.b", "a%2Fb", "a/b", "l.0", "l/0"} <= {line.split()[0] for line in shown.splitlines() if line.strip()}
    assert_same(repo.checkout(cid, keys=["a.b"]), {"a.b": torch.zeros(1)})
    assert_same(repo.checkout(cid, keys=["a%2Fb"]), {"a/b": torch.ones(1)})
    assert_same(repo.checkout(cid, keys=["a/b"]), {"a": {"b": torch.full((1,), 2.0)}})
    assert_same(repo.checkout(cid, keys=["l.0"]), {"l.0": torch.full((1,), 4.0)})
    assert_same(repo.checkout(cid, keys=["l/0"]), {"l": [torch.full((1,), 3.0)]})
    assert_same(repo.checkout(cid, keys=["a"]), {"a": {"b": torch.full((1,), 2.0)}})  # a container: all of it
    assert_same(repo.checkout(cid, keys=["l.*"]), {"l": [torch.full((1,), 3.0)], "l.0": torch.full((1,), 4.0)})


def _trainer_folder(folder, trainer):
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": trainer.step}))


def test_folder_commit_partial_load_and_checkout(repo, tmp_path):
    trainer = Trainer()
    trainer.train(2)
    _trainer_folder(tmp_path / "checkpoint-2", trainer)
    cid = repo.commit(tmp_path / "checkpoint-2")
    loaded = repo.checkout(cid, keys=["model.safetensors.fc1.*", "trainer_state.json"])
    assert list(loaded) == ["model.safetensors", "trainer_state.json"]
    committed = load_file(tmp_path / "checkpoint-2/model.safetensors")
    assert_same(loaded["model.safetensors"], {k: v for k, v in committed.items() if "fc1" in k})

    out = tmp_path / "out"
    repo.checkout_to(cid, out, keys=["optimizer.pt.state.*", "model.safetensors.fc1.*", "trainer_state.json"])
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert (out / "trainer_state.json").read_bytes() == (tmp_path / "checkpoint-2/trainer_state.json").read_bytes()
    assert_same(load_file(out / "model.safetensors"), loaded["model.safetensors"])
    with safe_open(out / "model.safetensors", "pt") as handle:  # written anew, with the file's own metadata
        assert handle.metadata() == {"format": "pt"}
    assert_same(torch.load(out / "optimizer.pt", weights_only=True),
                {"state": trainer.optimizer.state_dict()["state"]})
    repo.checkout_to(cid, tmp_path / "whole", keys=["model.safetensors"])  # a file selected whole: its bytes
    assert ((tmp_path / "whole/model.safetensors").read_bytes()
            == (tmp_path / "checkpoint-2/model.safetensors").read_bytes())
    (tmp_path / "in_the_way" / "optimizer.pt").mkdir(parents=True)  # was "unexpected IsADirectoryError"
    with pytest.raises(CkptError, match="optimizer.pt is a folder where the commit has a file"):
        repo.checkout_to(cid, tmp_path / "in_the_way", keys=["optimizer.pt.state.*"])


def test_cli_checkout_only_writes_the_selected_sub_state(repo, tmp_path, monkeypatch):
    cid, state = _commits(repo, tmp_path, n=1)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(cli, ["checkout", cid, "--only", "model.fc*", "--only", "step", "-o", "part.pt"])
    assert result.exit_code == 0, result.output
    part = torch.load(tmp_path / "part.pt", weights_only=True)
    assert_same(part, {"model": {k: v for k, v in state["model"].items() if k.startswith("fc")}, "step": 3})
    refused = runner.invoke(cli, ["checkout", cid, "--only", "model.*"])
    assert refused.exit_code == 2 and "it needs -o PATH" in refused.output, refused.output  # a usage error
    assert repo.head()[1] == cid


def test_a_formats_own_entry_that_show_lists_is_named_as_such_when_selected(repo, tmp_path):
    """`ckpt show` lists a torch file's `%container` (and a safetensors file's `%header`) among its paths; selecting
    it said "no path matches" and sent the user back to `ckpt show`, the listing they had copied it from."""
    cid, _ = _commits(repo, tmp_path, n=1)
    listed = ckpt_here(tmp_path, "show", cid)
    assert "%container" in listed.stdout, listed.stdout
    refused = ckpt_here(tmp_path, "checkout", cid, "--only", "%container", "-o", "part.pt")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "%container is the file format's own entry" in refused.stderr, refused.stderr
    assert not (tmp_path / "part.pt").exists()


def test_a_partial_folder_checkout_that_fails_midway_leaves_the_folder_as_it_was(repo, tmp_path, monkeypatch):
    import errno

    from ckptstore import formats
    from ckptstore.errors import DiskFullError

    trainer = Trainer()
    trainer.train(1)
    _trainer_folder(tmp_path / "a", trainer)
    first = repo.commit(tmp_path / "a")
    trainer.train(1)
    _trainer_folder(tmp_path / "b", trainer)
    second = repo.commit(tmp_path / "b")
    only = ["model.safetensors", "optimizer.pt"]
    repo.checkout_to(first, tmp_path / "out", keys=only)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    writing, written = formats.write_file, []

    def the_disk_fills_at_the_second_file(*args, **kwargs):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(writing(*args, **kwargs))

    monkeypatch.setattr(formats, "write_file", the_disk_fills_at_the_second_file)
    with pytest.raises((DiskFullError, OSError)):
        repo.checkout_to(second, tmp_path / "out", keys=only, force=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before  # no temp files either


def test_equal_tensors_at_two_paths_come_back_as_two_tensors(repo):
    """Stored once, handed out once: an optimizer's in-place step on a.weight changed b.weight too where the
    checkout's copy is gone; only a training round trip noticed (mutation audit)."""
    cid = repo.commit({"model": {"a.weight": torch.zeros(16), "b.weight": torch.zeros(16)}}, "equal tensors")
    for state in (repo.checkout(cid), repo.checkout(cid, keys=["model.*"])):
        state["model"]["a.weight"].add_(1.0)
        assert not state["model"]["b.weight"].any()


def test_none_and_none_spelled_as_text_keys_are_selected_each_by_its_own_path(repo):
    """The walk of a partial load took str(key) as a key's path, not the one flatten gave: keys=["by/None"] gave
    the None key's tensor too, and by/%none, the path `ckpt show` lists for the None key, matched nothing
    (mutation audit)."""
    cid = repo.commit({"layers": {"0": torch.zeros(2), "1": torch.ones(2)},
                       "by": {None: torch.full((2,), 5.0), "None": torch.full((2,), 7.0)}})
    assert_same(repo.checkout(cid, keys=["by/None"]), {"by": {"None": torch.full((2,), 7.0)}})
    assert_same(repo.checkout(cid, keys=["by/%none"]), {"by": {None: torch.full((2,), 5.0)}})
    assert_same(repo.checkout(cid, keys=["layers/%31"]), {"layers": {"1": torch.ones(2)}})  # str "1", as listed



def test_values_that_are_none_are_selected_like_any_other(repo, tmp_path):
    """A matched None was taken for "nothing matched": `keys=["*"]` dropped a scheduler that was None, a list lost
    its None items (so later items moved up) and a param group its `foreach: None` (auditor helper 282, high)."""
    state = {"model": {"w": torch.ones(2)}, "scaler": None, "epoch": 1, "hist": [0.5, None, 0.25],
             "groups": [{"lr": 0.1, "foreach": None, "fused": None}]}
    cid = ckptstore.save(state, repo=repo)
    assert_same(ckptstore.load(cid, repo=repo, keys=["*"]), state)
    assert ckptstore.load(cid, repo=repo, keys=["hist.*"]) == {"hist": [0.5, None, 0.25]}
    assert ckptstore.load(cid, repo=repo, keys=["groups.0.*"]) == {"groups": state["groups"]}
    assert ckptstore.load(cid, repo=repo, keys=["scaler"]) == {"scaler": None}
    torch.save(state, tmp_path / "s.pt")
    repo.commit(tmp_path / "s.pt")
    result = CliRunner().invoke(cli, ["--repo", str(repo.root), "checkout", "HEAD", "--only", "*",
                                      "-o", str(tmp_path / "all.pt")])
    assert result.exit_code == 0, result.output
    assert_same(torch.load(tmp_path / "all.pt", weights_only=True), state)

def test_a_partial_load_of_a_state_dict_keeps_its_module_versions(repo):
    """A state_dict is an OrderedDict whose _metadata holds its modules' versions (load_state_dict reads them):
    a partial load gave the OrderedDict without it (mutation audit)."""
    from collections import OrderedDict

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    cid = repo.commit({"model": model.state_dict(), "step": 3})
    got = repo.checkout(cid, keys=["model.1.*"])
    assert list(got) == ["model"] and type(got["model"]) is OrderedDict
    assert list(got["model"]) == ["1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert got["model"]._metadata == model.state_dict()._metadata
    assert got["model"]._metadata["1"] == {"version": 2}


def test_a_pattern_naming_a_level_selects_the_safetensors_tensors_below_it(repo, tmp_path):
    """keys=["model"] names the level of a file's "model.*" tensors, as the docs promise; it matched nothing in a
    safetensors file, whose tensor names hold the dots (mutation audit)."""
    save_file({"model.w": torch.ones(3), "head.b": torch.zeros(2)}, tmp_path / "m.safetensors")
    cid = repo.commit(tmp_path / "m.safetensors")
    assert_same(repo.checkout(cid, keys=["model"]), {"model.w": torch.ones(3)})
    repo.checkout_to(cid, tmp_path / "part.safetensors", keys=["model"])
    assert_same(load_file(tmp_path / "part.safetensors"), {"model.w": torch.ones(3)})


def test_a_file_in_a_subfolder_of_a_committed_folder_is_selected_by_its_path(repo, tmp_path):
    """A folder's sub/opt.pt is stored as sub%2Fopt.pt: keys=["sub/opt.pt"] and ["sub/opt.pt.state.*"] matched
    nothing (mutation audit)."""
    folder = tmp_path / "checkpoint-1"
    (folder / "sub").mkdir(parents=True)
    torch.save({"state": {"m": torch.ones(2)}, "lr": 0.1}, folder / "sub" / "opt.pt")
    torch.save({"w": torch.ones(3)}, folder / "model.pt")
    cid = repo.commit(folder)
    assert_same(repo.checkout(cid, keys=["sub/opt.pt"]), {"sub/opt.pt": {"state": {"m": torch.ones(2)}, "lr": 0.1}})
    assert_same(repo.checkout(cid, keys=["sub/opt.pt.state.*"]), {"sub/opt.pt": {"state": {"m": torch.ones(2)}}})


def test_a_key_is_selected_by_its_own_text_though_stored_escaped(repo, tmp_path):
    """Keys "acc%" and "1" are stored as "acc%25" and "%31": only those spellings selected them, and a folder's
    file "ü 50%.pt" was "no path matches" (auditor helper 282)."""
    state = {"metrics": {"acc%": torch.ones(1), "1": torch.zeros(1), "emb[1]": torch.full((1,), 2.0),
                         "emb1": torch.full((1,), 3.0)}}
    cid = ckptstore.save(state, repo=repo)
    assert_same(ckptstore.load(cid, repo=repo, keys=["metrics.acc%"]), {"metrics": {"acc%": torch.ones(1)}})
    assert_same(ckptstore.load(cid, repo=repo, keys=["metrics.1"]), {"metrics": {"1": torch.zeros(1)}})
    assert_same(ckptstore.load(cid, repo=repo, keys=["metrics.acc%25"]), {"metrics": {"acc%": torch.ones(1)}})
    assert_same(ckptstore.load(cid, repo=repo, keys=["metrics.emb[1]"]),  # as written first, not a glob
                {"metrics": {"emb[1]": torch.full((1,), 2.0)}})
    values = ckptstore.save({"model": {"w": torch.ones(3)}, "acc%": 0.5, "1": 7}, repo=repo)  # no tensor (helper 293)
    assert_same(ckptstore.load(values, repo=repo, keys=["model.*", "acc%", "1"]),
                {"model": {"w": torch.ones(3)}, "acc%": 0.5, "1": 7})
    folder = tmp_path / "run"
    (folder / "sub").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, folder / "sub" / "ü 50%.pt")
    torch.save({"w": torch.zeros(2)}, folder / "other.pt")
    repo.commit(folder)
    result = CliRunner().invoke(cli, ["--repo", str(repo.root), "checkout", "HEAD", "--only", "sub/ü 50%.pt",
                                      "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "out").rglob("*.pt")] == ["ü 50%.pt"]


def test_a_partial_load_keeps_views_sharing_a_storage_whose_first_holder_is_left_out(repo, tmp_path):
    """flatten marks only a tensor's first node with its view: keys=["same", "t"] of {"base": b, "same": b,
    "t": b.t()} read `same` standalone, so a change to it no longer showed in `t` (auditor helper 300)."""
    b = torch.arange(6.0).reshape(2, 3)
    state = {"base": b, "same": b, "t": b.t(), "model": {"w": b, "wt": b.t()}}
    cid = repo.commit(state)
    torch.save(state, tmp_path / "s.pt")
    repo.checkout_to(repo.commit(tmp_path / "s.pt"), tmp_path / "part.pt", keys=["same", "t"])
    written = torch.load(tmp_path / "part.pt", weights_only=True)
    for got, same, t in ((repo.checkout(cid, keys=["same", "t"]), "same", "t"),
                         (repo.checkout(cid, keys=["model"])["model"], "w", "wt"), (written, "same", "t")):
        assert_same(got[t], b.t())
        assert got[same].untyped_storage().data_ptr() == got[t].untyped_storage().data_ptr()
        got[same][0, 1] = 100.0
        assert got[t][1, 0].item() == 100.0


def test_an_ordered_dicts_attribute_that_show_lists_is_selected_by_its_path(repo, tmp_path):
    """`ckpt show` lists od/%attrs/extra, but --only and keys= of it found "no path of commit ... matches": the
    pruner never looked inside an OrderedDict's attributes (auditor helper 300)."""
    from collections import OrderedDict

    od = OrderedDict(a=torch.ones(2))
    od.extra, od.versions = torch.arange(3), {"": {"version": 1}}
    repo.commit({"od": od, "step": 4})
    runner = CliRunner()
    assert "od/%attrs/extra" in runner.invoke(cli, ["--repo", str(repo.root), "show", "HEAD"]).output
    got = repo.checkout("HEAD", keys=["od/%attrs/extra", "od.%attrs.versions.*"])
    assert list(got) == ["od"] and type(got["od"]) is OrderedDict and not got["od"]
    assert vars(got["od"]).keys() == {"extra", "versions"} and got["od"].versions == od.versions
    assert_same(got["od"].extra, torch.arange(3))
    result = runner.invoke(cli, ["--repo", str(repo.root), "checkout", "HEAD", "--only", "od/%attrs/extra",
                                 "-o", str(tmp_path / "x.pt")])
    assert result.exit_code == 0, result.output
    written = torch.load(tmp_path / "x.pt", weights_only=True)["od"]
    assert vars(written).keys() == {"extra"} and not written
    assert_same(written.extra, torch.arange(3))


def test_a_key_named_as_a_formats_own_entry_is_pointed_to_when_its_text_selects_the_entry(tmp_path):
    """A tensor named '%header' could not be selected by its own text, and the refusal did not say how (auditor 420)."""
    save_file({"%header": torch.ones(3), "x": torch.zeros(1)}, tmp_path / "f.safetensors")
    with ckptstore.Repository.init(tmp_path / "r") as repo:
        cid = repo.commit(tmp_path / "f.safetensors")
        with pytest.raises(NothingSelectedError, match="your own key of that text is %25header: select it so"):
            repo.checkout(cid, keys=["%header"])
        assert torch.equal(repo.checkout(cid, keys=["%25header"])["%header"], torch.ones(3))


def test_a_commit_naming_tuple_keys_by_their_repr_as_before_65c1714_lists_each_tensor_once(tmp_path, monkeypatch):
    """Commits made before 65c1714 named an IntEnum or namedtuple tuple key by repr(): show listed that path, diff
    and export each tensor twice, and selecting the listed path was refused as the format's own entry (auditor
    424). Read now under the names flatten gives, once each."""
    import collections
    import enum

    import zstandard

    from ckptstore import state as state_module
    from ckptstore.repo import export

    class E(enum.IntEnum):
        A = 1

    pair = collections.namedtuple("pair", "a b")
    state = {"opt": {(E.A, 2): torch.ones(3), pair(1, "x"): {"w": torch.zeros(2)}}, "w": torch.full((2,), 5.0)}
    with ckptstore.Repository.init(tmp_path / "r") as repo:
        with monkeypatch.context() as old:
            old.setattr(state_module, "stored_tuple_key", lambda key: key)  # flatten as before 65c1714
            cid = repo.commit(state)
        stored = repo.store.get(repo.commit_info(cid).manifest_object)
        assert b"%tuple:(<E.A: 1>, 2)" in zstandard.ZstdDecompressor().decompressobj().decompress(bytes(stored))
        listed = [t["path"] for t in repo.show(cid)["tensors"]]
        assert sorted(listed) == ["opt/%tuple:(1, 'x')/w", "opt/%tuple:(1, 2)", "w"], listed
        assert len(repo.diff(cid, cid)) == 3
        assert export(repo, cid, "torch", tmp_path / "all.pt").tensors == 3
        assert torch.equal(repo.checkout(cid, keys=["opt/%tuple:(1, 2)"])["opt"][(1, 2)], torch.ones(3))
        restored = repo.checkout(cid)
        assert torch.equal(restored["opt"][(1, "x")]["w"], torch.zeros(2)) and torch.equal(restored["w"], state["w"])
        tied = torch.ones(3)  # one tensor under two tuple keys: named once, where flatten met it first (reviewer 426)
        with monkeypatch.context() as old:
            old.setattr(state_module, "stored_tuple_key", lambda key: key)
            cid = repo.commit({"opt": {(E.A, 3): tied, (E.A, 2): tied}, "w": torch.zeros(2)})
        assert sorted(t["path"] for t in repo.show(cid)["tensors"]) == ["opt/%tuple:(1, 3)", "w"]
        assert sorted(row.path for row in repo.diff(cid, cid)) == ["opt/%tuple:(1, 2)", "opt/%tuple:(1, 3)", "w"]
        back = repo.checkout(cid)["opt"]
        assert back[(1, 2)] is back[(1, 3)] and torch.equal(back[(1, 2)], tied)
