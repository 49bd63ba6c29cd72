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


@pytest.mark.parametrize("version", [max(KNOWN_VERSIONS) + 1, 0, None, "1"])
def test_a_manifest_of_an_unknown_version_is_refused_with_a_clear_error(version):
    with pytest.raises(ManifestVersionError, match="newer ckptstore") as info:
        Manifest.from_bytes(_stored(_record(version)), "f" * 64)
    assert "f" * 64 in str(info.value)


@pytest.mark.parametrize("data", [b"", b"not zstd", _stored([1, 2]), _stored({"version": 1, "kind": "state"})])
def test_a_damaged_manifest_is_a_corrupt_object(data):
    with pytest.raises((CorruptObjectError, ManifestVersionError)):
        Manifest.from_bytes(data, "e" * 64)
