"""Open the repository a DCP storage plugin was given: a `Repository`, or a path to one."""

from __future__ import annotations

from typing import Any

from ckptstore.repo.repository import Repository


def open_repo(where: Any, read_only: bool) -> Repository:
    """`where` itself when it is a Repository, else the repository at or above that path."""
    if isinstance(where, Repository):
        return where
    return Repository.open(where, read_only=read_only or None)
