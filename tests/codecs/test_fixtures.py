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


def _manifest_fixture(name: str) -> tuple[Path, dict, bytes, dict]:
    """A frozen manifest case: its folder, case.json, stored bytes, and the JSON record those bytes hold."""
    folder = ROOT / "manifest" / name
    meta = json.loads((folder / "case.json").read_text())
    data = (folder / meta["bytes"]).read_bytes()
    record = json.loads(zstandard.ZstdDecompressor().decompress(data))
    assert record == meta["record"]  # the bytes are the ones frozen beside their record
    return folder, meta, data, record


def _ids(record: dict) -> dict[str, str]:
    """Each entry's tensor id as frozen in the record: hashes, not worth spelling out in the tests."""
    return {path: tensor for path, (tensor, _, _) in record["entries"].items()}


def _rebuilt(folder: Path, meta: dict, manifest, dest: Path, exact: bool) -> dict:
    """Write the manifest's one file as checkout does, from the tensors frozen as checkout replayed them.

    Returns those tensors by path (the raw bytes, shaped by the manifest's entries, as checkout shapes them).
    """
    from ckptstore.formats.checkpoint_io import write_file
    from ckptstore.state import RawTensor

    raws = {path: RawTensor(manifest.entries[path].dtype, manifest.entries[path].shape,
                            np.fromfile(folder / name, np.uint8)) for path, name in meta["tensors"].items()}
    (record,) = manifest.files
    write_file(record, dest, lambda path: pytest.fail(f"a container file asked for {path}'s value"),
               raws.__getitem__, exact)
    assert dest.read_bytes() == (folder / meta["expected"]).read_bytes()
    return raws


def test_manifest_v2_sharded_bytes_decode_to_their_dcp_metadata():
    """Version 2 (a sharded commit, one process through CkptStorageWriter): the `dcp` section and shard entries."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptstore.dcp import meta as dcp_meta
    from ckptstore.repo import Manifest
    from ckptstore.repo.manifest import Entry
    from ckptstore.repo.sharded import dcp_problem

    _, _, data, record = _manifest_fixture("v2-sharded")
    ids = _ids(record)
    plain = {"layout": "torch.strided", "memory_format": "torch.contiguous_format", "pin_memory": False,
             "requires_grad": False, "type": "tensor"}
    dcp = {"version": 1, "dcp_version": None, "storage_meta": None, "items": [
        dict(plain, fqn="w", dtype="torch.float32", size=[2, 3], chunks=[[[0, 0], [2, 3], "w/%shard/0,0/2,3"]]),
        dict(plain, fqn="n", dtype="torch.int64", size=[4], chunks=[[[0], [4], "n/%shard/0/4"]]),
        {"fqn": "note.text", "key": "note.text/%bytes", "type": "bytes"},
        {"fqn": "note.k", "key": "note.k/%bytes", "type": "bytes"}],
        "planner_data": ["dict", [["w", ["tuple", ["w"]]], ["n", ["tuple", ["n"]]],
                                  ["note.text", ["tuple", ["note", "text"]]], ["note.k", ["tuple", ["note", "k"]]]]]}
    entries = {"w/%shard/0,0/2,3": Entry(ids["w/%shard/0,0/2,3"], "torch.float32", (2, 3)),
               "n/%shard/0/4": Entry(ids["n/%shard/0/4"], "torch.int64", (4,)),
               "note.text/%bytes": Entry(ids["note.text/%bytes"], "bytes", (22,)),
               "note.k/%bytes": Entry(ids["note.k/%bytes"], "bytes", (19,))}
    manifest = Manifest.from_bytes(data)
    assert record["version"] == 2 and manifest == Manifest("dcp", [], entries, {}, dcp=dcp)
    assert dcp_problem(manifest) is None
    tensor = {fqn: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                         [ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))])
              for fqn, dtype, size in (("w", torch.float32, [2, 3]), ("n", torch.int64, [4]))}
    assert dcp_meta.from_json(manifest.dcp, manifest.oid) == Metadata(
        state_dict_metadata={**tensor, "note.text": BytesStorageMetadata(), "note.k": BytesStorageMetadata()},
        planner_data={"w": ("w",), "n": ("n",), "note.text": ("note", "text"), "note.k": ("note", "k")},
        storage_data={MetadataIndex("w", [0, 0]): "w/%shard/0,0/2,3", MetadataIndex("n", [0]): "n/%shard/0/4",
                      MetadataIndex("note.text"): "note.text/%bytes", MetadataIndex("note.k"): "note.k/%bytes"})


def test_manifest_v3_permuted_splices_rebuild_the_committed_file_to_the_bit(tmp_path):
    """Version 3: a splice's sixth field puts a transposed and a channels_last fp16 record back in the file's order."""
    import torch

    from ckptstore.formats import CheckpointFile
    from ckptstore.formats.checkpoint_io import file_state
    from ckptstore.formats.filemap import file_digest
    from ckptstore.repo import Manifest
    from ckptstore.repo.manifest import Entry
    from ckptstore.state import materialize

    folder, meta, data, record = _manifest_fixture("v3-permuted-splice")
    ids = _ids(record)
    skeleton = ["dict", [["half.weight", ["tensor", "half.weight"]], ["conv.weight", ["tensor", "conv.weight"]],
                         ["plain", ["tensor", "plain"]], ["shape", ["size", [4, 3]]], ["step", 5]]]
    container = {"entry": "%container", "size": 1963, "splices": [
        [768, 24, "half.weight", 2728428408, [1514, 772], [1, 0]],
        [872, 48, "conv.weight", 2382659317, [1568, 876], [0, 2, 3, 1]],
        [952, 8, "plain", 3921356690, [1622, 956]]]}
    entries = {"%container": Entry(ids["%container"], "bytes", (1883,)),
               "conv.weight": Entry(ids["conv.weight"], "torch.float16", (2, 3, 2, 2)),
               "half.weight": Entry(ids["half.weight"], "torch.float16", (4, 3)),
               "plain": Entry(ids["plain"], "torch.float16", (4,))}
    files = [CheckpointFile("", "torch", skeleton, 1963, mode=0o644, container=container)]
    manifest = Manifest.from_bytes(data)
    assert record["version"] == 3
    assert manifest == Manifest("file", files, entries, {"": record["files"][0]["digest"]})
    raws = _rebuilt(folder, meta, manifest, tmp_path / "a.pt", exact=True)
    assert file_digest(tmp_path / "a.pt") == manifest.digests[""]  # the committed file, byte for byte
    values = {"half.weight": torch.arange(12, dtype=torch.float16).reshape(3, 4).t(),
              "conv.weight": torch.arange(24, dtype=torch.float16).reshape(2, 3, 2, 2)
              .contiguous(memory_format=torch.channels_last), "plain": torch.arange(4, dtype=torch.float16)}
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    state = file_state(manifest.files[0], lambda path: materialize(raws[path]))
    for key, value in values.items():
        assert torch.equal(loaded[key], value) and loaded[key].stride() == value.stride()
        assert torch.equal(state[key], value)
    assert type(state["shape"]) is torch.Size and state["shape"] == loaded["shape"] == (4, 3)
    assert state["step"] == loaded["step"] == 5


def test_manifest_v1_optional_fields_decode_and_the_lossy_file_is_rebuilt_to_the_bit(tmp_path):
    """Version 1 with container splices, mode, sources, measured(_as) and empty_folders: a lossy folder commit."""
    import torch

    from ckptstore.formats import CheckpointFile
    from ckptstore.formats.checkpoint_io import file_state
    from ckptstore.repo import Manifest
    from ckptstore.repo.manifest import Entry
    from ckptstore.state import materialize

    folder, meta, data, record = _manifest_fixture("v1-optional-fields")
    ids = _ids(record)
    weight, state_0 = "model.pt/model/weight", "model.pt/optimizer/state/0"
    group = [["lr", 0.001], ["betas", ["tuple", [0.9, 0.999]]], ["eps", 1e-08], ["weight_decay", 0],
             ["amsgrad", False], ["maximize", False], ["foreach", None], ["capturable", False],
             ["differentiable", False], ["fused", None], ["decoupled_weight_decay", False], ["params", ["list", [0]]]]
    moments = [[name, ["tensor", f"{state_0}/{name}"]] for name in ("step", "exp_avg", "exp_avg_sq")]
    skeleton = ["dict", [
        ["model", ["odict", [["weight", ["tensor", weight]]],
                   {"attrs": [["_metadata", ["odict", [["", ["dict", [["version", 1]]]]]]]]}]],
        ["optimizer", ["dict", [["state", ["dict", [[0, ["dict", moments]]]]],
                                ["param_groups", ["list", [["dict", group]]]]]]],
        ["shape", ["size", [8, 16]]]]]
    container = {"entry": "model.pt/%container", "size": 4105, "splices": [
        [1344, 512, weight, 3002305588, [2118, 1348]], [1408, 4, f"{state_0}/step", 1469619852, [2176, 1412]],
        [1532, 512, f"{state_0}/exp_avg", 2675912588, [2234, 1536]],
        [1596, 512, f"{state_0}/exp_avg_sq", 1318519590, [2292, 1600]]]}
    entries = {"model.pt/%container": Entry(ids["model.pt/%container"], "bytes", (2565,)),
               weight: Entry(ids[weight], "torch.float32", (8, 16)),
               f"{state_0}/exp_avg": Entry(ids[f"{state_0}/exp_avg"], "torch.float32", (8, 16)),
               f"{state_0}/exp_avg_sq": Entry(ids[f"{state_0}/exp_avg_sq"], "torch.float32", (8, 16)),
               f"{state_0}/step": Entry(ids[f"{state_0}/step"], "torch.float32", ())}
    quantized = (weight, f"{state_0}/exp_avg", f"{state_0}/exp_avg_sq")
    files = [CheckpointFile("model.pt", "torch", skeleton, 4105, mode=0o640, container=container)]
    expected = Manifest("folder", files, entries, {"model.pt": record["files"][0]["digest"]}, lossy="balanced",
                        pairing="optimizer order matches the model's",
                        measured={weight: [0.004595486344989046, 0.020000000000000004, "deadzone"]},
                        sources={path: record["sources"][path] for path in quantized}, empty_folders=["runs"])
    manifest = Manifest.from_bytes(data)
    assert record["version"] == 1 and manifest == expected
    assert all(manifest.sources[path] != manifest.entries[path].tensor for path in quantized)  # each one quantized
    raws = _rebuilt(folder, meta, manifest, tmp_path / "model.pt", exact=False)  # CRCs of the lossy values
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    state = file_state(manifest.files[0], lambda path: materialize(raws[path]))
    assert type(state["shape"]) is torch.Size and state["shape"] == loaded["shape"] == (8, 16)
    assert state["model"]._metadata == {"": {"version": 1}} and state["optimizer"]["state"][0]["step"] == 2
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


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
