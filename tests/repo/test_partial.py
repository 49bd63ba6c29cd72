"""Replaying byte ranges of stored tensors: only the chunks covering them, exact, down shared chains."""

import numpy as np
import torch

from ckptstore import Repository
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.policy import EncodingSettings
from ckptstore.repo.checkout import restore
from ckptstore.repo.partial import restore_ranges


def test_ranges_replay_only_their_chunks_and_match_the_whole_replay(tmp_path):
    repo = Repository.init(tmp_path, encoding=EncodingSettings(chunk_bytes=1024))
    base = torch.randn(64, 64)
    repo.commit({"a": base.clone(), "b": base.clone()}, "one content at two paths: one record")
    moved = {"a": base + 1e-6, "b": base - 1e-6}  # both residuals against that one record
    cid = repo.commit(moved, "two residuals sharing a base")
    manifest = repo.manifest(cid)
    whole = restore(repo, manifest)
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()}, with_bases=False)
    assert len({r.base_id for r in records.values()}) == 1 and None not in {r.base_id for r in records.values()}
    ranges = {"a": (100, 3000), "b": (4096, 6000)}  # chunks 0-2 and 4-5 of 16: through the base, 0-5 for both
    parts = restore_ranges(repo, manifest, ranges)
    for path, (start, end) in ranges.items():
        first, data = parts[path]
        assert first <= start and first + data.size >= end
        assert np.array_equal(data, whole[path].data[first:first + data.size])
    assert [d.size for _, d in parts.values()] == [6 * 1024, 6 * 1024]  # the union of both runs, not 16 chunks
    repo.close()
