"""Fuzzing every decoder from the golden fixtures: damaged input decodes exactly or raises a ckptstore error.

Which layer guarantees what (each is tested below on its own):
- codec (`codec.decode`, `decode_chain`, `entropy.decode_symbols`): never anything but a CkptError,
  a crash, a hang or an allocation far beyond the output; it MAY return wrong bytes of the right
  size (a flipped bit of a raw mantissa plane decodes fine), so it alone is not the guarantee.
- chunk checksum (`codecs/checked.py` decode_checked / decode_chain_checked; replay does the same
  per chunk, and hashes whole tensors against their tensor id where no checksum was recorded):
  a decode that succeeds equals the original decode bit for bit, else CorruptObjectError.
- object id (objectstore get/view, and PackReader with verify): stored bytes that are not those
  their blake3 id names raise CorruptObjectError before any decoder sees them.
- manifest and packs: a damaged manifest parses to a well-formed Manifest (whose bytes then no
  longer match their object id) or raises; a pack range outside the pack raises, never reads
  the wrong bytes.
- chunk records (database rows: offsets, lengths, sizes, ids, checksums): replay of a damaged
  record gives the original tensor or raises a CkptError.
Default run: a bounded number of inputs per decoder; CKPT_HYPOTHESIS_PROFILE=long (or
CKPT_FUZZ_EXAMPLES=N) runs 100,000 each; CKPT_FUZZ_REPORT=FILE collects the counts.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import Repository
from ckptstore.codecs import entropy, get_codec
from ckptstore.codecs.checked import decode_chain_checked, decode_checked
from ckptstore.errors import CkptError, CorruptObjectError
from ckptstore.objectstore.local import LocalObjectStore
from ckptstore.objectstore.pack import PackReader
from ckptstore.repo.manifest import Manifest
from tests.fuzz.mutations import DAMAGE, EXAMPLES, HUGE, damage, run_tallied, watched

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GROUPS = ("bytegroup", "deadzone", "log2moment", "normmoment", "entropy")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES < 1000,
                suppress_health_check=list(HealthCheck))


def _case(folder: Path) -> tuple[dict, list[bytes], np.ndarray | None, np.ndarray]:
    meta = json.loads((folder / "case.json").read_text())
    payloads = [(folder / name).read_bytes() for name in meta["payloads"]]
    base = np.fromfile(folder / meta["base"], np.uint8) if meta["base"] else None
    return meta, payloads, base, np.fromfile(folder / meta["expected"], np.dtype(meta["expected_dtype"]))


def _cases(group: str) -> list:
    return [_case(p.parent) for p in sorted((FIXTURES / "codecs" / group).glob("*/case.json"))]


def _codec_layer(meta: dict, bad: list[bytes], base: np.ndarray | None) -> str:
    """The codec alone: "decoded" (right size, maybe wrong bytes) or "refused" (a CkptError); else the test fails."""
    codec, params, nbytes = get_codec(meta["codec"]), meta["params"], meta["nbytes"]
    try:
        if meta["kind"] == "chain":
            out = codec.decode_chain(bad, params, nbytes)
            stepwise = None
            for payload in reversed(bad):  # level by level: the other decoding path
                stepwise = codec.decode(payload, stepwise, params, nbytes)
        else:
            out = codec.decode(bad[0], None if base is None else base.copy(), params, nbytes)
    except CkptError:
        return "refused"
    assert out.dtype == np.uint8, f"{meta['codec']}: decoded to {out.dtype}"
    return "decoded"


def _checked_layer(meta: dict, bad: list[bytes], base: np.ndarray | None, want: bytes) -> bool:
    """The checked decode: the original bytes (True) or CorruptObjectError (False); nothing else."""
    args = (meta["params"], meta["nbytes"], meta["checksum"])
    try:
        if meta["kind"] == "chain":
            out = decode_chain_checked(meta["codec"], bad, *args, object_id="fuzzed")
        else:
            out = decode_checked(meta["codec"], bad[0], None if base is None else base.copy(), *args,
                                 object_id="fuzzed")
    except CorruptObjectError as exc:
        assert "fuzzed" in str(exc)
        return False
    assert out.tobytes() == want, f"{meta['codec']}: a damaged payload decoded to wrong bytes past the checksum"
    return True


def _check_symbols(payload: bytes, expected: np.ndarray) -> str:
    try:
        out = entropy.decode_symbols(payload, limit=expected.size)
    except CkptError:
        return "refused"
    assert out.size <= expected.size, "a stream over its limit was decoded"
    return "exact" if out.tobytes() == expected.tobytes() else "decoded-other (the chunk checksum is above)"


@pytest.mark.parametrize("group", GROUPS)
def test_codec_decoders_refuse_damage_or_decode_exactly(group):
    cases = _cases(group)
    swaps = [p for _, payloads, _, _ in cases for p in payloads]

    def body(tally):
        @FUZZ
        @given(st.data())
        def fuzz(data):
            meta, payloads, base, expected = data.draw(st.sampled_from(cases))
            level = data.draw(st.integers(0, len(payloads) - 1))
            source = data.draw(st.sampled_from(swaps)) if data.draw(st.integers(0, 15)) == 0 else payloads[level]
            bad = list(payloads)
            bad[level] = damage(source, data.draw(DAMAGE))
            with watched(f"{group} {meta['kind']}", expected.nbytes):
                if meta["kind"] == "symbols":
                    tally.add(_check_symbols(bad[0], expected))
                    return
                layer = _codec_layer(meta, bad, base)
                exact = _checked_layer(meta, bad, base, expected.tobytes())
            tally.add("exact" if exact else "refused" if layer == "refused" else "caught by checksum")

        fuzz()

    tally = run_tallied(f"codec:{group}", body)
    assert sum(tally.counts.values()) >= min(EXAMPLES, 20)


def test_streams_nested_past_any_encoder_are_refused_not_a_recursion_error():
    head = entropy._HEAD
    stream = zeros = head.pack(entropy.MAGIC, entropy.CONSTANT, 4) + (0).to_bytes(8, "little")
    for _ in range(2000):  # split streams whose high part is another split stream: 82 KB, no encoder writes it
        stream = head.pack(entropy.MAGIC, entropy.SPLIT, 4) + entropy._SPLIT.pack(1, len(stream)) + stream + zeros
    with pytest.raises(CkptError, match="nest more than"):
        entropy.decode_symbols(stream, limit=4)
    codec, params = get_codec("deadzone"), {"dtype": "torch.float32", "step": 0.004}
    good = codec.encode_lossy(np.zeros(4, np.float32).view(np.uint8), None, params)[0]
    with pytest.raises(CorruptObjectError):
        decode_checked("deadzone", good[: good.index(entropy.MAGIC)] + stream, None, params, 16, None, "obj")


def test_a_manifest_of_forged_nesting_is_a_corrupt_object():
    for text in (b"[" * 100_000 + b"]" * 100_000, b'{"version": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        with pytest.raises(CorruptObjectError, match="fuzzed"):
            Manifest.from_bytes(zstandard.ZstdCompressor().compress(text), "fuzzed")


def test_objects_are_verified_against_their_id(tmp_path):
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    payloads = [p for g in GROUPS for _, ps, _, _ in _cases(g) for p in ps]

    def body(tally):
        @FUZZ
        @given(st.sampled_from(payloads), DAMAGE)
        def fuzz(payload, ops):
            oid = store.put(payload)
            bad = damage(payload, ops)
            store.path_of(oid).write_bytes(bad)
            for read in (store.get, store.view):
                try:
                    got = read(oid)
                except CorruptObjectError as exc:
                    assert oid in str(exc)
                    tally.add("refused")
                else:
                    assert bytes(got) == payload == bad, "damaged bytes read back under the original id"
                    tally.add("unchanged")
            store.path_of(oid).write_bytes(payload)

        fuzz()

    run_tallied("object-id", body)


def _well_formed(manifest: Manifest) -> None:
    assert isinstance(manifest.kind, str)
    for path, entry in manifest.entries.items():
        assert isinstance(path, str) and isinstance(entry.tensor, str) and isinstance(entry.dtype, str)
        assert all(type(n) is int and n >= 0 for n in entry.shape), entry
    for file in manifest.files:
        assert isinstance(file.name, str) and isinstance(file.format, str)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def _replace_somewhere(record, path: list[int], value):
    """`record` with the node that `path` picks (indices into each level's keys or items) set to `value`."""
    if not path or not isinstance(record, (dict, list)) or not record:
        return value
    keys = list(record) if isinstance(record, dict) else list(range(len(record)))
    key = keys[path[0] % len(keys)]
    copy = dict(record) if isinstance(record, dict) else list(record)
    copy[key] = _replace_somewhere(record[key], path[1:], value)
    return copy


def test_manifest_decoder_gives_a_well_formed_manifest_or_an_error():
    data = (FIXTURES / "manifest" / "v1" / "manifest.bin").read_bytes()
    record = json.loads(zstandard.ZstdDecompressor().decompress(data))

    def body(tally):
        @FUZZ
        @given(st.booleans(), DAMAGE, st.lists(st.integers(0, 50), max_size=6), JSON)
        def fuzz(as_bytes, ops, path, value):
            if as_bytes:
                bad = damage(data, ops)
            else:
                text = json.dumps(_replace_somewhere(record, path, value), sort_keys=True).encode()
                bad = zstandard.ZstdCompressor(level=1).compress(text)
            with watched("manifest", len(data) * 64):
                try:
                    manifest = Manifest.from_bytes(bad, "fuzzed")
                except CkptError as exc:
                    assert "fuzzed" in str(exc)
                    tally.add("refused")
                    return
            _well_formed(manifest)  # parsed: its bytes differ, so its object id no longer matches
            tally.add("parsed")

        fuzz()

    run_tallied("manifest", body)


OFFSETS = st.sampled_from(HUGE) | st.integers(-(1 << 40), 1 << 40) | st.integers(-8, 6000)


def test_pack_ranges_outside_the_pack_are_refused(tmp_path):
    meta = json.loads((FIXTURES / "pack" / "v1" / "case.json").read_text())
    pack = (FIXTURES / "pack" / "v1" / meta["bytes"]).read_bytes()
    store = LocalObjectStore(tmp_path / "objects", tmp_path / "tmp")
    oid = store.put(pack)
    assert oid == meta["object_id"]
    readers = [PackReader(store), PackReader(store, verify=False, ranges=store.open_ranges())]

    def body(tally):
        @FUZZ
        @given(st.sampled_from(meta["slots"]), OFFSETS, OFFSETS, st.booleans())
        def fuzz(slot, offset, length, near):
            if near:  # a slot's own range, shifted: overlaps and off-by-some
                offset, length = slot[0] + offset % 64 - 32, slot[1] + length % 64 - 32
            for reader in readers:
                with watched("pack range"):
                    try:
                        got = reader.read(oid, offset, length)
                    except CorruptObjectError as exc:
                        assert oid in str(exc)
                        tally.add("refused")
                        continue
                assert 0 <= offset and 0 <= length, (offset, length)
                # past the end only an empty range may be read (ranges read alone do not know the pack's size)
                assert offset + length <= len(pack) or not length, (offset, length)
                assert bytes(got) == pack[offset : offset + length]
                tally.add("exact")

        fuzz()

    try:
        run_tallied("pack", body)
    finally:
        readers[1].ranges.close()


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A repository with chunked, packed, residual and lossy tensors; their records and decoded bytes."""
    from ckptstore.metadata import tensors as tensor_rows
    from ckptstore.replay import ChainSource, replay
    from ckptstore.repo import EncodingSettings

    # small chunks: tensors of several chunks, packed and whole-object payloads both
    repo = Repository.init(tmp_path_factory.mktemp("records"), encoding=EncodingSettings(chunk_bytes=64 << 10))
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(70_000, generator=g), torch.randn(300, generator=g).to(torch.bfloat16)
    ids = []
    for i, lossy in enumerate((None, None, "balanced")):
        state = {"model": {"big": big * (1 + i / 100), "small": small + i, "n": torch.arange(i, 500 + i)},
                 "optimizer": {"state": {0: {"exp_avg": big[:5000] * i, "exp_avg_sq": big[:5000] ** 2 * (i + 1),
                                             "step": torch.tensor(float(i))}},
                               "param_groups": [{"params": [0], "lr": 0.1}]}}
        cid = repo.commit(state, lossy=lossy)
        ids += [e.tensor for e in repo.manifest(cid).entries.values()]
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, set(ids))
    with ThreadPoolExecutor(2) as pool:
        good = replay(ChainSource(repo.store, records), list(records.values()), pool)
    yield repo, records, good
    repo.close()


FIELDS = ("offset", "length", "raw_bytes", "object_id", "checksum")
RECORD_FIELDS = ("base_id", "depth", "shape", "dtype", "codec", "raw_bytes")


def _damaged_records(records: dict, draw) -> tuple[dict, object]:
    """The records with one field of one record (or of one of its chunks) set to a drawn value."""
    import copy

    ids = sorted(records)
    target = copy.deepcopy(records[draw(st.sampled_from(ids))])
    numbers = st.sampled_from(HUGE) | st.integers(-(1 << 20), 1 << 20) | st.integers(-3, 3)
    if target.chunks and draw(st.booleans()):
        chunk = target.chunks[draw(st.integers(0, len(target.chunks) - 1))]
        name = draw(st.sampled_from(FIELDS))
        others = [c for r in records.values() for c in r.chunks]
        if name == "object_id":
            chunk.object_id = draw(st.sampled_from(others)).object_id
        elif name == "checksum":
            chunk.checksum = draw(st.sampled_from([None, *(c.checksum for c in others[:20])]))
        elif name == "length" and chunk.length is None:
            chunk.length = draw(numbers)
        else:
            value = getattr(chunk, name) or 0
            setattr(chunk, name, draw(st.sampled_from([value + draw(st.integers(-4, 4)), draw(numbers)])))
    else:
        name = draw(st.sampled_from(RECORD_FIELDS))
        pick = {"base_id": lambda: draw(st.sampled_from([None, *ids])), "depth": lambda: draw(st.integers(-1, 70)),
                "shape": lambda: tuple(draw(st.lists(st.integers(0, 1 << 20), max_size=3))),
                "dtype": lambda: draw(st.sampled_from(["torch.float32", "torch.bfloat16", "torch.int64", "bytes"])),
                "codec": lambda: draw(st.sampled_from(["bytegroup", "deadzone", "log2moment", "normmoment"])),
                "raw_bytes": lambda: draw(numbers)}
        setattr(target, name, pick[name]())
    return {**records, target.id: target}, target


def test_damaged_chunk_records_replay_exactly_or_raise(committed):
    from ckptstore.replay import ChainSource, replay

    repo, records, good = committed

    def body(tally):
        @FUZZ
        @given(st.data())
        def fuzz(data):
            damaged, target = _damaged_records(records, data.draw)
            with watched("replay", 64 * good[target.id].nbytes), ThreadPoolExecutor(2) as pool:
                try:
                    out = replay(ChainSource(repo.store, damaged), [target], pool)[target.id]
                except CkptError:
                    tally.add("refused")
                    return
            assert out.tobytes() == good[target.id].tobytes(), "a damaged record replayed to other bytes"
            tally.add("exact")

        fuzz()

    run_tallied("chunk-records", body)


def _dcp_sample() -> dict:
    """The JSON of a small DCP Metadata: two sharded tensors, a bytes item, planner data, storage meta."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptstore.formats.dcpmeta import to_json

    def tensor(size, chunks):
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                     [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])

    state = {"model.w": tensor([8, 4], [([0, 0], [4, 4]), ([4, 0], [4, 4])]),
             "optim.state.model.w.exp_avg": tensor([8, 4], [([0, 0], [8, 4])]), "optim.step": BytesStorageMetadata()}
    planner = {"model.w": ("model", "w"), "optim.step": ["optim", "step"]}
    return to_json(Metadata(state, planner, None, StorageMeta(save_id="s", modules=["m"]), "1.0.0"))


def test_dcp_metadata_decoder_gives_metadata_or_an_error():
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    from ckptstore.dcp.meta import from_json

    record = _dcp_sample()
    assert from_json(json.loads(json.dumps(record)), "fuzzed").state_dict_metadata.keys() == {
        "model.w", "optim.state.model.w.exp_avg", "optim.step"}

    def body(tally):
        @FUZZ
        @given(st.lists(st.integers(0, 50), max_size=7), JSON)
        def fuzz(path, value):
            bad = json.loads(json.dumps(_replace_somewhere(record, path, value)))
            with watched("dcp metadata"):
                try:
                    metadata = from_json(bad, "fuzzed")
                except CkptError as exc:
                    assert "fuzzed" in str(exc)
                    tally.add("refused")
                    return
            assert isinstance(metadata, Metadata)
            for fqn, stored in metadata.state_dict_metadata.items():  # every chunk can be found where it is stored
                if isinstance(stored, TensorStorageMetadata):
                    assert all(any(key.fqn == fqn for key in metadata.storage_data) for _ in stored.chunks)
            tally.add("parsed")

        fuzz()

    run_tallied("dcp-metadata", body)
