"""Refs: names, HEAD and its branch."""

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import RefExistsError

pytestmark = pytest.mark.both_backends


def test_a_tag_cannot_take_the_name_of_heads_unborn_branch(tmp_path, metadata_url):
    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        cid = repo.commit({"w": torch.ones(2)}, branch="other")
        assert repo.head() == ("main", None)
        with pytest.raises(RefExistsError, match="no commits yet"):
            repo.tag("main", cid)
        assert repo.head() == ("main", None)
        assert repo.commit({"w": torch.zeros(2)}) != cid
        assert repo.head()[0] == "main" and repo.branches()["main"] != cid
