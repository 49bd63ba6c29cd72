import json

import pytest
import zstandard

from ckptstore.errors import CorruptObjectError
from ckptstore.repo.manifest import KNOWN_VERSIONS, Entry, Manifest, ManifestVersionError


def _stored(record) -> bytes:
    return zstandard.ZstdCompressor().compress(json.dumps(record).encode())


def _record(version):
    manifest = Manifest("state", [], {"w": Entry("a" * 64, "torch.float32", (2,))}, {})
    return dict(manifest.to_record(), version=version)


def test_a_manifest_round_trips():
    manifest = Manifest("state", [], {"w": Entry("a" * 64, "torch.float32", (2, 3))}, {}, lossy="balanced")
    again = Manifest.from_bytes(manifest.to_bytes())
    assert again == manifest and again.same_content(manifest)


def test_a_commits_own_figures_round_trip_and_a_manifest_without_them_keeps_its_bytes():
    plain = Manifest("state", [], {"w": Entry("a" * 64, "torch.float32", (2, 3))}, {}, lossy="balanced")
    assert "measured" not in plain.to_record()
    remeasured = Manifest("state", [], plain.entries, {}, lossy="balanced", measured={"w": [0.012, 0.04]})
    assert Manifest.from_bytes(remeasured.to_bytes()).measured == {"w": [0.012, 0.04]}


def test_a_lossy_commits_inputs_round_trip_and_a_manifest_without_them_reads_with_none():
    plain = Manifest("state", [], {"w": Entry("a" * 64, "torch.float32", (2, 3))}, {}, lossy="balanced")
    assert "sources" not in plain.to_record() and Manifest.from_bytes(plain.to_bytes()).sources == {}
    inputs = Manifest("state", [], plain.entries, {}, lossy="balanced", sources={"w": "b" * 64})
    assert Manifest.from_bytes(inputs.to_bytes()).sources == {"w": "b" * 64}


def test_a_folders_empty_folders_round_trip_in_version_1_and_a_manifest_without_them_reads_with_none():
    """A folder commit's sub-folders holding no file were not recorded (fixer helper 329); older manifests have none,
    and a manifest with none keeps the bytes older readers read."""
    plain = Manifest("folder", [], {"w": Entry("a" * 64, "torch.float32", (2, 3))}, {})
    assert "empty_folders" not in plain.to_record() and Manifest.from_bytes(plain.to_bytes()).empty_folders == []
    folders = Manifest("folder", [], plain.entries, {}, empty_folders=["optimizer", "runs/a"])
    assert folders.to_record()["version"] == 1 and not folders.same_content(plain)
    assert Manifest.from_bytes(folders.to_bytes()).empty_folders == ["optimizer", "runs/a"]
    for forged in ("runs", ["runs", 1]):
        with pytest.raises(CorruptObjectError, match="empty_folders"):
            Manifest.from_bytes(_stored(dict(_record(1), empty_folders=forged)), "e" * 64)


@pytest.mark.parametrize("sources", [["w"], {"w": 1}])
def test_inputs_of_the_wrong_shape_are_a_damaged_manifest(sources):
    with pytest.raises(CorruptObjectError, match="sources"):
        Manifest.from_bytes(_stored(dict(_record(1), sources=sources)), "e" * 64)


@pytest.mark.parametrize("measured", [[1], {"w": 0.1}, {"w": [0.1]}, {"w": ["x", 0.1]}])
def test_figures_of_the_wrong_shape_are_a_damaged_manifest(measured):
    with pytest.raises(CorruptObjectError, match="measured"):
        Manifest.from_bytes(_stored(dict(_record(1), measured=measured)), "e" * 64)


@pytest.mark.parametrize("version", [max(KNOWN_VERSIONS) + 1, 0, None, "1"])
def test_a_manifest_of_an_unknown_version_is_refused_with_a_clear_error(version):
    with pytest.raises(ManifestVersionError, match="newer ckptstore") as info:
        Manifest.from_bytes(_stored(_record(version)), "f" * 64)
    assert "f" * 64 in str(info.value)


@pytest.mark.parametrize("data", [b"", b"not zstd", _stored([1, 2]), _stored({"version": 1, "kind": "state"})])
def test_a_damaged_manifest_is_a_corrupt_object(data):
    with pytest.raises((CorruptObjectError, ManifestVersionError)):
        Manifest.from_bytes(data, "e" * 64)


def test_a_frame_that_declares_gigabytes_is_refused_before_they_are_allocated():
    """A damaged zstd header declaring ~1 GB made the decoder allocate it (found by the long fuzz run)."""
    import tracemalloc

    data = bytearray(Manifest("state", [], {"w": Entry("a" * 64, "torch.float32", (2,))}, {}).to_bytes())
    params = zstandard.get_frame_parameters(bytes(data))
    assert params.content_size > 0  # declared in the header: 4 bytes after magic and descriptor
    descriptor = data[4]
    size_bytes = {0: 1 if descriptor & 0x20 else 0, 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    at = 5 + (0 if descriptor & 0x20 else 1) + (0, 1, 2, 4)[descriptor & 3]
    data[4] = (descriptor & 0x3F) | (2 << 6)  # a 4-byte content size field, claiming 970 MB
    data[at : at + size_bytes] = (970_000_000).to_bytes(4, "little")
    tracemalloc.start()
    try:
        with pytest.raises(CorruptObjectError):
            Manifest.from_bytes(bytes(data), "d" * 64)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def _with_container(container):
    record = _record(3)
    record["entries"]["%container"] = ["c" * 64, "bytes", [10]]
    record["files"] = [{"name": "", "format": "torch", "skeleton": None, "size": 30, "container": container}]
    return record


GOOD_SPLICE = [0, 8, "w", 7, [1]]


@pytest.mark.parametrize("container", [
    "abc", [1], {"entry": "%container", "size": 30, "splices": None},
    {"entry": "missing", "size": 30, "splices": []}, {"entry": "%container", "size": "30", "splices": []},
    {"entry": "%container", "size": 30, "splices": [[0, 8]]}, {"entry": "%container", "size": 30,
                                                               "splices": [[0, 8, "nope", 7, [1]]]},
    {"entry": "%container", "size": 30, "splices": [[0, 8, "w", 7, [1], ["a"]]]},
    {"entry": "%container", "size": 30, "splices": [[0.5, 8, "w", 7, [1]]]}])
def test_a_forged_container_is_a_damaged_manifest(container):
    """A remote's manifest is its own bytes' hash: a container of the wrong shape ended checkouts and diffs in
    KeyErrors and TypeErrors, and fsck said ok (hostile-input auditor)."""
    assert Manifest.from_bytes(_stored(_with_container(
        {"entry": "%container", "size": 30, "splices": [GOOD_SPLICE]})), "e" * 64).files[0].container
    with pytest.raises(CorruptObjectError, match="container|splice"):
        Manifest.from_bytes(_stored(_with_container(container)), "e" * 64)


def test_a_commits_figures_and_their_codecs_round_trip_apart():
    """Figures are stored as [error, bound], where a reader older than the codecs checks them, and the codec each
    was measured as apart from them, read back onto the figures: dropped on read, `show` lost the codec of a weight
    restored as its parent's record; written into the figures, older readers refused the manifest (mutation audit
    round 11)."""
    measured = {"w": [0.01, 0.02, "deadzone"], "v": [0.1, 0.3]}
    entries = {"w": Entry("a" * 64, "torch.float32", (2,)), "v": Entry("b" * 64, "torch.float32", (2,))}
    manifest = Manifest("state", [], entries, {}, lossy="balanced", measured=measured, sources={"w": "c" * 64})
    record = manifest.to_record()
    assert record["measured"] == {"w": [0.01, 0.02], "v": [0.1, 0.3]} and record["measured_as"] == {"w": "deadzone"}
    assert Manifest.from_bytes(manifest.to_bytes()).measured == measured


def test_a_torch_files_manifest_keeps_the_version_older_readers_read(repo, tmp_path):
    """A torch file's container splices of five fields are what every reader reads: its manifest keeps the first
    version, not the permuted one (splices of six fields), which ckptstores before it refuse (mutation audit
    round 11)."""
    import torch

    from ckptstore.repo.manifest import MANIFEST_VERSION

    torch.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, tmp_path / "a.pt")
    manifest = repo.manifest(repo.commit(tmp_path / "a.pt"))
    splices = [s for f in manifest.files if f.container for s in f.container["splices"]]
    assert splices and all(len(s) == 5 for s in splices)  # the set-up: a container, no permuted splice
    assert manifest.to_record()["version"] == MANIFEST_VERSION


def test_a_checkpoint_with_an_empty_tensor_commits_and_checks_out(repo, tmp_path):
    """A dimension of size 0 is a valid shape in a manifest: refused on read, the commit was recorded, then its
    manifest read as damaged and the checkpoint could not be checked out (mutation audit round 11)."""
    import torch

    torch.save({"w": torch.randn(4), "empty": torch.zeros(0, 8)}, tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt")
    assert repo.manifest(cid).entries["empty"].shape == (0, 8)
    assert repo.checkout(cid)["empty"].shape == (0, 8)


def _nested_lists(depth):
    node = ["list", [1]]
    for _ in range(depth):
        node = ["list", [node]]
    return node


FORGED_SKELETONS = {  # a remote's files[].skeleton that no flatten wrote
    "list-as-dict-key": ["dict", [[["list", []], 1], ["w", ["tensor", "w"]]]],
    "list-in-a-set": ["dict", [["s", ["set", [["list", [1]]]]], ["w", ["tensor", "w"]]]],
    "class-attribute": ["odict", [["w", ["tensor", "w"]]], {"attrs": [["__class__", 1]]}],
    "dunder-attribute": ["odict", [["w", ["tensor", "w"]]], {"attrs": [["__reduce_ex__", 1]]}],
    "number-attribute": ["odict", [["w", ["tensor", "w"]]], {"attrs": [[5, 1]]}],
    "empty-node": ["dict", [["w", ["tensor", "w"]], ["x", []]]],
    "no-datetime": ["dict", [["w", ["tensor", "w"]], ["x", ["npscalar", "M8[s]", "abc"]]]],
    "no-such-entry": ["dict", [["w", ["tensor", "nope"]]]],
    "no-such-device": ["dict", [["w", ["tensor", "w"]], ["x", ["device", "bogus"]]]],  # torch's RuntimeError
    "too-deep": ["dict", [["w", ["tensor", "w"]], ["x", _nested_lists(420)]]],
}


@pytest.mark.parametrize("forgery", FORGED_SKELETONS)
def test_a_forged_skeleton_is_a_damaged_manifest_naming_the_commit(repo, tmp_path, monkeypatch, forgery):
    """A remote's manifest whose skeleton no flatten wrote (a list as a dict key, `__class__` set as an OrderedDict's
    attribute, 420 nested lists): checkout and export ended in "unexpected TypeError ... please report it", or in
    "folders nested too deeply" (hostile-input auditor)."""
    import torch

    from ckptstore.repo.exporter import export
    from ckptstore.repo.manifest import UnreadableManifestError

    written = Manifest.to_record

    def forged(self):
        record = written(self)
        record["files"][0]["skeleton"] = FORGED_SKELETONS[forgery]
        return record

    with monkeypatch.context() as forging:
        forging.setattr(Manifest, "to_record", forged)
        cid = repo.commit({"w": torch.ones(4), "x": 1})
    for read in (lambda: repo.checkout(cid), lambda: repo.checkout(cid, keys=["*"]),
                 lambda: repo.checkout_to(cid, tmp_path / "out.pt"),
                 lambda: export(repo, cid, "torch", tmp_path / "e.pt")):
        with pytest.raises(UnreadableManifestError, match=f"stored structure .* needed by commits {cid[:12]}") as info:
            read()
        assert type(info.value) is UnreadableManifestError and "\n" not in str(info.value)
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "e.pt").exists()


def test_a_state_nested_as_deep_as_flatten_allows_checks_out_and_exports(repo, tmp_path):
    """The walk's depth is bounded by the stack, not counted: states at flatten's bound still rebuild."""
    import torch

    from ckptstore.repo.exporter import export
    from ckptstore.state import MAX_DEPTH

    state = torch.arange(3)
    for i in range(MAX_DEPTH):
        state = {"k": state} if i % 2 else [state]
    cid = repo.commit(state)
    again = repo.checkout_to(cid, tmp_path / "out.pt")
    export(repo, cid, "torch", tmp_path / "e.pt")
    for loaded in (repo.checkout(cid), torch.load(again), torch.load(tmp_path / "e.pt")):
        for i in reversed(range(MAX_DEPTH)):
            loaded = loaded["k"] if i % 2 else loaded[0]
        assert torch.equal(loaded, torch.arange(3))
