import os

import pytest

from ckptstore.errors import CkptError, CorruptObjectError, StoreUnavailableError
from ckptstore.objectstore import LocalObjectStore, MemoryObjectStore, local
from ckptstore.objectstore.s3 import S3ObjectStore
from ckptstore.testing.store_contract import ALL_CHECKS, DAMAGE_CHECKS


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    if request.param == "s3":
        return S3ObjectStore(request.getfixturevalue("s3_url"))
    return MemoryObjectStore()


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_contract(store, check):
    check(store)


def _overwrite(store):
    """Raw bytes under a name, behind the store's back (a crash or a bad disk)."""
    if isinstance(store, MemoryObjectStore):
        return lambda oid, data: store.objects.__setitem__(oid, data)
    if isinstance(store, S3ObjectStore):
        import obstore

        return lambda oid, data: obstore.put(store._client, store.key(oid), data)
    return lambda oid, data: store.path_of(oid).write_bytes(data)


@pytest.mark.parametrize("check", DAMAGE_CHECKS, ids=lambda c: c.__name__)
def test_damage_contract(store, check):
    check(store, _overwrite(store))


def test_local_store_detects_corruption_and_truncation(tmp_path):
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    oid = store.put(b"x" * 1000)
    path = store.path_of(oid)
    assert path.parent.name == oid[:2] and path.name == oid[2:]
    path.write_bytes(b"x" * 999)
    with pytest.raises(CorruptObjectError, match=oid):
        store.get(oid)
    path.write_bytes(b"y" * 1000)
    with pytest.raises(CorruptObjectError, match="do not match its hash"):
        store.get(oid)


def test_local_store_leaves_no_temp_files(tmp_path):
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    for i in range(10):
        store.put(bytes([i]) * 100)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert len(list(store.iter_ids())) == 10


def test_local_store_view_maps_the_object_and_verifies_it(tmp_path):
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    oid, empty = store.put(b"abc" * 1000), store.put(b"")
    assert bytes(store.view(oid)) == store.get(oid) and bytes(store.view(empty)) == b""
    store.path_of(oid).write_bytes(b"abd" * 1000)
    assert bytes(store.view(oid, verify=False)) == b"abd" * 1000
    with pytest.raises(CorruptObjectError, match="do not match its hash"):
        store.view(oid)
    store.delete(oid)
    with pytest.raises(CorruptObjectError, match="missing"):
        store.view(oid)


def test_local_store_ranges_read_with_files_kept_open(tmp_path):
    import numpy as np

    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    data = bytes(range(256)) * 40
    oid = store.put(data)
    ranges = store.open_ranges()
    assert ranges.read(oid, 10, 100) == data[10:110]
    buffer = np.zeros(500, np.uint8)
    view = ranges.read(oid, 300, 200, into=buffer)
    assert bytes(view) == data[300:500] and buffer[:200].tobytes() == data[300:500]
    store.delete(oid)  # an open file still reads; a new reader finds it missing
    assert ranges.read(oid, 0, 4) == data[:4]
    ranges.close()
    ranges, short = store.open_ranges(), store.put(b"abc")
    with pytest.raises(CorruptObjectError, match="missing"):
        ranges.read(oid, 0, 4)
    with pytest.raises(CorruptObjectError, match="shorter than a chunk record says"):
        ranges.read(short, 1, 10)
    ranges.close()


def test_store_urls_open_local_folders_and_buckets_and_refuse_the_rest(tmp_path):
    from ckptstore.errors import CkptError
    from ckptstore.objectstore import open_store

    base = tmp_path / ".ckpt"
    assert open_store("objects", tmp_path / "tmp", base).root == base / "objects"
    assert open_store((tmp_path / "elsewhere").as_uri(), tmp_path / "tmp", base).root == tmp_path / "elsewhere"
    assert open_store("s3://bucket/x", tmp_path / "tmp", base).url == "s3://bucket/x"  # connects on first use
    for url in ("file://objects", "file://host/data", "gs://bucket/x", "memory://"):
        with pytest.raises(CkptError, match="object store URL"):
            open_store(url, tmp_path / "tmp", base)


def test_a_repository_keeps_objects_where_its_config_says(tmp_path):
    import torch

    from ckptstore import Repository

    with Repository.init(tmp_path / "r", objects_url="shelf") as repo:
        cid = repo.commit({"w": torch.ones(3)})
    with Repository.open(tmp_path / "r" / ".ckpt") as repo:  # opened from another folder
        assert repo.store.root == tmp_path / "r" / ".ckpt" / "shelf"
        assert torch.equal(repo.checkout(cid)["w"], torch.ones(3))


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_put_parts_stores_the_joined_bytes_under_their_id(tmp_path, kind):
    import numpy as np

    from ckptstore.hashing import object_id
    from ckptstore.objectstore.base import put_parts
    from ckptstore.objectstore.pack import PackWriter

    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp") if kind == "local" else MemoryObjectStore()
    plane = np.arange(1000, dtype=np.uint16).view(np.uint8)
    parts = [b"head", memoryview(plane), plane[::2].copy().data, b""]
    joined = b"".join(bytes(p) for p in parts)
    assert put_parts(store, parts) == object_id(joined) and store.get(object_id(joined)) == joined
    if kind == "local":  # a damaged file under the right name is written over; an intact one kept
        store.path_of(object_id(joined)).write_bytes(joined[:-1] + b"x")
        assert put_parts(store, parts) == object_id(joined)
        assert store.path_of(object_id(joined)).read_bytes() == joined
        assert not list((tmp_path / "tmp").iterdir())
    packer = PackWriter(store)
    slots = [packer.add(parts), packer.add(b"tail"), packer.add(memoryview(b"view"))]
    packer.close()
    pack = store.get(slots[0].object_id)
    assert pack == joined + b"tailview" and [(s.offset, s.length) for s in slots] == [
        (0, len(joined)), (len(joined), 4), (len(joined) + 4, 4)]


@pytest.fixture
def other_filesystem(tmp_path):
    """A folder on another filesystem than tmp_path (/dev/shm is a tmpfs here), removed afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    assert folder.stat().st_dev != tmp_path.stat().st_dev, "/dev/shm shares tmp_path's filesystem here"
    yield folder
    shutil.rmtree(folder)


def test_objects_on_another_filesystem_take_commits_and_gc(tmp_path, other_filesystem):
    """Temp files are renamed into place, which cannot cross filesystems: they go to the objects' own tmp/."""
    import torch

    from ckptstore import Repository
    from ckptstore.repo import fsck, gc

    with Repository.init(tmp_path / "r", objects_url=(other_filesystem / "objects").as_uri()) as repo:
        first = repo.commit({"w": torch.arange(1000.0)})
        repo.commit({"w": torch.arange(1000.0) + 1})
        assert torch.equal(repo.checkout(first)["w"], torch.arange(1000.0))
        (repo.store.tmp / "leftover").write_bytes(b"x")
        assert repo.store.tmp == other_filesystem / "objects" / "tmp"
        assert gc(repo).temp_files_removed == 1 and fsck(repo, full=True).ok


def test_gc_clears_whatever_it_finds_in_tmp_first(tmp_path):
    """A folder in tmp/ (nothing of ours) stopped every gc after its database step; leftovers go before it."""
    import torch

    from ckptstore import Repository
    from ckptstore.repo import gc

    with Repository.init(tmp_path / "r") as repo:
        repo.commit({"w": torch.ones(3)})
        (repo.store.tmp / "leftover" / "inner").mkdir(parents=True)
        (repo.store.tmp / "leftover" / "inner" / "f").write_bytes(b"x")
        (repo.store.tmp / "partial").write_bytes(b"y")
        assert gc(repo).temp_files_removed == 2
        assert list(repo.store.tmp.iterdir()) == []


def test_objects_on_another_filesystem_open_without_writing_there(tmp_path, other_filesystem):
    """Their temp folder comes with the first write: an archive disk mounted read-only still reads."""
    import shutil

    import torch

    from ckptstore import Repository

    with Repository.init(tmp_path / "r", objects_url=(other_filesystem / "objects").as_uri()) as repo:
        cid = repo.commit({"w": torch.arange(4.0)})
    shutil.rmtree(other_filesystem / "objects" / "tmp")
    with Repository.open(tmp_path / "r", read_only=True) as repo:
        assert torch.equal(repo.checkout(cid)["w"], torch.arange(4.0))
    assert not (other_filesystem / "objects" / "tmp").exists()


@pytest.mark.parametrize("stands_there", ["folder", "pipe", "device"])
def test_a_folder_pipe_or_device_at_an_objects_path_is_damage_not_a_hang(tmp_path, stands_there):
    import os

    import torch

    from ckptstore import Repository
    from ckptstore.repo import fsck

    with Repository.init(tmp_path) as repo:
        state = {"w": torch.randn(1000)}
        cid = repo.commit(state)
        victim = repo.manifest(cid).entries["w"].tensor
        with repo.db.read() as tx:
            from ckptstore.metadata import tensors as tensor_rows

            oid = next(iter(tensor_rows.load_records(tx, [victim]).values())).chunks[0].object_id
        path, good = repo.store.path_of(oid), repo.store.get(oid)
        path.unlink()
        {"folder": path.mkdir, "pipe": lambda: os.mkfifo(path), "device": lambda: path.symlink_to("/dev/zero")
         }[stands_there]()
        for read in (repo.store.get, repo.store.view, lambda o: repo.store.open_ranges().read(o, 0, 8)):
            with pytest.raises(CorruptObjectError, match="stands where its file should be"):
                read(oid)
        with pytest.raises(CorruptObjectError, match=oid):
            repo.checkout(cid)
        assert oid in fsck(repo).damaged_objects and not repo.store.has(oid)
        assert repo.store.put(good) == oid and repo.store.has(oid)  # written anew over what stood there
        assert fsck(repo).ok and torch.equal(repo.checkout(cid)["w"], state["w"])


def test_an_object_whose_temp_file_a_gc_removed_while_it_was_written_is_written_again(tmp_path, monkeypatch):
    """A lazy clone's checkout fetches objects into its store without the repository's lock, which `ckpt gc` takes
    to empty tmp/: the temp file went under the write, and the checkout failed with FileNotFoundError (mutation
    audit round 9)."""
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    real, cleared = local._write_all, []

    def gc_meanwhile(handle, data):
        real(handle, data)
        if not cleared:
            cleared.append(store.clear_tmp())

    monkeypatch.setattr(local, "_write_all", gc_meanwhile)
    oid = store.put(b"fetched from the origin")
    assert cleared == [1] and store.get(oid) == b"fetched from the origin"
    assert list(store.tmp.iterdir()) == []


def test_gc_clears_a_folder_standing_at_an_unneeded_objects_path(tmp_path):
    """Damage of the same kind where no commit needs the object: gc removed nothing and failed, every time."""
    import torch

    from ckptstore import Repository
    from ckptstore.repo import fsck, gc

    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.arange(5.0)})
        folder = repo.store.path_of("ab" + "c" * 62)
        (folder / "inner").mkdir(parents=True)
        assert gc(repo).objects_removed == 1 and not folder.exists()
        assert fsck(repo).ok and torch.equal(repo.checkout(cid)["w"], torch.arange(5.0))


@pytest.mark.parametrize("read", ["get", "view", "size", "ranges"])
def test_a_lazy_clone_too_full_to_keep_an_object_still_reads_it_from_its_origin(tmp_path, monkeypatch, read):
    """A full disk must not stop reading commands (checkout -o elsewhere, fsck): the bytes are used, not kept."""
    import errno

    from ckptstore.objectstore.fallback import FallbackStore

    origin = LocalObjectStore(tmp_path / "origin", tmp_path / "origin-tmp")
    data = bytes(range(256)) * 64
    oid = origin.put(data)
    local = LocalObjectStore(tmp_path / "here", tmp_path / "here-tmp")

    def full(_data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "put", full)
    store = FallbackStore(local, lambda: origin)
    if read == "ranges":
        ranges = store.open_ranges()
        assert bytes(ranges.read(oid, 100, 50)) == data[100:150]
        ranges.close()
    else:
        expected = {"get": data, "view": data, "size": len(data)}[read]
        got = getattr(store, read)(oid)
        assert (bytes(got) if read != "size" else got) == expected
    assert not local.has(oid)  # not kept: there was no room
    assert not store.keep  # nor tried again: a pack's next range comes from the source's ranges, not whole again

    def broken(_data):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(local, "put", broken)
    store = FallbackStore(local, lambda: origin)
    with pytest.raises(OSError, match="I/O error"):  # any other failure to keep it is still an error
        store.get(oid)


def test_threads_that_miss_one_object_of_a_lazy_clone_at_once_download_it_once(tmp_path):
    """Each thread that missed a pack downloaded it: 2x the bytes with two threads, 4x with eight (auditor)."""
    import threading
    import time

    from ckptstore.objectstore.fallback import FallbackStore

    origin = LocalObjectStore(tmp_path / "origin", tmp_path / "origin-tmp")
    data = bytes(range(256)) * 4096
    oid = origin.put(data)
    downloads = []
    real_get = origin.get

    def slow_get(wanted, verify=True):
        downloads.append(wanted)
        time.sleep(0.3)  # long enough for every thread to miss it meanwhile
        return real_get(wanted, verify)

    origin.get = slow_get
    store = FallbackStore(LocalObjectStore(tmp_path / "here", tmp_path / "here-tmp"), lambda: origin)
    ranges = [store.open_ranges() for _ in range(6)]
    got = [None] * 6
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, bytes(ranges[i].read(oid, i * 10, 10))))
               for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert got == [data[i * 10:i * 10 + 10] for i in range(6)]
    assert downloads == [oid] and store.local.has(oid)
    assert store._copying == {}  # nothing kept of the copies once done


def test_threads_of_a_lazy_clone_that_keeps_nothing_read_the_origin_side_by_side(tmp_path):
    """Where nothing is kept (read-only, or a full disk), waiting for another thread's copy gains nothing:
    the per-object lock made them download one after another (reader)."""
    import threading

    from ckptstore.objectstore.fallback import FallbackStore

    origin = LocalObjectStore(tmp_path / "origin", tmp_path / "origin-tmp")
    oid = origin.put(b"x" * 4096)
    together = threading.Barrier(3, timeout=30)  # each download waits until three are under way
    real_get = origin.get

    def meeting_get(wanted, verify=True):
        together.wait()
        return real_get(wanted, verify)

    origin.get = meeting_get
    store = FallbackStore(LocalObjectStore(tmp_path / "here", tmp_path / "here-tmp"), lambda: origin, keep=False)
    got = []
    threads = [threading.Thread(target=lambda: got.append(store.get(oid))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert got == [b"x" * 4096] * 3 and not together.broken and not store.local.has(oid)


@pytest.mark.parametrize("keep", [True, False])
def test_a_lazy_clone_whose_origin_is_unavailable_tries_it_once_not_once_per_object(tmp_path, keep):
    """Each thread waiting for a pack, and each later object, tried the origin again after the last had spent the
    whole retry budget: a checkout of 40 small tensors took 51 s at CKPT_S3_RETRY_SECONDS=1, hours at 60 (auditor)."""
    import threading
    import time

    from ckptstore.objectstore.fallback import FallbackStore

    origin = LocalObjectStore(tmp_path / "origin", tmp_path / "origin-tmp")
    oids = [origin.put(bytes([i]) * 4096) for i in range(3)]
    tries = []

    def down(wanted, *_args, **_kwargs):
        tries.append(wanted)
        time.sleep(0.3)  # the retry budget being spent: long enough for every thread to miss the object meanwhile
        raise StoreUnavailableError("S3 store s3://b/p: cannot reach it")

    origin.get = down
    origin.open_ranges = lambda: type("Ranges", (), {"read": staticmethod(down), "close": lambda self: None})()
    store = FallbackStore(LocalObjectStore(tmp_path / "here", tmp_path / "here-tmp"), lambda: origin, keep=keep)
    failures = []

    def read(i):
        ranges = store.open_ranges()
        try:
            ranges.read(oids[0], i * 10, 10)
        except StoreUnavailableError as exc:
            failures.append(str(exc))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for oid in oids[1:]:  # later objects of the same command
        with pytest.raises(StoreUnavailableError, match=f"object {oid[:12]} is not held here.*cannot reach it"):
            store.get(oid)
    assert len(failures) == 6 and all("cannot reach it" in failure for failure in failures)
    assert len(tries) <= (1 if keep else 6)  # not kept: threads already reading side by side each tried once
    assert tries[0] == oids[0] and oids[1] not in tries and oids[2] not in tries


def _durability_events(monkeypatch, syncfs_works: bool = True) -> list[tuple[str, ...]]:
    """What reaches the disk, in order: each fsync (of the file or folder it names), rename and syncfs."""
    events = []
    fsync, replace = os.fsync, os.replace

    def fsynced(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def replaced(source, target):
        events.append(("replace", os.path.realpath(source), os.path.realpath(target)))
        return replace(source, target)

    def syncfs(folder):
        events.append(("syncfs", os.path.realpath(folder)))
        return syncfs_works

    monkeypatch.setattr(os, "fsync", fsynced)
    monkeypatch.setattr(os, "replace", replaced)
    monkeypatch.setattr(local, "_syncfs", syncfs)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced file by /proc/self/fd")
def test_a_local_object_is_fsynced_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    """Without the file's fsync before the rename, or the folder's after it, a power cut could leave a committed
    object empty or gone (mutation audit)."""
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    events = _durability_events(monkeypatch)
    oid = store.put(b"checkpoint bytes" * 100)
    final = os.path.realpath(store.path_of(oid))
    (_, temp, _), = (event for event in events if event[0] == "replace")
    assert os.path.dirname(temp) == os.path.realpath(tmp_path / "tmp")
    assert events == [("fsync", temp), ("replace", temp, final), ("fsync", os.path.dirname(final))]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced file by /proc/self/fd")
@pytest.mark.parametrize("syncfs_works", [True, False])
def test_a_batch_of_local_objects_is_flushed_once_at_its_end(tmp_path, monkeypatch, syncfs_works):
    """A batch's flush skipped: its objects were referenced by metadata with nothing of them on the disk
    (mutation audit)."""
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    events = _durability_events(monkeypatch, syncfs_works)
    with store.batch():
        oid = store.put(b"another object" * 50)
        assert [event[0] for event in events] == ["replace"]  # nothing flushed inside the block
    final = os.path.realpath(store.path_of(oid))
    flushed = [("syncfs", os.path.realpath(tmp_path / "objects"))]
    if not syncfs_works:  # each file and folder instead
        flushed += [("fsync", final), ("fsync", os.path.dirname(final))]
    assert events[1:] == flushed



def test_a_file_where_the_stores_temporary_folder_should_be_is_named_as_such(tmp_path):
    """`.ckpt/tmp` replaced by a file: every commit said "unexpected FileExistsError ... please report it" (auditor)."""
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    (tmp_path / "tmp").rmdir()
    (tmp_path / "tmp").write_text("not a folder\n")
    with pytest.raises(StoreUnavailableError, match=r"/tmp is not a folder \(a file stands where"):
        store.put(b"bytes")  # as a running process's next write finds it
    with pytest.raises(StoreUnavailableError, match=r"/tmp is not a folder"):
        LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")  # as the next command's open does


def test_a_file_where_an_objects_fan_out_folder_should_be_is_damage_named_as_such(tmp_path):
    """`objects/ab` replaced by a file: fsck, checkout, commit and gc all said "unexpected NotADirectoryError ...
    please report it", fsck too, which is there to list damage (auditor helper 281)."""
    import shutil

    import torch

    from ckptstore import Repository
    from ckptstore.repo import fsck, gc

    with Repository.init(tmp_path) as repo:
        state = {"w": torch.arange(1000.0)}
        cid = repo.commit(state)
        with repo.db.read() as tx:
            from ckptstore.metadata import tensors as tensor_rows

            record = next(iter(tensor_rows.load_records(tx, [repo.manifest(cid).entries["w"].tensor]).values()))
        oid = record.chunks[0].object_id
        fan = repo.store.path_of(oid).parent
        held = {fan.name + item.name: item.read_bytes() for item in fan.iterdir()}
        shutil.rmtree(fan)
        fan.write_text("not a folder\n")
        store = repo.store
        for read in (store.get, store.view, store.size, lambda o: store.open_ranges().read(o, 0, 8)):
            with pytest.raises(CorruptObjectError, match=f"a file stands where its folder {fan} should be"):
                read(oid)
        with pytest.raises(CorruptObjectError, match=oid):
            repo.checkout(cid)
        assert "a file stands where its folder" in fsck(repo).damaged_objects[oid] and not repo.store.has(oid)
        assert oid not in set(repo.store.iter_ids())
        repo.store.delete(oid)  # nothing to delete there: not a crash either
        with pytest.raises(StoreUnavailableError, match=rf"{fan} is not a folder \(a file stands where .*move it away"):
            repo.store.put(held[oid])
        with pytest.raises(CkptError, match=f"gc refused to delete anything.*object {oid}: needed"):
            gc(repo)
        assert fan.read_text() == "not a folder\n"  # the file is left to its owner
        fan.unlink()  # moved away, as the error says: the lost objects are written again
        assert all(repo.store.put(data) == held_oid for held_oid, data in held.items())
        assert fsck(repo).ok and torch.equal(repo.checkout(cid)["w"], state["w"])


def test_a_folder_holding_files_where_an_object_is_written_stops_the_write_named(tmp_path):
    """A non-empty folder at an object's path made every commit of that object (the same checkpoint again) fail
    with "unexpected OSError: [Errno 39] Directory not empty ... please report it" (auditor helper 281)."""
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    oid = store.put(b"the manifest")
    path = store.path_of(oid)
    path.unlink()
    path.mkdir()
    (path / "someones").write_text("kept\n")
    with pytest.raises(StoreUnavailableError, match=rf"{path} is a folder holding files, .* move it away"):
        store.put(b"the manifest")
    assert (path / "someones").read_text() == "kept\n" and list(store.tmp.iterdir()) == []  # nothing deleted
    path.rename(tmp_path / "moved")
    assert store.put(b"the manifest") == oid and store.get(oid) == b"the manifest"


def test_an_origin_found_unavailable_is_asked_again_once_a_while_has_passed(tmp_path, monkeypatch):
    """Remembered for the store's life, one outage failed every later save of a training run that keeps its
    repository open (ckptstore.save) until it restarted; now for UNAVAILABLE_FOR seconds."""
    from ckptstore.objectstore import fallback

    origin = LocalObjectStore(tmp_path / "origin", tmp_path / "origin-tmp")
    oid = origin.put(b"y" * 4096)
    real_get, down = origin.get, [True]

    def get(wanted, *args, **kwargs):
        if down[0]:
            raise StoreUnavailableError("S3 store s3://b/p: cannot reach it")
        return real_get(wanted, *args, **kwargs)

    origin.get = get
    store = fallback.FallbackStore(LocalObjectStore(tmp_path / "here", tmp_path / "here-tmp"), lambda: origin)
    with pytest.raises(StoreUnavailableError, match="cannot reach it"):
        store.get(oid)
    down[0] = False
    with pytest.raises(StoreUnavailableError, match="cannot reach it"):  # within the while: not asked again
        store.get(oid)
    monkeypatch.setattr(fallback, "UNAVAILABLE_FOR", 0.0)
    assert store.get(oid) == b"y" * 4096


@pytest.mark.parametrize("objects", ["..", "."])
def test_a_repository_made_with_its_own_folder_as_the_store_is_told_how_to_move_it(tmp_path, objects):
    """A repository made with objects_url `..` or `.` (before init refused them) could not be opened, and the line
    said only to give the objects a folder of their own, as to an init: not where they are, nor where its config
    is (fixer helper 329). Following the line, the repository opens and its commit restores bit-exact."""
    import shutil

    import torch

    from ckptstore import Repository
    from tests.conftest import assert_same, ckpt_here

    state = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(7))}
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(state)
    dot_ckpt, config = tmp_path / ".ckpt", tmp_path / ".ckpt" / "config.toml"
    where = (dot_ckpt / objects).resolve()
    fans = [folder.name for folder in (dot_ckpt / "objects").iterdir()]
    for name in fans:  # the objects as such an init left them: in the folder objects_url names
        shutil.move(dot_ckpt / "objects" / name, where / name)
    (dot_ckpt / "objects").rmdir()
    config.write_text(config.read_text().replace('objects_url = ""', f'objects_url = "{objects}"'))
    said = ckpt_here(tmp_path, "log")
    assert said.returncode == 1 and said.stderr.count("\n") == 1, said.stderr
    assert f"in {config} names {where}, which holds the repository's own folder: move its object folders" \
           in said.stderr and f"set objects_url in {config} to" in said.stderr, said.stderr
    (dot_ckpt / "objects").mkdir()  # as the line says
    for name in fans:
        shutil.move(where / name, dot_ckpt / "objects" / name)
    config.write_text(config.read_text().replace(f'objects_url = "{objects}"', 'objects_url = "objects"'))
    assert ckpt_here(tmp_path, "log").returncode == 0
    with Repository.open(tmp_path) as repo:
        assert_same(state, repo.checkout(cid))


def test_a_chunk_read_the_disk_fails_names_the_object_file(tmp_path, monkeypatch):
    """EIO in checkout's chunk reads (FileRanges) named no file: 'the disk failed to read or write (input/output
    error)' with no path, where the object reads name theirs (reviewer 435)."""
    import errno

    import torch

    from ckptstore import Repository
    from ckptstore.errors import explain

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")  # what the kernel gives a read of a bad sector

    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.randn(100_000, generator=torch.Generator().manual_seed(0))})
        monkeypatch.setattr(os, "pread", failing)
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(OSError) as failed:
            repo.checkout(cid)
    said = str(explain(failed.value))
    assert failed.value.filename and str(tmp_path / ".ckpt" / "objects") in failed.value.filename
    assert failed.value.filename in said and "input/output error" in said, said
