import json
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ckptstore import formats
from ckptstore.errors import CheckpointFormatError, CkptError
from ckptstore.formats.torchfile import numpy_safe_globals
from ckptstore.state import materialize
from tests.conftest import assert_same


def _write_back(checkpoint, dest):
    value_of = lambda p: materialize(checkpoint.tensors[p])
    for record in checkpoint.files:
        formats.write_file(record, formats.destination(checkpoint.kind, record, dest), value_of,
                           lambda p: checkpoint.tensors[p])


def test_safetensors_written_back_byte_identical(tmp_path):
    tensors = {"w": torch.randn(30, 20), "b": torch.randn(20).to(torch.bfloat16), "i": torch.arange(5)}
    src = tmp_path / "model.safetensors"
    save_file(tensors, src, metadata={"format": "pt"})
    checkpoint = formats.read_checkpoint(src)
    assert checkpoint.files[0].format == "safetensors"
    _write_back(checkpoint, tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == src.read_bytes()
    state = formats.to_state("file", checkpoint.files, lambda p: materialize(checkpoint.tensors[p]))
    assert_same({k: state[k] for k in tensors}, tensors)


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_every_float8_safetensors_holds_is_a_tensor_in_memory_as_load_file_gives_it(tmp_path, dtype):
    from safetensors.torch import load_file

    tensors = {"x": torch.arange(1, 9, dtype=torch.uint8).view(getattr(torch, dtype))}
    save_file(tensors, tmp_path / "f8.safetensors")
    checkpoint = formats.read_checkpoint(tmp_path / "f8.safetensors")
    state = formats.to_state("file", checkpoint.files, lambda p: materialize(checkpoint.tensors[p]))
    assert_same(load_file(tmp_path / "f8.safetensors"), {k: state[k] for k in tensors})


def test_torch_file_loaded_safely_and_rewritten_equal(tmp_path):
    state = {"w": torch.randn(3, 3), "np": np.random.get_state(), "py": random.getstate(), "n": 3}
    torch.save(state, tmp_path / "a.pt")
    checkpoint = formats.read_checkpoint(tmp_path / "a.pt")
    _write_back(checkpoint, tmp_path / "b.pt")
    with torch.serialization.safe_globals(numpy_safe_globals()):
        back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert_same(state["w"], back["w"])
    assert back["py"] == state["py"] and back["n"] == 3
    assert_same(list(state["np"]), list(back["np"]))


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickled_objects_are_refused_unless_trusted(tmp_path):
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointFormatError, match="--trust-pickle"):
        formats.read_checkpoint(tmp_path / "evil.pt")


@pytest.mark.parametrize("content", [b"", b"hello world, not a checkpoint", b"PK\x03\x04garbage"])
def test_non_checkpoint_files_get_a_clear_error(tmp_path, content):
    (tmp_path / "x.pt").write_bytes(content)
    with pytest.raises(CheckpointFormatError):
        formats.read_checkpoint(tmp_path / "x.pt")


def test_truncated_torch_file_is_refused(tmp_path):
    torch.save({"w": torch.randn(1000)}, tmp_path / "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "a.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        formats.read_checkpoint(tmp_path / "a.pt")


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointFormatError, match="does not exist"):
        formats.read_checkpoint(tmp_path / "nope.pt")


def make_trainer_folder(folder, seed=0):
    """A folder laid out like transformers.Trainer's checkpoint-N."""
    torch.manual_seed(seed)
    folder.mkdir(parents=True)
    model = {"bert.weight": torch.randn(16, 8), "bert.bias": torch.randn(8), "head.weight": torch.randn(2, 8)}
    save_file(model, folder / "model.safetensors", metadata={"format": "pt"})
    params = list(model.values())
    opt = torch.optim.AdamW([torch.nn.Parameter(p.clone()) for p in params], lr=5e-5)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
               folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10 + seed, "log_history": []}))
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (folder / "training_args.bin").write_bytes(pickle.dumps({"lr": 5e-5}))
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "vocab.txt").write_text("a\nb\nc\n")
    return folder


def test_trainer_folder_round_trip(tmp_path):
    src = make_trainer_folder(tmp_path / "checkpoint-10")
    checkpoint = formats.read_checkpoint(src)
    kinds = {f.name: f.format for f in checkpoint.files}
    assert kinds["model.safetensors"] == "safetensors" and kinds["optimizer.pt"] == "torch"
    assert kinds["rng_state.pth"] == "torch" and kinds["trainer_state.json"] == "blob"
    assert kinds["training_args.bin"] == "blob"  # pickled objects are kept as opaque bytes
    _write_back(checkpoint, tmp_path / "out")
    for name in ("model.safetensors", "trainer_state.json", "config.json", "training_args.bin", "tokenizer/vocab.txt"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    for name in ("optimizer.pt", "scheduler.pt"):
        assert_same(torch.load(src / name, weights_only=True), torch.load(tmp_path / "out" / name, weights_only=True))
    rng_src = torch.load(src / "rng_state.pth", weights_only=False)
    rng_out = torch.load(tmp_path / "out" / "rng_state.pth", weights_only=False)
    assert_same(list(rng_src["numpy"]), list(rng_out["numpy"]))
    assert rng_src["python"] == rng_out["python"]


def test_a_state_torch_save_cannot_write_is_a_clear_error_and_leaves_nothing(tmp_path):
    """Two dtypes viewing one storage: kept shared in memory; to a file, one line instead of torch's RuntimeError."""
    from ckptstore import Repository

    weights = torch.randn(64, 32)
    state = {"f": weights, "i": weights.view(torch.int32)}
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(state)
        back = repo.checkout(cid)
        assert back["i"].untyped_storage().data_ptr() == back["f"].untyped_storage().data_ptr()
        with pytest.raises(CkptError, match="different dtypes share one storage"):
            repo.checkout_to(cid, output=tmp_path / "o.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt"]
