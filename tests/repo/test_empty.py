"""Issue 21, item 11: empty tensors and empty files round-trip through the repository and the CLI.

An empty tensor once crashed a commit with ZeroDivisionError in codecs/bytegroup.py; these tests
commit empty tensors of several dtypes and shapes (losslessly and at every lossy level) and a
Trainer folder holding an empty file, and check them out bit-exact.
"""

import os
from pathlib import Path

import pytest
import torch

from ckptstore.repo.config import LOSSY_LEVELS
from tests.conftest import assert_same, ckpt_here

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.bool)


def _empties(i: int) -> dict:
    """Empty tensors of every dtype and a few shapes, beside a tensor that changes so commits chain."""
    empties = {f"{str(d)[6:]}-{n}": torch.zeros(shape, dtype=d)
               for d in DTYPES for n, shape in enumerate(((0,), (3, 0), (0, 2, 5)))}
    weight = torch.linspace(-1, 1, 4096) * (1 + i / 10)
    return {"model": {"weight": weight, **empties},
            "optimizer": {"state": {0: {"exp_avg": torch.zeros(0), "exp_avg_sq": torch.zeros(0),
                                        "step": torch.tensor(float(i))}},
                          "param_groups": [{"params": [0], "lr": 0.1}]}}


@pytest.mark.parametrize("lossy", [None, *LOSSY_LEVELS])
def test_empty_tensors_of_every_dtype_check_out_bit_exact(repo, lossy):
    states = [_empties(i) for i in range(2)]
    cids = [repo.commit(state, lossy=lossy) for state in states]
    for cid, state in zip(cids, states):
        out = repo.checkout(cid)
        if lossy is None:
            assert_same(state, out)
        for name, tensor in state["model"].items():
            if tensor.numel() == 0:  # empty tensors are exact at every level
                assert_same(tensor, out["model"][name], name)
        assert_same(state["optimizer"]["state"][0]["exp_avg"], out["optimizer"]["state"][0]["exp_avg"])


def test_cli_commits_a_folder_with_an_empty_file_and_empty_tensors(tmp_path):
    folder = tmp_path / "run" / "checkpoint-2"
    folder.mkdir(parents=True)
    torch.save(_empties(0), folder / "pytorch_model.bin")
    (folder / "empty.txt").write_bytes(b"")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    (tmp_path / "only-empty").mkdir()
    (tmp_path / "only-empty" / "x").write_bytes(b"")
    assert ckpt_here(tmp_path, "init").returncode == 0
    for lossy in (*LOSSY_LEVELS, "none"):  # the lossless one last: HEAD~1 below
        done = ckpt_here(tmp_path, "commit", "run/checkpoint-2", "--allow-empty", "--lossy", lossy, "-m", lossy)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    done = ckpt_here(tmp_path, "commit", "only-empty", "-m", "empty")
    assert done.returncode == 0, done.stderr
    for back, name in enumerate(["only-empty", "checkpoint-2"]):
        out = tmp_path / f"out{back}"
        assert ckpt_here(tmp_path, "checkout", f"HEAD~{back}", "-o", str(out)).returncode == 0
        source = tmp_path / "only-empty" if back == 0 else folder
        assert sorted(os.listdir(out)) == sorted(os.listdir(source)), name
        for file in os.listdir(source):  # tensors bit-exact; other files byte for byte
            if file.endswith(".bin"):  # a torch.save zip is rewritten (its headers differ), its tensors are not
                assert_same(torch.load(source / file, weights_only=True), torch.load(out / file, weights_only=True))
            else:
                assert (out / file).read_bytes() == (source / file).read_bytes(), file
    check = ckpt_here(tmp_path, "fsck", "--full")
    assert check.returncode == 0 and "ok" in check.stdout, check.stdout + check.stderr
