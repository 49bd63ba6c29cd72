"""--trust-pickle: classes missing here, and values it cannot store, give clear errors or bytes kept."""

import argparse
import importlib
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from ckptstore import formats
from ckptstore.errors import PickledObjectsError, UnsupportedStateError
from tests.conftest import ckpt_env
from tests.formats.test_formats import make_trainer_folder

ROOT = pathlib.Path(__file__).resolve().parents[2]


def save_object_of_a_missing_class(tmp_path, dest):
    """torch.save an object whose class lives in a module that this process then cannot import."""
    (tmp_path / "gone_args.py").write_text("class TrainingArguments:\n    def __init__(self):\n        self.lr = 0.1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("gone_args")
        torch.save(module.TrainingArguments(), dest)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gone_args", None)
        os.remove(tmp_path / "gone_args.py")


def test_a_trusted_folder_keeps_a_file_of_a_missing_class_as_bytes(tmp_path):
    folder = make_trainer_folder(tmp_path / "checkpoint-10")
    save_object_of_a_missing_class(tmp_path, folder / "training_args.bin")
    env = ckpt_env()
    run = lambda *args: subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=tmp_path, env=env,
                                       capture_output=True, text=True, timeout=120)
    assert run("init").returncode == 0
    result = run("commit", "checkpoint-10", "--trust-pickle", "-m", "trusted")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr  # was ModuleNotFoundError
    result = run("checkout", "HEAD", "-o", "out")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "training_args.bin").read_bytes() == (folder / "training_args.bin").read_bytes()


def test_a_trusted_lone_file_of_a_missing_class_names_it(tmp_path):
    save_object_of_a_missing_class(tmp_path, tmp_path / "args.bin")
    with pytest.raises(PickledObjectsError, match="cannot be imported here.*gone_args"):
        formats.read_checkpoint(tmp_path / "args.bin", trust_pickle=True)


@pytest.mark.parametrize("value, hint", [
    (argparse.Namespace(lr=0.1), r"argparse.Namespace cannot be stored without pickle; store vars\(args\)"),
    (torch.nn.Linear(2, 2), r"Linear cannot be stored without pickle; store model.state_dict\(\)"),
    (pathlib.PurePosixPath("/data"), r"PurePosixPath cannot be stored without pickle; store str\(path\)"),
])
def test_trusted_values_it_cannot_store_say_what_to_store_instead(tmp_path, value, hint):
    torch.save({"v": value}, tmp_path / "x.pt")
    with pytest.raises(PickledObjectsError, match="values must still be tensors"):
        formats.read_checkpoint(tmp_path / "x.pt")
    with pytest.raises(UnsupportedStateError, match="v: values of type .*" + hint):
        formats.read_checkpoint(tmp_path / "x.pt", trust_pickle=True)


def test_a_trusted_folder_keeps_objects_it_cannot_store_as_bytes(tmp_path):
    folder = make_trainer_folder(tmp_path / "checkpoint-10")
    torch.save(argparse.Namespace(lr=0.1), folder / "training_args.bin")
    checkpoint = formats.read_checkpoint(folder, trust_pickle=True)  # was: refused, though untrusted it is kept
    kinds = {f.name: f.format for f in checkpoint.files}
    assert kinds["training_args.bin"] == "blob" and kinds["optimizer.pt"] == "torch"


@pytest.mark.parametrize("content", [b"\x80", b"\x80\x02", b"\x80\x02}q\x00(X"])
def test_a_damaged_pickle_is_a_format_error_not_a_traceback(tmp_path, content):
    from ckptstore.errors import CheckpointFormatError

    (tmp_path / "x.pt").write_bytes(content)
    with pytest.raises(CheckpointFormatError, match="not a readable torch.save file"):
        formats.read_checkpoint(tmp_path / "x.pt")  # b"\x80" was an IndexError from torch's unpickler


def test_a_refused_file_names_the_class_torch_would_not_load(tmp_path):
    from ckptstore.formats import torchfile, torchzip

    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "a.pt")
    for read in (formats.read_checkpoint, torchzip.read, torchfile.load):  # ours, and torch's own reader
        with pytest.raises(PickledObjectsError, match=r"\(argparse.Namespace is not among the classes torch.load"):
            read(tmp_path / "a.pt")


def test_a_trusted_file_whose_records_share_their_first_and_last_bytes_comes_back_byte_for_byte(repo, tmp_path):
    """Under --trust-pickle records are matched to tensors by content: matched by their first and last 64 bytes
    only, record 0 (of which the state views only the first half) came back as record 1 (mutation audit)."""
    base, other = torch.zeros(64), torch.zeros(64)
    base[40] = 99.0
    other[30] = 1.0  # the same size, first and last 64 bytes as base's record, another middle
    state = {"a": base[:32], "t1": other}
    torch.save(state, tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt", trust_pickle=True)
    repo.checkout_to(cid, tmp_path / "out.pt")
    assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "a.pt").read_bytes()
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(back) == ["a", "t1"] and all(torch.equal(back[k], v) for k, v in state.items())
    assert back["a"].untyped_storage().tolist() == base.untyped_storage().tolist()  # 99.0 at 40 included
