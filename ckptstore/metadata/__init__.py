"""The metadata database: commits, parents, refs, tensors and their chains; every SQL statement."""

from ckptstore.metadata.db import Database, Tx

__all__ = ["Database", "Tx"]
