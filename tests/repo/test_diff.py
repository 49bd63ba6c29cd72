"""`diff` of tensors that torch cannot convert or whose squares overflow float64 (repo/diff.py)."""

import json
import math
import warnings

import torch

from ckptstore import Repository
from tests.conftest import ckpt_here


def _changed(tmp_path, before: torch.Tensor, after: torch.Tensor):
    with Repository.init(tmp_path) as repo:
        repo.commit({"w": before})
        repo.commit({"w": after})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's overflow and invalid-value warnings reached the CLI user
            row, = repo.diff("HEAD~1", "HEAD")
    assert row.status == "changed"
    return row.relative_l2


def test_a_changed_float4_tensor_is_changed_without_a_distance(tmp_path):
    """torch has no conversion for packed float4: `ckpt diff` failed with "copy_ not implemented" (auditor)."""
    before = torch.zeros(8, dtype=torch.uint8)
    after = before.clone()
    after[3] = 0x21
    assert _changed(tmp_path, before.view(torch.float4_e2m1fn_x2), after.view(torch.float4_e2m1fn_x2)) is None


def test_the_distance_of_float64_values_past_1e154_is_finite(tmp_path):
    """Their squares overflow float64: the relative L2 came out nan, with numpy's overflow warning (auditor)."""
    before = torch.tensor([2e200, 2e200], dtype=torch.float64)
    after = torch.tensor([2e200, 3e200], dtype=torch.float64)
    assert math.isclose(_changed(tmp_path, before, after), math.sqrt(0.5) / 2, rel_tol=1e-12)


def test_the_distance_to_float64_values_past_1e154_from_small_ones_is_finite(tmp_path):
    """Scaled by the old values only, a new value of 1e200 overflowed again: inf (reader)."""
    before = torch.tensor([1.0, 1.0], dtype=torch.float64)
    after = torch.tensor([1.0, 1e200], dtype=torch.float64)
    assert math.isclose(_changed(tmp_path / "up", before, after), 1e200 / math.sqrt(2), rel_tol=1e-12)
    tiny = torch.tensor([1e-200, 2e-200], dtype=torch.float64)  # squares below float64's smallest
    assert math.isclose(_changed(tmp_path / "down", tiny, tiny * 2), 1.0, rel_tol=1e-12)


def test_the_distance_between_tensors_holding_inf_is_nan_without_a_warning(tmp_path):
    """inf - inf made numpy warn of an invalid value at the CLI user (auditor)."""
    assert math.isnan(_changed(tmp_path, torch.tensor([1.0, float("inf")]), torch.tensor([2.0, float("inf")])))


def test_the_distance_between_values_near_float64s_largest_is_right(tmp_path):
    """Scaled norms multiplied back overflowed, and a change past the range was infinite: 0.0 for a halving (reader)."""
    big = torch.full((4,), 1e308, dtype=torch.float64)
    assert math.isclose(_changed(tmp_path / "half", big, big / 2), 0.5, rel_tol=1e-12)
    assert math.isclose(_changed(tmp_path / "flip", big[:1], -big[:1]), 2.0, rel_tol=1e-12)
    one_flipped = big.clone()
    one_flipped[3] = -1e308
    assert math.isclose(_changed(tmp_path / "one", big, one_flipped), 1.0, rel_tol=1e-12)


def test_a_file_split_otherwise_but_byte_for_byte_the_same_shows_no_change(tmp_path, monkeypatch):
    """A file committed by an older ckptstore, committed again unchanged, showed its container as a changed tensor:
    the newer split takes a transposed tensor's record out of it (mixed-versions auditor)."""
    from ckptstore.formats import torchzip

    torch.save({"w": torch.randn(32, 48).t(), "step": 3}, tmp_path / "a.pt")
    with Repository.init(tmp_path / "repo") as repo:
        dense_order = torchzip._dense_order
        monkeypatch.setattr(torchzip, "_dense_order", lambda shape, stride: (
            order if (order := dense_order(shape, stride)) == sorted(order) else None))  # as before version 3
        repo.commit(tmp_path / "a.pt")
        monkeypatch.undo()
        repo.commit(tmp_path / "a.pt")
        rows = repo.diff("HEAD~1", "HEAD")
    assert [r.path for r in rows] == ["%container", "w"] and {r.status for r in rows} == {"unchanged"}


def test_checkpoints_of_the_same_weights_at_other_steps_list_the_values_that_differ(tmp_path):
    """Non-tensor state was never compared: a step, a learning rate and an RNG list that all differed gave
    '0 of 1 tensors differ' (resume-exactness auditor)."""
    from click.testing import CliRunner

    from ckptstore.cli import cli
    from ckptstore.repo.diff import VALUE

    weights = {"w": torch.ones(4)}
    with Repository.init(tmp_path) as repo:
        repo.commit({"model": weights, "step": 100, "scheduler": {"base_lrs": [0.1]}, "rng": [1, 2], 3: "same"})
        repo.commit({"model": weights, "step": 200, "scheduler": {"base_lrs": [0.5]}, "rng": (1, 2), 3: "same",
                     "new": None})
        rows = repo.diff("HEAD~1", "HEAD")
    values = {row.path: row.status for row in rows if row.dtype == VALUE}
    assert values == {"step": "changed", "scheduler/base_lrs/0": "changed", "rng": "changed",  # list -> tuple
                      "new": "added"}  # one row: not its container's too (git-habits auditor)
    assert [(row.path, row.status) for row in rows if row.dtype != VALUE] == [("model/w", "unchanged")]
    shown = CliRunner().invoke(cli, ["--repo", str(tmp_path), "diff", "HEAD~1", "HEAD"])
    assert shown.exit_code == 0 and "  changed step (a non-tensor value)" in shown.output
    assert shown.output.endswith("0 of 1 tensors differ; 4 non-tensor values differ\n")


def test_a_str_key_spelled_like_a_tuple_key_and_a_modules_metadata_are_values_of_their_own(tmp_path):
    """A str key holding a tuple key's JSON took the tuple key's path and hid its change; an OrderedDict's
    attributes (a state_dict's _metadata: module versions) were not compared (hostile-input auditor)."""
    from collections import OrderedDict

    def module(version):
        weights = OrderedDict(w=torch.ones(2))
        weights._metadata = OrderedDict({"": {"version": version}})
        return weights

    with Repository.init(tmp_path) as repo:
        repo.commit({"cfg": {'["tuple", [1, 2]]': 1, (1, 2): 7}, "model": module(1)})
        repo.commit({"cfg": {'["tuple", [1, 2]]': 999, (1, 2): 7}, "model": module(2)})
        rows = {row.path: row.status for row in repo.diff("HEAD~1", "HEAD") if row.is_value}
    assert rows == {'cfg/["tuple", [1, 2]]': "changed", "model/%attrs/_metadata/%22%22/version": "changed"}


def test_values_nested_past_pythons_stack_in_a_forged_manifest_differ_without_a_traceback():
    """The walk of a skeleton is recursive: a forged manifest's nesting (a commit's own nests at most 200) raised
    RecursionError (review of a051588)."""
    from types import SimpleNamespace

    from ckptstore.repo import diff as diff_module

    node = 1
    for _ in range(5000):
        node = ["list", [node]]
    forged = SimpleNamespace(files=[SimpleNamespace(name="", skeleton=node)])
    assert diff_module.skeleton_values(forged)["/"].startswith("nested past Python's stack")
    from ckptstore.repo.exporter import _plain_values

    assert _plain_values(forged) == []  # a file's root node, read as text without a crash: no value to name


def test_the_distance_over_slices_whose_later_ones_hold_larger_values_is_right(tmp_path, monkeypatch):
    """The norm is kept a slice at a time (2**22 elements): when a later slice held larger values, the sum so far
    was rescaled by the ratio of the scales, not its square (mutation audit). Slices of 4 elements here."""
    import numpy as np

    from ckptstore.repo import diff as diff_module
    from ckptstore.state import element_slices

    monkeypatch.setattr(diff_module, "element_slices",
                        lambda raw, first=0, elements=4: element_slices(raw, first, min(elements, 4)))
    before = torch.tensor([1.0] * 8 + [100.0] * 4, dtype=torch.float16)  # the last slice holds the largest values
    after = before.clone()
    after[:2] = 2.0  # a change in the first slice
    x, y = before.double().numpy(), after.double().numpy()
    want = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    assert math.isclose(_changed(tmp_path, before, after), want, rel_tol=1e-12)


def test_a_tensor_whose_shape_changed_has_no_distance_and_one_that_was_zeros_an_infinite_one(tmp_path):
    """A reshaped tensor's values were compared as if it had kept its shape, and a change from all zeros read as
    no change (0.0) (mutation audit)."""
    from click.testing import CliRunner

    from ckptstore.cli import cli

    with Repository.init(tmp_path) as repo:
        repo.commit({"z": torch.zeros(4), "s": torch.ones(4), "r": torch.arange(6.0).reshape(2, 3)})
        repo.commit({"z": torch.ones(4), "s": torch.ones(6), "r": torch.arange(6.0).reshape(3, 2)})
        rows = {row.path: (row.status, row.relative_l2) for row in repo.diff("HEAD~1", "HEAD")}
    assert rows == {"z": ("changed", math.inf), "s": ("changed", None), "r": ("changed", None)}
    shown = CliRunner().invoke(cli, ["--repo", str(tmp_path), "diff", "HEAD~1", "HEAD", "--json"])
    assert shown.exit_code == 0, shown.output
    assert {row["path"]: row["relative_l2"] for row in json.loads(shown.output)} == {"z": "inf", "s": None, "r": None}


def test_a_file_kept_as_bytes_added_or_removed_is_one_row_not_also_a_value(tmp_path):
    """A folder's notes.txt removed and config.json added were each listed twice, once as a changed non-tensor
    value (auditor)."""
    from ckptstore.repo.diff import VALUE

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(4)}, run / "m.pt")
    (run / "notes.txt").write_text("hi\n")
    with Repository.init(tmp_path) as repo:
        repo.commit(run)
        (run / "notes.txt").unlink()
        (run / "config.json").write_text("{}\n")
        repo.commit(run)
        rows = repo.diff("HEAD~1", "HEAD")
    assert [row for row in rows if row.dtype == VALUE] == []
    assert sorted((row.path, row.status) for row in rows if row.status != "unchanged") == [
        ("config.json/%25blob", "added"), ("notes.txt/%25blob", "removed")]


def test_a_tied_tensor_is_compared_at_its_own_path_whichever_side_ties_it(tmp_path):
    """A tied path has no entry of its own (its skeleton names the first path): diff called it added or removed
    though both commits held it, and hid its change where both tied it (auditor helper 282)."""
    import ckptstore
    from ckptstore.repo.diff import diff

    emb = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    with Repository.init(tmp_path) as repo:
        tied = ckptstore.save({"embed.weight": emb, "lm_head.weight": emb}, repo=repo)
        untied = ckptstore.save({"embed.weight": emb, "lm_head.weight": emb + 1}, repo=repo)
        retied = ckptstore.save({"embed.weight": emb * 2, "lm_head.weight": emb * 2}, repo=repo)
        rows = lambda a, b: {r.path: (r.status, r.relative_l2) for r in diff(repo, a, b)}  # noqa: E731
        norm = lambda t: float(torch.linalg.vector_norm(t))  # noqa: E731
        for a, b, before in ((tied, untied, emb), (untied, tied, emb + 1)):  # relative to the older side
            assert rows(a, b)["embed.weight"] == ("unchanged", 0.0)
            status, rel = rows(a, b)["lm_head.weight"]
            assert status == "changed" and math.isclose(rel, norm(torch.ones(4, 3)) / norm(before), rel_tol=1e-5)
        assert {path: status for path, (status, _) in rows(tied, retied).items()} == {
            "embed.weight": "changed", "lm_head.weight": "changed"}
        assert rows(tied, retied)["lm_head.weight"][1] == rows(tied, retied)["embed.weight"][1] == 1.0


def test_a_dtype_or_shape_change_is_said_with_what_it_was(tmp_path):
    """diff showed only the newer dtype and shape: a float32 -> bfloat16 cast read as a change of nothing (auditor)."""
    from tests.conftest import ckpt_here

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(4)})
        repo.commit({"w": torch.ones(4, dtype=torch.bfloat16)})
        repo.commit({"w": torch.ones(2, 2, dtype=torch.bfloat16)})
        (cast,) = repo.diff("HEAD~2", "HEAD~1")
        (reshaped,) = repo.diff("HEAD~1", "HEAD")
        (same,) = repo.diff("HEAD~2", "HEAD~2")
    assert cast.was == ("torch.float32", (4,)) and reshaped.was == ("torch.bfloat16", (4,)) and same.was is None
    assert reshaped.to_json()["old_dtype"] == "torch.bfloat16" and reshaped.to_json()["old_shape"] == [4]
    out = ckpt_here(tmp_path, "diff", "HEAD~2", "HEAD~1").stdout
    assert "changed w torch.float32 (4,) -> torch.bfloat16 (4,) rel_l2=" in out, out


def test_diff_counts_tensors_not_a_files_own_bytes_and_log_prints_metrics_whole(tmp_path):
    """Only `step` changed, and diff said '1 of 2 tensors differ' (a torch zip's container counted as a tensor);
    `log` printed loss=2.34568 and tokens=1.23457e+06 for 2.3456789 and 1234567 (auditor 442)."""
    assert ckpt_here(tmp_path, "init").returncode == 0
    for step in (1, 2):
        torch.save({"w": torch.ones(4), "step": step}, tmp_path / "c.pt")
        said = ckpt_here(tmp_path, "commit", "c.pt", "--metric", "loss=2.3456789", "--metric", "tokens=1234567")
        assert said.returncode == 0, said.stderr
    diff = ckpt_here(tmp_path, "diff", "HEAD~1", "HEAD")
    assert diff.stdout.endswith("0 of 1 tensors differ; 1 non-tensor values differ\n"), diff.stdout
    assert "Metrics: loss=2.3456789, tokens=1234567\n" in ckpt_here(tmp_path, "log", "-n", "1").stdout
    torch.save({"w": torch.ones(4), "step": 2, "note": b"xyz"}, tmp_path / "c.pt")  # bytes a user keeps: a value
    assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    said = ckpt_here(tmp_path, "diff", "HEAD~1", "HEAD").stdout
    assert said.endswith("0 of 1 tensors differ; 1 non-tensor values differ\n"), said  # reviewer 444
