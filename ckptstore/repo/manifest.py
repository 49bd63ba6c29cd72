"""The manifest: what a commit holds (its files with skeletons, and every tensor entry by path).

Plain, versioned data, stored as zstd-compressed canonical JSON in an object of its own. A
reader refuses a version it does not know instead of guessing at fields it has never seen.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckptstore.errors import CkptError, CorruptObjectError, MalformedSkeletonError
from ckptstore.formats import CheckpointFile
from ckptstore.hashing import ObjectId, TensorId

MANIFEST_VERSION = 1
SHARDED_VERSION = 2  # a sharded (DCP) commit's manifest: version 1's fields plus `dcp`
# version 1 where a torch.save zip's splice has a sixth field (a record holding its tensor's dimensions permuted,
# formats/torchcontainer.py): a reader of version 1 alone would splice such a tensor back in the wrong order
PERMUTED_VERSION = 3
KNOWN_VERSIONS = (1, 2, 3)


MAX_EXPANSION = 1024  # decompressed bytes per stored byte a manifest may claim (JSON compresses 5-20x)


class ManifestVersionError(CkptError):
    """A manifest of a version this ckptstore does not know: written by a newer one."""


class UnreadableManifestError(CorruptObjectError):
    """An object read whole (its hash holds) whose bytes are no manifest: damaged or forged where it was made."""


@contextmanager
def rebuilding_files(cid: str, manifest: Manifest) -> Iterator[None]:
    """Rebuild commit `cid`'s files from `manifest`: a skeleton that does not decode is its manifest's damage.

    The manifest's checks leave torch skeletons alone (a pass of their own over a large state would slow
    every checkout): what unflatten finds is said here, as a damaged manifest naming the commit. A
    safetensors or blob file's skeleton, one pass over its entries, is checked first.
    """
    from ckptstore.formats.skeletons import check_file_layout

    try:
        for record in manifest.files:
            check_file_layout(record, manifest.entries.__getitem__)
        yield
    except MalformedSkeletonError as exc:
        raise UnreadableManifestError(manifest.oid or "manifest", f"a manifest whose stored structure of a file "
                                      f"is damaged or forged ({exc.problem})", [cid]) from None


@dataclass
class Entry:
    """A manifest line: a logical path and the tensor stored there."""

    tensor: TensorId
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Manifest:
    """What a commit holds: its files (with skeletons) and every tensor entry by path."""

    kind: str
    files: list[CheckpointFile]
    entries: dict[str, Entry]
    digests: dict[str, str]
    lossy: str | None = None
    pairing: str | None = None
    importance: str | None = None  # how a lossy commit judged its weights' sensitivity, when measured
    dcp: dict[str, Any] | None = None  # a sharded commit's DCP metadata as plain JSON (repo/sharded.py)
    # [error, bound, codec] measured by this commit, by path, where its tensor restores as a record made before
    # (the change since rounded to nothing): that record's own figures and codec are of the commit that made it
    measured: dict[str, list] = field(default_factory=dict)
    # the input's tensor id of each entry the commit quantized: its record may be an earlier commit's (the change
    # rounded to nothing), whose own `source` is that commit's input, so an identical re-commit is told by this
    sources: dict[str, TensorId] = field(default_factory=dict)
    # a folder commit's sub-folders that hold no file, which a checkout makes again (absent before: none made)
    empty_folders: list[str] = field(default_factory=list)
    oid: str | None = field(default=None, compare=False)  # the object it was read from (None: made here)

    def to_record(self) -> dict[str, Any]:
        """The manifest as the JSON record that is stored."""
        record = {
            "version": self._version(),
            "kind": self.kind,
            "lossy": self.lossy,
            "pairing": self.pairing,
            "files": [dict(f.to_json(), digest=self.digests.get(f.name)) for f in self.files],
            "entries": {p: [e.tensor, e.dtype, list(e.shape)] for p, e in self.entries.items()},
        }
        if self.importance:
            record["importance"] = self.importance
        if self.dcp is not None:  # only sharded commits carry it: ordinary manifests keep their bytes
            record["dcp"] = self.dcp
        if self.measured:  # as rare: manifests without it keep their bytes
            record["measured"] = {path: m[:2] for path, m in self.measured.items()}
            codecs = {path: m[2] for path, m in self.measured.items() if len(m) > 2}
            if codecs:  # apart from the figures: a reader older than it finds them where it looks
                record["measured_as"] = codecs
        if self.sources:  # lossy commits only: lossless manifests keep their bytes
            record["sources"] = self.sources
        if self.empty_folders:  # still version 1: a reader older than it checks the files out, as it always did
            record["empty_folders"] = self.empty_folders
        return record

    def to_bytes(self) -> bytes:
        import zstandard

        text = json.dumps(self.to_record(), sort_keys=True, separators=(",", ":")).encode()
        return zstandard.ZstdCompressor(level=3).compress(text)

    def _version(self) -> int:
        if self.dcp is not None:
            return SHARDED_VERSION
        permuted = any(len(splice) > 5 for f in self.files if f.container for splice in f.container["splices"])
        return PERMUTED_VERSION if permuted else MANIFEST_VERSION

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Manifest:
        """The manifest a stored record describes; TypeError or ValueError for a field of the wrong shape."""
        _check_record(record)
        files = [CheckpointFile.from_json(f) for f in record["files"]]
        for file in files:  # a file's record claiming size 0 is no state's: its views get no storage (a forgery's)
            file.of_state = record["kind"] == "state"
        entries = {p: Entry(TensorId(t), d, tuple(s)) for p, (t, d, s) in record["entries"].items()}
        digests = {f["name"]: f["digest"] for f in record["files"] if f.get("digest")}
        dcp = record.get("dcp") if record.get("version") == SHARDED_VERSION else None
        codecs = record.get("measured_as") or {}
        measured = {path: [*m, codecs[path]] if path in codecs else m
                    for path, m in (record.get("measured") or {}).items()}
        return cls(record["kind"], files, entries, digests, record.get("lossy"), record.get("pairing"),
                   record.get("importance"), dcp, measured, dict(record.get("sources") or {}),
                   list(record.get("empty_folders") or []))

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, oid: ObjectId | str = "manifest") -> Manifest:
        """Parse a stored manifest; `oid` names it in errors."""
        import zstandard

        from ckptstore.threadlocal import decompress_at_most

        try:  # a damaged frame header can declare gigabytes: no manifest compresses 1024x
            record = json.loads(decompress_at_most(data, MAX_EXPANSION * len(data) + (1 << 20)))
        except (zstandard.ZstdError, ValueError, RecursionError) as exc:  # RecursionError: forged nesting
            raise UnreadableManifestError(oid, f"not a readable manifest ({exc})") from None
        version = record.get("version") if isinstance(record, dict) else None
        if version not in KNOWN_VERSIONS:
            raise ManifestVersionError(f"manifest {oid} has version {version!r}, which this ckptstore cannot read "
                                       f"(it reads {', '.join(map(str, KNOWN_VERSIONS))}): it was written by a "
                                       "newer ckptstore; upgrade ckptstore to read this commit")
        try:
            manifest = cls.from_record(record)
            manifest.oid = str(oid)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise UnreadableManifestError(oid, f"a manifest missing or mangling a field ({exc!r})") from None
        if any("%tuple:" in path for path in manifest.entries):  # rare: select (and numpy) only then
            from ckptstore.repo.select import respell_tuple_keys

            respell_tuple_keys(manifest)
        return manifest

    def rewritten_files(self) -> list[str]:
        """Files a checkout writes with torch.save (no container; "" names a lone file): state exact, bytes not."""
        return [f.name for f in self.files if f.format == "torch" and f.container is None]

    def same_content(self, other: Manifest) -> bool:
        """True when both hold the same files and tensors (what "nothing changed" means)."""
        return (self.kind == other.kind and self.entries == other.entries and self.dcp == other.dcp
                and [f.to_json() for f in self.files] == [f.to_json() for f in other.files]
                and self.empty_folders == other.empty_folders)


def _optional_str(value: Any, what: str) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{what} is {value!r}, not a string")


def _text_by_path(value: Any, what: str) -> None:
    """TypeError unless `value` maps paths to strings (codec names, tensor ids)."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TypeError(f"{what} is {value!r}")


def _check_file(f: dict[str, Any], entries: dict[str, Any]) -> None:
    """A file record's fields are of the kinds readers take them for."""
    for key in ("name", "format"):
        if not isinstance(f[key], str):
            raise TypeError(f"file {key} is {f[key]!r}")
    _optional_str(f.get("digest"), "file digest")
    _optional_str(f.get("opaque_reason"), "file opaque_reason")
    if type(f.get("size", 0)) is not int or f.get("size", 0) < 0:
        raise ValueError(f"file size is {f.get('size')!r}")
    if f.get("container") is not None:
        _check_container(f["name"], f["container"], entries)


def _check_container(name: str, container: Any, entries: dict[str, Any]) -> None:
    """A torch.save zip's container record (formats/torchcontainer.py) holds fields of the kinds its writer reads.

    A remote's manifest is its own bytes' hash: a forged one ended checkouts and diffs in KeyErrors
    and TypeErrors. The values themselves are checked where the file is rebuilt (its digest).
    """
    def ints(values: Any) -> bool:
        return isinstance(values, list) and all(type(v) is int for v in values)

    if not (isinstance(container, dict) and isinstance(container.get("entry"), str) and container["entry"] in entries
            and type(container.get("size")) is int and isinstance(container.get("splices"), list)):
        raise TypeError(f"file {name!r} has container {container!r}")
    for splice in container["splices"]:
        if not (isinstance(splice, list) and len(splice) in (5, 6) and ints(splice[0:2]) and type(splice[3]) is int
                and isinstance(splice[2], str) and splice[2] in entries and ints(splice[4])
                and (len(splice) == 5 or ints(splice[5]))):
            raise TypeError(f"file {name!r} has splice {splice!r}")


def _check_record(record: dict[str, Any]) -> None:
    """Every field a reader uses has the type it expects, so a mangled manifest is refused, not half-read.

    Checked here once rather than where each field is used: a wrong type (a shape holding None, a
    file that is a number) would otherwise surface far away as a crash or a wrong tensor.
    """
    if not isinstance(record.get("kind"), str):
        raise TypeError(f"kind is {record.get('kind')!r}")
    if record.get("version") == SHARDED_VERSION and not isinstance(record.get("dcp"), dict):
        raise TypeError(f"a sharded manifest's dcp is {record.get('dcp')!r}")
    for key in ("lossy", "pairing", "importance"):
        _optional_str(record.get(key), key)
    files, entries = record["files"], record["entries"]
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise TypeError("files is not a list of records")
    if not isinstance(entries, dict):
        raise TypeError("entries is not a mapping")
    for f in files:
        _check_file(f, entries)
    measured = record.get("measured") or {}
    if not isinstance(measured, dict) or not all(
            isinstance(m, list) and len(m) == 2 and all(v is None or type(v) in (int, float) for v in m)
            for m in measured.values()):
        raise TypeError(f"measured is {measured!r}")
    for key in ("measured_as", "sources"):
        _text_by_path(record.get(key) or {}, key)
    folders = record.get("empty_folders") or []
    if not isinstance(folders, list) or not all(isinstance(name, str) for name in folders):
        raise TypeError(f"empty_folders is {folders!r}")
    for path, entry in entries.items():
        tensor, dtype, shape = entry
        if not (isinstance(tensor, str) and isinstance(dtype, str) and isinstance(shape, list)):
            raise TypeError(f"entry {path!r} is {entry!r}")
        if not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"entry {path!r} has shape {shape!r}")
