"""The metadata database: commits, parents, refs, tensors and their chains."""

from ckptstore.metadata import schema
from ckptstore.metadata.db import current_revision, make_engine, upgrade, write_transaction

__all__ = ["current_revision", "make_engine", "schema", "upgrade", "write_transaction"]
