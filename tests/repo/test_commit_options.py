"""What a commit records: its step is a whole number the metadata keeps as given (repo/commit.py)."""

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
