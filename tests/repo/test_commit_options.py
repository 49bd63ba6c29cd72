"""What a commit records: a whole step, and text the metadata keeps as given on both engines (repo/commit.py)."""

import numpy as np
import pytest
import torch

from ckptstore.errors import CkptError
from ckptstore.repo import fsck

pytestmark = pytest.mark.both_backends


@pytest.mark.parametrize("step", [2.5, True, "3", float("nan"), torch.tensor(2.5), 1 << 63])
def test_a_step_that_is_not_a_whole_64_bit_number_is_refused_before_anything_is_written(repo, step):
    with pytest.raises(CkptError, match="step"):
        repo.commit({"w": torch.ones(3)}, step=step)
    assert repo.log() == []


@pytest.mark.parametrize("step", [7, np.int64(7), torch.tensor(7), 7.0])
def test_whole_steps_of_any_integer_kind_are_recorded_as_ints_and_restore(repo, step):
    cid = repo.commit({"w": torch.ones(3)}, step=step)
    assert repo.commit_info(cid).step == 7 and type(repo.commit_info(cid).step) is int
    assert fsck(repo).ok
    assert torch.equal(repo.checkout(cid)["w"], torch.ones(3))


@pytest.mark.parametrize("options", [{"message": "a\x00b"}, {"author": "a\x00b"}, {"author": "a" * 256}])
def test_text_past_what_the_metadata_holds_is_refused_alike_on_both_engines(repo, options):
    with pytest.raises(CkptError, match="NUL|at most 255"):
        repo.commit({"w": torch.ones(3)}, **options)
    assert repo.log() == []


@pytest.mark.parametrize("options, words", [
    ({"message": "d\udce9j\udce0"}, "message .* not UTF-8"), ({"author": "\udcff"}, "author .* not UTF-8"),
    ({"branch": "b\udce9"}, "branch .* not UTF-8"), ({"branch": 5}, "branch is a int"),
    ({"message": b"bytes"}, "message is a bytes"), ({"metrics": {"loss": "abc"}}, "metric 'loss' is 'abc'"),
    ({"metrics": {"loss": None}}, "not a number"), ({"metrics": {"loss": torch.ones(2)}}, "not a number"),
    ({"metrics": {3: 2.0, "3": 5.0}}, "metrics 3 and '3' are both recorded as '3'"),
    ({"metrics": {"l\udcff": 1.0}}, "metric name .* not UTF-8")])
@pytest.mark.parametrize("blocking", [True, False])
def test_what_the_metadata_cannot_record_is_refused_by_the_call_itself(repo, options, words, blocking):
    """Raw errors after the objects were written (or only at result() in the background) before."""
    with pytest.raises(CkptError, match=words):
        repo.commit({"w": torch.ones(3)}, blocking=blocking, **options)
    assert repo.log() == [] and repo.commit({"w": torch.ones(3)}, message=None, metrics={"loss": np.float32(1)})


def test_a_ref_that_is_not_text_is_one_clear_error(repo):
    import ckptstore

    repo.commit({"w": torch.ones(3)})
    for ref in (None, 1234):
        with pytest.raises(CkptError, match="a ref is a branch, tag or commit id as text"):
            ckptstore.load(ref, repo=repo)


def test_a_too_long_author_from_the_environment_is_refused_naming_it(repo, monkeypatch):
    monkeypatch.setenv("CKPT_AUTHOR", "a" * 300)
    with pytest.raises(CkptError, match="CKPT_AUTHOR"):
        repo.commit({"w": torch.ones(3)})
    monkeypatch.setenv("CKPT_AUTHOR", "a" * 255)
    assert repo.commit_info(repo.commit({"w": torch.ones(3)})).author == "a" * 255


def _given_back(repo, path) -> bool:
    """Whether the repository holds `path`'s content as a file a checkout may write over without losing it."""
    from ckptstore.formats.filemap import file_digest
    from ckptstore.metadata import files as file_rows

    with repo.db.read() as tx:
        return bool(file_rows.known_digests(tx, [file_digest(str(path))]))


def test_a_lossless_commit_remembers_its_file_and_a_wholly_lossy_one_does_not(repo, tmp_path):
    """Only a file the commit stores exactly is content the store gives back: flipped, a lossy commit whose every
    tensor is quantized called its original file saved, for a checkout to overwrite without a word, and a lossless
    commit's file was called unsaved (mutation audit round 11)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(5)
    torch.save({"w": torch.randn(300, 100, generator=generator), "step": 1}, tmp_path / "a.pt")
    save_file({"w": torch.randn(256, 256, generator=generator) * 0.02}, str(tmp_path / "m.safetensors"))
    repo.commit(tmp_path / "a.pt")
    assert _given_back(repo, tmp_path / "a.pt")
    manifest = repo.manifest(repo.commit(tmp_path / "m.safetensors", lossy="balanced", branch="lossy"))
    assert manifest.entries["w"].tensor != manifest.sources["w"]  # quantized: no tensor of the file stored exactly
    assert not _given_back(repo, tmp_path / "m.safetensors")


def test_a_states_raw_bytes_are_its_tensors_bytes(repo):
    """A state has no file: its raw size is its tensors' bytes, which stats and log divide stored bytes by. It was
    recorded as 0 (mutation audit round 11)."""
    cid = repo.commit({"w": torch.randn(100, 100), "b": torch.randn(100, dtype=torch.float64)})
    assert repo.commit_info(cid).raw_bytes == 100 * 100 * 4 + 100 * 8


def test_the_same_values_in_a_legacy_torch_file_of_other_bytes_is_nothing_to_commit(repo, tmp_path):
    """A lossless commit compares what it stores, not the files' bytes: the legacy torch format writes the same
    values as other bytes on each save, and a second, identical commit of them was recorded (mutation audit
    round 11)."""
    from ckptstore.errors import NothingToCommitError

    w = torch.randn(64, 64)
    held = [w.clone(), w.clone()]  # both alive: the legacy format keys storages by their addresses
    for i, tensor in enumerate(held):
        torch.save({"w": tensor}, tmp_path / f"l{i}.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "l0.pt").read_bytes() != (tmp_path / "l1.pt").read_bytes()  # the set-up
    repo.commit(tmp_path / "l0.pt")
    with pytest.raises(NothingToCommitError):
        repo.commit(tmp_path / "l1.pt")
    assert len(repo.log()) == 1


def test_a_message_is_kept_as_git_keeps_one_without_trailing_spaces_or_blank_lines_around_it(repo):
    made = repo.commit({"w": torch.ones(3)}, message="\n\n  title  \n\n \n\t\n  body line\t\n\n")
    assert repo.commit_info(made).message == "  title\n\n  body line"
    assert repo.commit_info(repo.commit({"w": torch.zeros(3)}, message=" \n\t ")).message == ""
    kept = "a\rb\x0bc\u2028d\x85 \u00a0\x0c"  # not line ends, nor white space git drops: kept
    assert repo.commit_info(repo.commit({"w": torch.ones(4)}, message=kept + " \r\n")).message == kept
