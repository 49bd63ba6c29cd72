"""Content-addressed object stores, opened by URL."""

from __future__ import annotations

import os
from pathlib import Path

from ckptstore.errors import CkptError
from ckptstore.objectstore.base import MappedObjects, ObjectStore, RangeReader, read_whole
from ckptstore.objectstore.local import LocalObjectStore
from ckptstore.objectstore.memory import MemoryObjectStore
from ckptstore.paths import without_credentials

__all__ = ["LocalObjectStore", "MappedObjects", "MemoryObjectStore", "ObjectStore", "RangeReader", "open_store",
           "read_whole"]


def open_store(url: str, scratch: Path, base: Path, create: bool = True, read_only: bool = False) -> ObjectStore:
    """The store a URL names: a local folder (a path, relative to `base`, or an absolute file:// URL) or a bucket.

    `s3://BUCKET/PREFIX` keeps the objects on S3-compatible storage (objectstore/s3.py).

    `scratch` is a local folder for writes in progress (the local store's temp files). An
    in-memory store is made directly (MemoryObjectStore), never from a configured URL: it would
    forget every object when the process exits while the metadata remembers them. A local folder
    that is missing is made only with `create` (init); opened, it is said missing, never made anew
    empty (a typo in objects_url, or a disk not mounted). `read_only`: a local store lists no damage it reads.
    """
    path = local_folder(url, base)
    if path is None:
        from ckptstore.objectstore.s3 import S3ObjectStore  # the S3 client only for repositories on a bucket

        return S3ObjectStore(url)
    return _local(url, path, scratch, base, create, read_only)


def local_folder(url: str, base: Path) -> Path | None:
    """The folder a local store's URL names (a path relative to `base`, or a file:// URL); None for a bucket."""
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        parsed = urlparse(url)
        path = Path(unquote(parsed.path))
        if parsed.netloc not in ("", "localhost") or not path.is_absolute():
            raise CkptError(f"object store URL {url!r} must name an absolute local folder, e.g. file:///data/objects")
        return path
    if url.startswith("s3://"):
        return None
    if "://" in url:
        raise CkptError(f"object store URL {without_credentials(url)!r} is not supported; use a local folder, a "
                        "file:// URL or s3://BUCKET/PREFIX")
    return base / url


def _local(url: str, path: Path, scratch: Path, base: Path, create: bool, read_only: bool) -> ObjectStore:
    real, temporary = Path(os.path.realpath(path)), Path(os.path.realpath(scratch))
    if real.is_relative_to(temporary) or temporary.is_relative_to(real):
        # tmp/ is emptied by gc (its first step deleted every object), and a store holding the repository's
        # own folder (`..`, `/`) would take the work tree's files for its own
        where = "lies in the repository's folder of temporary files" if real.is_relative_to(temporary) else \
            "holds the repository's own folder"
        if not create:  # a repository made so before init refused it: its objects are there, and must move
            raise CkptError(_misplaced_store_line(url, real, base, where, real.is_relative_to(temporary)))
        raise CkptError(f"objects_url {url!r} names {real}, which {where}: give the objects a folder of their own, "
                        "or leave --objects out to keep them in .ckpt/objects")
    if path.exists() and not path.is_dir():
        raise CkptError(f"objects_url {url!r} names {path}, which is a file, not a folder of objects")
    if not create and not path.exists():
        raise CkptError(f"objects_url {url!r} names {path}, which does not exist (a typo, or a disk not mounted?): "
                        "the repository's objects are where it was made")
    return LocalObjectStore(path, scratch, read_only)


def _misplaced_store_line(url: str, real: Path, base: Path, where: str, in_temporary: bool) -> str:
    """How to recover a repository whose config names such a store (made before init refused it), in one line.

    Its objects are real and its commits need them: the line says where they are now and where they can go,
    as the repository cannot be opened (nor gc run) until they have a folder of their own.
    """
    config, default = base / "config.toml", base / "objects"
    move = (f"move the folder {real} out of {base / 'tmp'}, e.g. to {default}" if in_temporary else
            f"move its object folders (the two-hex-digit ones, and 'damaged' if there) into a folder of their own, "
            f"e.g. {default}")
    return (f"objects_url {url!r} in {config} names {real}, which {where}: {move}, then set objects_url in {config} "
            f"to that folder's absolute path or a path below the repository relative to {base} "
            f"(\"objects\" for {default})")
