"""Content-addressed object stores, opened by URL."""

from __future__ import annotations

from pathlib import Path

from ckptstore.errors import CkptError
from ckptstore.objectstore.base import MappedObjects, ObjectStore, RangeReader, read_whole
from ckptstore.objectstore.local import LocalObjectStore
from ckptstore.objectstore.memory import MemoryObjectStore

__all__ = ["LocalObjectStore", "MappedObjects", "MemoryObjectStore", "ObjectStore", "RangeReader", "open_store",
           "read_whole"]


def open_store(url: str, scratch: Path) -> ObjectStore:
    """The store a URL names: a local folder (a path or file:// URL) or memory://.

    `scratch` is a local folder for writes in progress (the local store's temp files).
    """
    if url.startswith("memory://"):
        return MemoryObjectStore(url)
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return LocalObjectStore(Path(unquote(urlparse(url).path)), scratch)
    if "://" in url:
        raise CkptError(f"object store URL {url!r} is not supported; use a local path or file:// URL")
    return LocalObjectStore(Path(url), scratch)
