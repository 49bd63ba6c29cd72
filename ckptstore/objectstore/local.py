"""Objects as files under `objects/ab/cdef...`, written by temp file, fsync and rename."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptstore.errors import CorruptObjectError, StoreUnavailableError, naming_file
from ckptstore.hashing import ObjectId, is_hex_id, object_id, object_id_of_parts
from ckptstore.objectstore.base import as_bytes
from ckptstore.objectstore.damagelist import NAME as DAMAGE_LIST
from ckptstore.objectstore.damagelist import DamageList

_WRITE_ATTEMPTS = 3  # a temp file a concurrent gc removed is written again this often in all


def open_object(path: Path, oid: ObjectId) -> int:
    """A read-only descriptor of the object file at `path`; CorruptObjectError when missing or not a file.

    Opened without blocking and checked before any read: a folder, pipe or device standing where an
    object should be (damage, or a hand-made link) must not hang the reader or feed it without end.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptObjectError(oid, "missing") from None
    except NotADirectoryError:  # fsck lists it with the rest of the damage, not crash on it
        raise CorruptObjectError(oid, fan_file_damage(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptObjectError(oid, "damaged: a folder, pipe or device stands where its file should be")
    return fd


def fan_file_damage(path: Path) -> str:
    """What a file standing at an object's fan-out folder is: the objects that folder held are lost."""
    return (f"damaged: a file stands where its folder {path.parent} should be (the objects it held are lost; move "
            "the file away)")


class FileRanges:
    """The local store's RangeReader: each object's file opened once; thread-safe, close when done.

    Reopening a pack for each of its payloads (path, open, close) cost as much as reading them.
    """

    def __init__(self, store: LocalObjectStore) -> None:
        self._store = store
        self._fds: dict[ObjectId, int] = {}
        self._lock = threading.Lock()

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        """Bytes [offset, offset + length) of `oid`, unverified; a short read is a CorruptObjectError.

        With `into` (a buffer of at least `length` bytes), they are read into it and a view is returned.
        """
        fd = self._fds.get(oid)
        fd = self._open(oid) if fd is None else fd
        try:
            if into is None:
                data: bytes | memoryview = os.pread(fd, length, offset)
            else:
                view = memoryview(into)[:length]
                data = view[: os.preadv(fd, [view], offset)]
        except OSError as exc:  # a failing disk's EIO, said with the file it failed on (not looked up per read)
            with naming_file(self._store.path_of(oid)):
                raise exc from None
        if len(data) != length:
            raise CorruptObjectError(oid, f"shorter than a chunk record says: it ends at byte {offset + len(data)}, "
                                          f"the record reads to {offset + length} (the object cut short, or the "
                                          "record damaged)")
        return data

    def _open(self, oid: ObjectId) -> int:
        fd = open_object(self._store.path_of(oid), oid)
        with self._lock:
            kept = self._fds.setdefault(oid, fd)
        if kept != fd:  # another thread opened it meanwhile
            os.close(fd)
        return kept

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


class LocalObjectStore:
    """A fan-out folder of immutable objects; `tmp/` holds writes in progress.

    Objects are renamed from the temp folder into place, and a rename cannot cross filesystems:
    where the objects folder is on another one (a bigger disk, or a symlink to it), its own `tmp/`
    (a name no object folder has) holds the writes instead. Objects a read found corrupted are
    listed in its `damaged` file (damagelist.py) until written anew; `read_only` lists none.
    """

    def __init__(self, objects_dir: str | os.PathLike, tmp_dir: str | os.PathLike, read_only: bool = False) -> None:
        self.root = Path(objects_dir)
        self.tmp = Path(tmp_dir)
        self.url = self.root.resolve().as_uri()
        self.root.mkdir(parents=True, exist_ok=True)
        _make_folder(self.tmp)
        if self.tmp.stat().st_dev != self.root.stat().st_dev:
            self.tmp = self.root / "tmp"  # made by the first write: a read-only mount is still readable
        self.damage = DamageList(self.root / DAMAGE_LIST, lambda: self.tmp, notes=not read_only)
        self._batched: list[Path] | None = None

    def path_of(self, oid: ObjectId) -> Path:
        """Where `oid` lives on disk."""
        return self.root / oid[:2] / oid[2:]

    def put(self, data: bytes | memoryview) -> ObjectId:
        """Store `data`; an existing file of that name is kept only when it holds exactly these bytes.

        A crash can leave a file cut short (or a disk a damaged one) under the right name: trusting
        the name would record a commit that cannot be read. The size is compared always (one stat);
        equal sizes are compared byte for byte, which costs a read only when the object exists.
        """
        return self._put([data], object_id(data))

    def holds(self, oid: ObjectId, data: Callable[[], bytes | memoryview]) -> bool:
        """Whether the file of `oid` hashes to it (its own copy is read; `data` is not needed)."""
        try:
            self.get(oid)
        except CorruptObjectError:
            return False
        return True

    def put_parts(self, parts: Sequence[bytes | memoryview]) -> ObjectId:
        """`put` of the concatenation of `parts`, hashed and written part by part (no joined copy)."""
        return self._put(parts, object_id_of_parts(parts))

    def _put(self, parts: Sequence[bytes | memoryview], oid: ObjectId) -> ObjectId:
        final = self.path_of(oid)
        if self._holds(final, parts, oid):
            self.damage.discard([oid])  # its exact bytes, compared: whole again (another writer's rewrite)
            return oid
        if final.is_dir() and not final.is_symlink():
            _remove_empty_folder(final)
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                self._write_through_tmp(parts, oid, final)
                break
            except FileNotFoundError:
                # `ckpt gc` empties tmp/ under the repository's lock, which a lazy clone's fetch into this
                # store (a checkout's) does not take: the temp file went under it, so it is written again
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
        if self._batched is not None:
            self._batched.append(final)
        else:
            _fsync_dir(final.parent)
            self.damage.discard([oid])  # written anew from bytes that hash to its id, and durable
        return oid

    def _write_through_tmp(self, parts: Sequence[bytes | memoryview], oid: ObjectId, final: Path) -> None:
        """Write the parts to a temp file, flush it (unless batched) and rename it to `final`."""
        try:
            final.parent.mkdir(exist_ok=True)
        except FileExistsError:  # a file in the fan-out folder's place: said as such, not a traceback
            raise StoreUnavailableError(f"{final.parent} is not a folder (a file stands where the store keeps the "
                                        f"objects whose ids begin with {final.parent.name}): move it away and run "
                                        "the command again") from None
        _make_folder(self.tmp)
        temp = self.tmp / f"{oid}.{uuid.uuid4().hex}"
        try:
            with naming_file(temp), open(temp, "wb", buffering=0) as handle:  # unbuffered: parts go straight to it
                for part in parts:
                    _write_all(handle, part)
                if self._batched is None:
                    os.fsync(handle.fileno())
            os.replace(temp, final)
        finally:
            if temp.exists():
                temp.unlink()

    @staticmethod
    def _holds(path: Path, parts: Sequence[bytes | memoryview], oid: ObjectId) -> bool:
        """True when the file at `path` exists and holds exactly the parts' bytes (else put writes it over)."""
        try:
            with open(open_object(path, oid), "rb") as handle:
                if os.fstat(handle.fileno()).st_size != sum(len(as_bytes(p)) for p in parts):
                    return False
                whole = as_bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
                return handle.read() == whole
        except CorruptObjectError:  # missing, or no file (a folder, pipe or device): written anew
            return False

    def get(self, oid: ObjectId, verify: bool = True) -> bytes:
        path = self.path_of(oid)
        with naming_file(path), open(open_object(path, oid), "rb") as handle:
            data = handle.read()
        if verify and object_id(data) != oid:
            self.damage.add(oid)
            raise CorruptObjectError(oid, f"corrupted (its {len(data)} bytes do not match its hash)")
        return data

    def view(self, oid: ObjectId, verify: bool = True) -> bytes | memoryview:
        """The bytes of `oid` as a read-only memory map, for readers that only scan them once.

        Reading a large object into a new bytes object costs a copy and a page fault per 4 KiB;
        the map costs neither. Objects are never rewritten in place (only replaced or unlinked,
        which leaves a live map intact), so the mapped bytes cannot change under the reader.
        """
        fd = open_object(self.path_of(oid), oid)  # a file object would cost as much again
        try:
            size = os.fstat(fd).st_size
            data: bytes | memoryview = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ)) if size else b""
        finally:
            os.close(fd)
        if verify and object_id(data) != oid:
            self.damage.add(oid)
            raise CorruptObjectError(oid, f"corrupted (its {len(data)} bytes do not match its hash)")
        return data

    def open_ranges(self) -> FileRanges:
        """Unverified reads of object ranges with each file kept open until closed (see base.RangeReader)."""
        return FileRanges(self)

    def has(self, oid: ObjectId) -> bool:
        return self.path_of(oid).is_file()  # a folder or device there is damage: the object is written anew

    def lacking(self, oids: Iterable[ObjectId]) -> set[ObjectId]:
        """The `oids` not here, or listed as damaged: a commit stores their tensors again rather than reuse them."""
        oids = set(oids)
        return {oid for oid in oids if not self.has(oid)} | (oids & self.damage.ids())

    def delete(self, oid: ObjectId) -> None:
        path = self.path_of(oid)
        self.damage.discard([oid])
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):  # not there (its fan-out folder a file: damage fsck lists)
            pass
        except IsADirectoryError:  # damage under an object's name (see has): gc clears it, not stop at it
            shutil.rmtree(path)

    def iter_ids(self) -> Iterator[ObjectId]:
        for fan in self.root.iterdir():
            if fan.is_dir() and len(fan.name) == 2:
                for item in fan.iterdir():
                    name = fan.name + item.name
                    if is_hex_id(name):
                        yield ObjectId(name)

    def iter_sizes(self) -> Iterator[tuple[ObjectId, int]]:
        for oid in self.iter_ids():
            try:
                yield oid, self.path_of(oid).stat().st_size
            except (FileNotFoundError, NotADirectoryError):  # deleted since it was listed (or its folder replaced)
                continue

    def size(self, oid: ObjectId) -> int:
        try:
            return self.path_of(oid).stat().st_size
        except FileNotFoundError:
            raise CorruptObjectError(oid, "missing") from None
        except NotADirectoryError:
            raise CorruptObjectError(oid, fan_file_damage(self.path_of(oid))) from None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Defer durability of puts inside the block to one flush at its end (like git's batch fsync).

        Nothing inside the block may be referenced by metadata until the block has exited.
        """
        self._batched = []
        try:
            yield
        finally:
            written, self._batched = self._batched, None
            if written and not _syncfs(self.root):  # syncfs covers file data and the renames
                for path in written:
                    _fsync_path(path)
                for folder in {path.parent for path in written}:
                    _fsync_dir(folder)
            if written:  # durable now: objects written anew leave the damage list
                self.damage.discard(ObjectId(path.parent.name + path.name) for path in written)

    def clear_tmp(self) -> int:
        """Remove leftovers of interrupted writes; returns how many were removed."""
        removed = 0
        if not self.tmp.is_dir():
            return removed
        for item in self.tmp.iterdir():
            if item.is_dir() and not item.is_symlink():  # nothing of ours, but left there it stopped every gc
                import shutil  # only here: it imports the compression modules

                shutil.rmtree(item)
            else:
                item.unlink()
            removed += 1
        return removed


def _write_all(handle: Any, data: bytes | memoryview) -> None:
    """Write all of `data` to the unbuffered file `handle` (a raw write may take less than asked)."""
    view = as_bytes(data)
    view = view if isinstance(view, memoryview) else memoryview(view)
    while view:
        view = view[handle.write(view):]


def _syncfs(folder: Path) -> bool:
    """Flush the whole filesystem holding `folder` in one call (Linux); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(folder, os.O_RDONLY)
    try:
        return syncfs(fd) == 0
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` survive a power cut."""
    _fsync_path(folder)


def _remove_empty_folder(final: Path) -> None:
    """An empty folder standing where an object's file goes (damage) removed; a full one stops the write, named.

    What a full one holds is nobody's object, and may be someone's files: it is moved away by hand, not deleted.
    """
    try:
        final.rmdir()
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise StoreUnavailableError(f"{final} is a folder holding files, where the store keeps the file of object "
                                    f"{final.parent.name}{final.name}: move it away and run the command again"
                                    ) from None


def _make_folder(folder: Path) -> None:
    """`folder` made where missing; a file standing where it should be is damage said as such, not a traceback."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StoreUnavailableError(f"{folder} is not a folder (a file stands where the store keeps its writes in "
                                    "progress): move it away and run the command again") from None
