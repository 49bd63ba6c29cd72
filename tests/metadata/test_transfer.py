"""Records copied between repositories (metadata/transfer.py): depths made the receiver's."""

from ckptstore import Repository
from ckptstore.metadata import transfer


def _received(*rows):
    """A RecordSet of tensor rows (id, base_id, depth) as a sender would send them."""
    found = transfer.RecordSet()
    found.rows["tensors"] = (["id", "base_id", "depth"], list(rows))
    return found


def test_received_depths_count_the_chain_here_and_take_the_senders_word_for_forged_loops(tmp_path):
    """A self-loop took one more than the sender said once the walk was written again (reader 11, of f7be0db)."""
    with Repository.init(tmp_path) as repo, repo.db.read() as tx:
        found = _received(("k", None, 0), ("a", "k", 7), ("b", "a", 1), ("self", "self", 3), ("child", "self", 9),
                          ("x", "y", 2), ("y", "x", 5), ("orphan", "nowhere", 4))
        transfer._depths_here(tx, found)
    depths = {row[0]: row[2] for row in found.rows["tensors"][1]}
    assert depths == {"k": 0, "a": 1, "b": 2, "self": 3, "child": 4, "x": 6, "y": 5, "orphan": 1}


def test_a_forged_loops_depth_that_is_no_small_number_is_taken_as_none(tmp_path):
    """Text, or 10**23, as a forged loop's depth ended a clone in "unexpected ValueError/OverflowError", half made
    (hostile-input auditor)."""
    with Repository.init(tmp_path) as repo, repo.db.read() as tx:
        found = _received(("text", "text", "x"), ("huge", "huge", "99999999999999999999999"), ("minus", "minus", -4))
        transfer._depths_here(tx, found)
    assert {row[0]: row[2] for row in found.rows["tensors"][1]} == {"text": 0, "huge": 1 << 31, "minus": 0}
