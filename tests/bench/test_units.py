"""bench/units.py: a restored unit counts as the original only when its state is the same, bit for bit."""

import torch

from bench.units import same_bytes, same_unit


def test_same_bytes_pass_without_loading_and_other_bytes_are_compared_by_state(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    original, copy, legacy, changed = (tmp_path / f"{name}.pt" for name in ("original", "copy", "legacy", "changed"))
    torch.save(state, original)
    copy.write_bytes(original.read_bytes())
    torch.save(state, legacy, _use_new_zipfile_serialization=False)  # other bytes, the same state
    data = bytearray(original.read_bytes())
    values = state["w"].numpy().tobytes()
    data[data.index(values) + len(values) - 4] ^= 1  # one bit of the last value: same size, another state
    changed.write_bytes(bytes(data))
    assert same_bytes(original, copy) and same_unit(original, copy)
    assert not same_bytes(original, legacy) and same_unit(original, legacy)
    assert not same_bytes(original, changed) and not same_unit(original, changed)


def test_the_database_is_counted_wherever_it_lives_and_nothing_is_made_for_it(tmp_path):
    """A repository whose database is elsewhere counted 0 bytes, and an empty .ckpt/ckpt.db was left (reader 25)."""
    from bench.units import metadata_on_disk
    from ckptstore import Repository

    with Repository.init(tmp_path / "here") as here, \
            Repository.init(tmp_path / "there", metadata_url=f"sqlite:///{tmp_path / 'meta.db'}") as there:
        for repo in (here, there):
            repo.commit({"w": torch.ones(8)}, "one")
        assert metadata_on_disk(here) > 0 and metadata_on_disk(there) > 0
        assert not (there.dir / "ckpt.db").exists()
        # its write-ahead log folded in as a local one's, not counted raw (reader 26: 11x too much)
        assert not (tmp_path / "meta.db-wal").exists() or (tmp_path / "meta.db-wal").stat().st_size == 0
