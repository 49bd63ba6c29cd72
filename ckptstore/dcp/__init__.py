"""ckptstore as a torch.distributed.checkpoint (DCP) storage backend: one commit per `dcp.save`.

    dcp.save(state_dict, storage_writer=CkptStorageWriter("/path/to/repo", message="step 100", step=100))
    dcp.load(state_dict, storage_reader=CkptStorageReader("/path/to/repo", "main"))

Every rank encodes and writes its own shards; the coordinator records the commit once all are
durable. Loading at another world size is DCP's resharding over the metadata stored here. A lossy
commit (`CkptStorageWriter(..., lossy="balanced")`) also takes `planner=CkptSavePlanner()`, which
gathers the whole tensors' statistics that every rank plans its shards with.
"""

from ckptstore.dcp.planner import CkptSavePlanner
from ckptstore.dcp.reader import CkptStorageReader
from ckptstore.dcp.writer import CkptStorageWriter

__all__ = ["CkptSavePlanner", "CkptStorageReader", "CkptStorageWriter"]
