"""The repository a DCP storage plugin was given: a `Repository`, or a path to one."""

from __future__ import annotations

from typing import Any

from ckptstore.repo.location import given_root
from ckptstore.repo.repository import Repository


def open_repo(where: Any, read_only: bool) -> Repository:
    """`where` itself when it is a Repository, else the repository whose folder it names (None: found from here)."""
    if isinstance(where, Repository):
        return where
    return Repository.open(given_root(where), read_only=read_only or None)


class RepoHandle:
    """The repository a plugin works on: opened on first use, closed by `close` only when the plugin opened it."""

    def __init__(self, where: Any, read_only: bool) -> None:
        self.where = where
        self.read_only = read_only
        self._repo: Repository | None = None

    @property
    def repo(self) -> Repository:
        if self._repo is None:
            self._repo = open_repo(self.where, self.read_only)
        return self._repo

    def switch(self, where: Any) -> None:
        """Work on `where` from now on (DCP's checkpoint_id); None keeps the current one."""
        if where is not None and where != self.where:
            self.close()
            self.where = where

    def close(self) -> None:
        if self._repo is not None and self._repo is not self.where:
            self._repo.close()
        self._repo = None
