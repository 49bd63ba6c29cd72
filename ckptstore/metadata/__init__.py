"""The metadata database: commits, parents, refs, tensors and their chains; every SQL statement."""

from ckptstore.metadata.db import Database, Tx, shown_url
from ckptstore.metadata.sqlite import absolute_url, kept_url

__all__ = ["Database", "Tx", "absolute_url", "kept_url", "shown_url"]
