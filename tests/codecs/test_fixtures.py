"""Golden fixtures: today's decoders must read the bytes earlier encoders wrote, to the bit.

The layouts each decoder accepts are declared once, as DECODES next to the decoder in each codec
module (whoever teaches a decoder a new magic, mode or method edits that file and sees the list);
the tests below cross-check those lists against the codes' own constants, and read which layouts
a fixture covers off its payload bytes, not off its case.json, so a fixture cannot claim coverage
it does not have.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zstandard

from ckptstore.codecs import REGISTRY, bytegroup, deadzone, entropy, get_codec, logmoment, normmoment
from ckptstore.codecs.checked import decode_chain_checked, decode_checked
from ckptstore.hashing import chunk_checksum

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
CASES = sorted(p.parent for p in (ROOT / "codecs").glob("*/*/case.json"))
# Every accepted layout per fixture group: the registered codecs, and the entropy coder they share.
DECLARED = {"bytegroup": bytegroup.DECODES, "deadzone": deadzone.DECODES, "log2moment": logmoment.DECODES,
            "normmoment": normmoment.DECODES, "entropy": entropy.DECODES}


def _load(folder: Path) -> tuple[dict, list[bytes], np.ndarray | None, np.ndarray]:
    meta = json.loads((folder / "case.json").read_text())
    payloads = [(folder / name).read_bytes() for name in meta["payloads"]]
    base = np.fromfile(folder / meta["base"], np.uint8) if meta["base"] else None
    expected = np.fromfile(folder / meta["expected"], np.dtype(meta["expected_dtype"]))
    return meta, payloads, base, expected


def _layouts(group: str, kind: str, payloads: list[bytes]) -> set[str]:
    """The layouts these payloads exercise, read off their bytes."""
    found = {"chain"} if kind == "chain" else set()
    for payload in payloads:
        if group == "bytegroup":
            found |= {f"plane:{bytegroup.MODE_NAMES[m]}" for m in get_codec("bytegroup").plane_modes(payload)}
        elif group == "entropy":
            found.add(f"method:{entropy.METHOD_NAMES[entropy._header(payload)[0]]}")
        elif group in ("deadzone", "log2moment"):
            found.add(f"{payload[:3].decode()}:{'residual' if payload[3] else 'keyframe'}")
        else:
            found.add(payload[:3].decode())
    return found


def test_the_fixture_tree_is_small_and_pickle_free():
    files = [p for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 1 << 20
    assert {p.suffix for p in files} <= {".bin", ".json", ".py"}


def test_every_registered_codec_and_every_layout_it_decodes_has_a_fixture():
    covered: dict[str, set[str]] = {}
    for folder in CASES:
        meta, payloads, _, _ = _load(folder)
        covered.setdefault(meta["codec"], set()).update(_layouts(meta["codec"], meta["kind"], payloads))
    assert set(REGISTRY) <= set(DECLARED), f"codecs without a DECODES list: {set(REGISTRY) - set(DECLARED)}"
    for group, declared in DECLARED.items():
        missing = set(declared) - covered.get(group, set())
        assert not missing, f"{group}: no fixture for {sorted(missing)}; add a case to tests/fixtures/make_fixtures.py"
        assert covered[group] <= set(declared), f"{group}: fixtures use undeclared {covered[group] - set(declared)}"


def test_declared_layouts_match_the_codecs_constants():
    modes = {bytegroup.RAW, *bytegroup._CODER}
    assert set(bytegroup.MODE_NAMES) == modes and len(bytegroup.DECODES) == len(modes) + 1
    methods = {v for k, v in vars(entropy).items() if k in ("ZSTD", "RANS", "CONSTANT", "SPARSE", "PACKED", "GAPS",
                                                            "SPLIT")}
    assert set(entropy.METHOD_NAMES) == methods == set(range(len(methods)))  # ids are dense: a new one is noticed
    magics = {deadzone.MAGIC, deadzone.MAGIC_V1, b"CB1"}
    assert {d.split(":")[0].encode() for d in deadzone.DECODES if d != "chain"} == magics
    assert {d.split(":")[0].encode() for d in logmoment.DECODES if d != "chain"} == {logmoment.MAGIC}
    assert {d.encode() for d in normmoment.DECODES} == {normmoment.MAGIC, normmoment.MAGIC_V1}


def _decode(meta: dict, payloads: list[bytes], base: np.ndarray | None) -> np.ndarray:
    if meta["kind"] == "symbols":
        return entropy.decode_symbols(payloads[0])
    codec = get_codec(meta["codec"])
    if meta["kind"] == "chain":
        return codec.decode_chain(payloads, meta["params"], meta["nbytes"])
    return codec.decode(payloads[0], None if base is None else base.copy(), meta["params"], meta["nbytes"])


@pytest.mark.parametrize("folder", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fixture_decodes_to_its_frozen_bytes(folder):
    meta, payloads, base, expected = _load(folder)
    assert chunk_checksum(expected.view(np.uint8)) == meta["checksum"]  # the expected file itself is intact
    decoded = _decode(meta, payloads, base)
    assert decoded.dtype == expected.dtype and decoded.tobytes() == expected.tobytes()
    if meta["kind"] == "chain":  # level by level must give the same bits as the one-call chain
        result = None
        for payload in reversed(payloads):
            result = get_codec(meta["codec"]).decode(payload, result, meta["params"], meta["nbytes"])
        assert result.tobytes() == expected.tobytes()
        out = decode_chain_checked(meta["codec"], payloads, meta["params"], meta["nbytes"], meta["checksum"])
        assert out.tobytes() == expected.tobytes()
    elif meta["kind"] == "decode":
        out = decode_checked(meta["codec"], payloads[0], None if base is None else base.copy(), meta["params"],
                             meta["nbytes"], meta["checksum"], object_id="fixture")
        assert out.tobytes() == expected.tobytes()


def test_manifest_v1_bytes_decode_to_their_record():
    from ckptstore.repo import Manifest

    meta = json.loads((ROOT / "manifest" / "v1" / "case.json").read_text())
    data = (ROOT / "manifest" / "v1" / meta["bytes"]).read_bytes()
    record = meta["record"]
    assert json.loads(zstandard.ZstdDecompressor().decompress(data)) == record and record["version"] == 1
    manifest = Manifest.from_bytes(data)
    assert (manifest.kind, manifest.lossy, manifest.pairing) == (record["kind"], record["lossy"], record["pairing"])
    assert manifest.importance == record.get("importance")
    assert [dict(f.to_json(), digest=manifest.digests.get(f.name)) for f in manifest.files] == record["files"]
    assert {p: [e.tensor, e.dtype, list(e.shape)] for p, e in manifest.entries.items()} == record["entries"]


def test_the_generator_never_overwrites_a_fixture(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._write_case(tmp_path / "case", {"codec": "x"}, {"payload-0.bin": b"old"})
    with pytest.raises(FileExistsError):
        module._write_case(tmp_path / "case", {"codec": "x"}, {"payload-0.bin": b"new"})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "payload-0.bin").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        module._write_case(tmp_path / "other", {}, {"payload-0.bin": b"new"})
    assert (tmp_path / "case" / "payload-0.bin").read_bytes() == b"old"


def test_pack_v1_reads_back_its_payloads_and_is_written_the_same_today():
    from ckptstore.hashing import object_id
    from ckptstore.objectstore import MemoryObjectStore
    from ckptstore.objectstore.pack import PackReader, PackWriter

    folder = ROOT / "pack" / "v1"
    meta = json.loads((folder / "case.json").read_text())
    pack = (folder / meta["bytes"]).read_bytes()
    payloads = [(folder / name).read_bytes() for _, _, name in meta["slots"]]
    assert object_id(pack) == meta["object_id"]
    store = MemoryObjectStore()
    assert store.put(pack) == meta["object_id"]
    whole, ranged = PackReader(store), PackReader(store, verify=False, ranges=store.open_ranges())
    for (offset, length, _), payload in zip(meta["slots"], payloads):
        assert bytes(whole.read(meta["object_id"], offset, length)) == payload
        assert bytes(ranged.read(meta["object_id"], offset, length, bytearray(length))) == payload
    writer, again = PackWriter(MemoryObjectStore()), []
    again = [writer.add(p) for p in payloads]
    writer.close()
    assert {s.object_id for s in again} == {meta["object_id"]}
    assert [[s.offset, s.length] for s in again] == [slot[:2] for slot in meta["slots"]]
