"""The random id a repository's database holds (migration 0011), which its S3 prefix's owner.json names back."""

from __future__ import annotations

from ckptstore.errors import CkptError
from ckptstore.metadata.db import Tx


def repository_id(tx: Tx) -> str:
    """This database's repository id."""
    found = tx.scalar("SELECT id FROM repository_identity")
    if not isinstance(found, str):
        raise CkptError(f"the metadata holds no repository identity ({found!r}): it is damaged; restore it from a "
                        "backup (nothing was changed)")
    return found
