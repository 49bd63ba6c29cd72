"""torch.save files come back byte for byte, and their state exactly (issue 21, items 12 and 15).

Real files through a real repository: torch.save -> commit -> checkout -o, then the bytes and
torch.load's state are compared (types, requires_grad, _metadata, torch.Size, storage sharing).
"""

import os
import random
import stat
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from ckptstore import Repository, formats
from ckptstore.cli import cli
from ckptstore.formats import torchfile
from ckptstore.formats.torchfile import numpy_safe_globals
from ckptstore.state import materialize
from tests.conftest import TinyNet, machine_settings

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def load(path, trusted=False):
    """torch.load as a user would: weights_only, unless the test made the (pickle protocol 4) file itself."""
    with torch.serialization.safe_globals(numpy_safe_globals()):
        return torch.load(path, weights_only=not trusted)


def _tensors(value, out):
    """Every tensor of a nested state, in traversal order."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, out)
    return out


def assert_identical(a, b, where="<root>"):
    """Same types all the way down (Parameter, torch.Size, OrderedDict with its attributes), same bytes."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad, where
        raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw(a), raw(b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert vars(a) == vars(b) if isinstance(a, OrderedDict) else True, f"{where}: attributes differ"
        for key in a:
            assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}/{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), where
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def assert_same_sharing(a, b):
    """Tensors that share a storage in `a` share one in `b`, and no others."""
    ta, tb = _tensors(a, []), _tensors(b, [])
    assert len(ta) == len(tb)
    ptr = lambda t: t.untyped_storage().data_ptr() if t.numel() else None
    for i in range(len(ta)):
        for j in range(i):
            if ptr(ta[i]) is not None and ptr(ta[j]) is not None:
                assert (ptr(ta[i]) == ptr(ta[j])) == (ptr(tb[i]) == ptr(tb[j])), (i, j)


def assert_round_trip(repo, src, out, **options):
    """commit src, checkout -o out: same bytes, and torch.load and checkout give src's state."""
    cid = repo.commit(src, "c", **options)
    repo.checkout_to(cid, out)
    assert out.read_bytes() == src.read_bytes()
    original = load(src, options.get("trust_pickle", False))
    for back in (load(out, options.get("trust_pickle", False)), repo.checkout(cid)):
        assert_identical(original, back)
        assert_same_sharing(original, back)


@st.composite
def states(draw):
    """Random training states: dtypes, shapes (empty too), views, tied weights, Parameters, nested optimizer state."""
    bases = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        base = torch.from_numpy(np.random.default_rng(draw(st.integers(0, 99))).integers(
            0, 256, size=max(1, int(np.prod(shape))) * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
        base = base.view(dtype)[: int(np.prod(shape))].reshape(shape)
        bases.append(base.view(torch.uint8).remainder_(2).view(torch.bool) if dtype == torch.bool else base)
    floats = [b for b in bases if b.is_floating_point() or b.is_complex()]
    items = {}
    for i, base in enumerate(bases):
        kind = draw(st.sampled_from(["plain", "tied", "views", "transpose", "grad", "param"]))
        name = f"t{i}"
        if kind == "param" and (base.is_floating_point() or base.is_complex()):
            items[name] = torch.nn.Parameter(base, requires_grad=draw(st.booleans()))
        elif kind == "grad" and (base.is_floating_point() or base.is_complex()):
            items[name] = base.clone().requires_grad_()
        elif kind == "tied":
            items[name], items[name + "_tied"] = base, base
        elif kind == "views" and base.dim() and base.shape[0] > 1:
            items[name], items[name + "_head"], items[name + "_tail"] = base, base[:1], base[1:]
        elif kind == "transpose" and base.dim() == 2:
            items[name + "_t"] = base.t()
        else:
            items[name] = base
    model = OrderedDict((k, v.detach() if isinstance(v, torch.nn.Parameter) and draw(st.booleans()) else v)
                        for k, v in items.items())
    model._metadata = OrderedDict([("", {"version": 1}), ("bn", {"version": draw(st.integers(1, 3))})])
    state = {"model": model, "size": torch.Size(draw(st.lists(st.integers(0, 9), max_size=3)))}
    if draw(st.booleans()):  # tuple keys, as torch.load(weights_only=True) reads them
        state["per_head"] = {(i, "q/k"): base for i, base in enumerate(bases)} | {((0,), None): 1.5}
    if floats and draw(st.booleans()):
        moment = floats[0].detach().clone()
        state["optimizer"] = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": moment, "exp_avg_sq": moment * 0}},
                              "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}
    return state


@given(states(), st.booleans())
@machine_settings(0.6)
def test_random_states_come_back_byte_for_byte_and_exactly(state, through_torch_load):
    """Both readers: the torch-free one (records matched by their views), torch.load's (by content)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.save(state, tmp / "a.pt")
        with Repository.init(tmp / "repo") as repo:
            assert_round_trip(repo, tmp / "a.pt", tmp / "out.pt", trust_pickle=through_torch_load)
        spliced = lambda trust: [len(s) for s in formats.read_checkpoint(tmp / "a.pt", trust).files[0].container[
            "splices"]]
        # content matching finds as many records as the views prove in order (records of equal bytes may swap
        # tensors); only the views prove a record holding its tensor permuted (a transpose's: a sixth field)
        assert spliced(False).count(5) <= len(spliced(True)) and 6 not in spliced(True)


def _trainer_folder(folder: Path) -> None:
    """The files transformers.Trainer writes in a checkpoint folder, written the way it writes them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(TinyNet(), torch.nn.BatchNorm1d(64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    for _ in range(3):
        out = model[0](torch.randint(0, 64, (4, 8)))
        model[1](out.reshape(-1, 64)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               folder / "rng_state.pth")


def test_trainer_checkpoint_files_come_back_byte_for_byte(repo, tmp_path):
    _trainer_folder(tmp_path / "checkpoint-3")
    cid = repo.commit(tmp_path / "checkpoint-3", "trainer")
    repo.checkout_to(cid, tmp_path / "out")
    for name in ("pytorch_model.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "checkpoint-3" / name).read_bytes(), name
        assert_identical(load(tmp_path / "checkpoint-3" / name), load(tmp_path / "out" / name))
        record = formats.read_checkpoint(tmp_path / "checkpoint-3" / name).files[0]
        with zipfile.ZipFile(tmp_path / "checkpoint-3" / name) as zf:
            storages = [i for i in zf.infolist() if "/data/" in i.filename and i.file_size]
        assert len(record.container["splices"]) == len(storages), name  # every record comes from its tensor
    model = repo.checkout(cid)["pytorch_model.bin"]
    assert model._metadata["1"]["version"] == torch.nn.BatchNorm1d._version  # what load_state_dict hands BatchNorm


def test_file_modes_are_kept(repo, tmp_path):
    src = tmp_path / "a.pt"
    torch.save({"w": torch.randn(3)}, src)
    os.chmod(src, 0o640)
    cid = repo.commit(src, "c")
    repo.checkout_to(cid, tmp_path / "out.pt")
    assert stat.S_IMODE((tmp_path / "out.pt").stat().st_mode) == 0o640


def _deflated(src: Path, dest: Path) -> None:
    """The same archive with every record deflated, as `zip -r` or a repacking tool writes it."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))


def test_deflated_torch_zip_is_read_and_comes_back_byte_for_byte(repo, tmp_path):
    state = {"w": torch.randn(300, 100), "i": torch.arange(10), "tied": None}
    state["tied"] = state["w"][:5]
    torch.save(state, tmp_path / "src.pt")
    _deflated(tmp_path / "src.pt", tmp_path / "a.pt")
    assert_round_trip(repo, tmp_path / "a.pt", tmp_path / "out.pt")
    # torch's own path (taken for what the torch-free reader leaves to it) reads it too: no mmap for deflated records
    assert_identical(torchfile.load(tmp_path / "a.pt"), load(tmp_path / "a.pt"))


def test_lossy_commit_writes_a_valid_zip_of_the_same_layout(repo, tmp_path):
    torch.manual_seed(1)
    state = {"model": TinyNet().state_dict(), "step": 7}
    torch.save(state, tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt", lossy="balanced")
    repo.checkout_to(cid, tmp_path / "out.pt")
    with zipfile.ZipFile(tmp_path / "out.pt") as zf, zipfile.ZipFile(tmp_path / "a.pt") as original:
        assert zf.testzip() is None  # every CRC matches the (lossy) bytes it covers
        changed = [i.filename for i, o in zip(zf.infolist(), original.infolist()) if i.CRC != o.CRC]
        assert any("/data/" in name for name in changed)  # lossy values were written, with new CRCs
        assert [i.filename for i in zf.infolist()] == [i.filename for i in original.infolist()]
    back = load(tmp_path / "out.pt")
    assert back["step"] == 7 and back["model"]._metadata == state["model"]._metadata
    for key, value in state["model"].items():
        assert back["model"][key].dtype == value.dtype and torch.allclose(back["model"][key], value, atol=0.1)


def test_records_without_a_container_are_written_with_torch_save(tmp_path):
    """Manifests written before containers existed hold no container: torch.save writes the state."""
    state = {"w": torch.randn(4, 4), "s": torch.Size([2])}
    torch.save(state, tmp_path / "a.pt")
    checkpoint = formats.read_checkpoint(tmp_path / "a.pt")
    record = formats.CheckpointFile.from_json({k: v for k, v in checkpoint.files[0].to_json().items()
                                               if k != "container"})
    formats.write_file(record, tmp_path / "b.pt", lambda p: materialize(checkpoint.tensors[p]),
                       lambda p: checkpoint.tensors[p])
    assert_identical(load(tmp_path / "a.pt"), load(tmp_path / "b.pt"))


def _zip_with_a_header_inside_another_record(state: dict) -> bytes:
    """A torch.save zip rebuilt so that data/1's local header is the last bytes of data/0 (torch.load reads it)."""
    import struct
    import zlib

    saved = tempfile.SpooledTemporaryFile()
    torch.save(state, saved)
    with zipfile.ZipFile(saved) as original:
        records = {info.filename: original.read(info) for info in original.infolist()}
    top = next(iter(records)).split("/")[0]
    first, second = f"{top}/data/0", f"{top}/data/1"

    def local(name, data):
        return struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                           len(name), 0) + name.encode()

    second_header = local(second, records[second])
    records[first] = bytes(256 - len(second_header)) + second_header
    out, directory = bytearray(), []
    for name, data in records.items():
        if name != second:
            directory.append((name, data, len(out)))
            out += local(name, data) + data
        if name == first:
            directory.append((second, records[second], len(out) - len(second_header)))
            out += records[second]
    start = len(out)
    for name, data, offset in directory:
        out += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, zlib.crc32(data), len(data),
                           len(data), len(name), 0, 0, 0, 0, 0, offset) + name.encode()
    return bytes(out + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(directory), len(directory),
                                   len(out) - start, start, 0))


def test_a_zip_whose_records_overlap_a_crc_comes_back_with_its_state_exact(repo, tmp_path):
    (tmp_path / "a.pt").write_bytes(_zip_with_a_header_inside_another_record(
        {"a": torch.zeros(64), "b": torch.arange(64, dtype=torch.float32)}))
    original = load(tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt")
    repo.checkout_to(cid, tmp_path / "b.pt")
    assert (tmp_path / "b.pt").read_bytes() == (tmp_path / "a.pt").read_bytes() or \
        repo.manifest(cid).rewritten_files() == [""]  # not split: written with torch.save, said so
    assert_identical(original, load(tmp_path / "b.pt"))


def test_checkout_message_says_what_is_exact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    torch.save({"w": torch.randn(3)}, "a.pt")
    torch.save({"w": torch.randn(3)}, "legacy.pt", _use_new_zipfile_serialization=False)
    run("init")
    for name in ("a.pt", "legacy.pt"):
        assert run("commit", name, "-m", name).exit_code == 0
    zipped, legacy = run("checkout", "HEAD~1", "-o", "x.pt"), run("checkout", "HEAD", "-o", "y.pt")
    assert zipped.exit_code == 0 and "byte for byte as committed." in zipped.stdout
    assert "torch.save" not in zipped.stdout
    assert legacy.exit_code == 0 and "note: y.pt written with torch.save" in legacy.stdout
    assert "not byte for byte" in legacy.stdout


@pytest.mark.parametrize("protocol", [2, 4])
def test_fallback_reader_keeps_bytes_too(repo, tmp_path, protocol):
    """Files read by torch.load (here: trusted pickles) are split by matching records to tensors by content."""
    w = torch.randn(8, 8)
    same_size = [torch.randn(16) for _ in range(6)] + [torch.zeros(16) for _ in range(3)]  # equal bytes too
    torch.save({"w": w, "head": w[:2], "p": torch.nn.Parameter(torch.randn(2)), "same": same_size},
               tmp_path / "a.pt", pickle_protocol=protocol)
    assert_round_trip(repo, tmp_path / "a.pt", tmp_path / "out.pt", trust_pickle=True)
    record = formats.read_checkpoint(tmp_path / "a.pt", trust_pickle=True).files[0]
    assert len(record.container["splices"]) == 11  # w, p and the nine same-sized: each record found its tensor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_views_of_one_storage_share_it_on_cuda(repo):
    w = torch.randn(4, 4)
    cid = repo.commit({"w": w, "t": w.t(), "row": w[1]})
    state = repo.checkout(cid, device="cuda")
    assert all(state[k].is_cuda for k in state)
    assert len({state[k].untyped_storage().data_ptr() for k in state}) == 1
    assert torch.equal(state["t"].cpu(), w.t()) and torch.equal(state["row"].cpu(), w[1])


def test_in_memory_states_keep_metadata_size_grad_and_sharing(repo):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    w = torch.randn(6, 2)
    state = {"model": model.state_dict(), "views": [w, w[2:], w.t()], "size": torch.Size([3, 1]),
             "param": torch.nn.Parameter(torch.randn(2), requires_grad=False), "grad": torch.ones(2).requires_grad_()}
    back = repo.checkout(repo.commit(state))
    assert_identical(state, back)
    assert_same_sharing(state, back)


def test_legacy_format_files_come_back_with_the_same_state(repo, tmp_path):
    """A pre-zip torch.save file is rewritten by torch.save (other bytes), with exactly the same state."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    w = torch.randn(6, 2)
    state = {"model": model.state_dict(), "views": [w, w[2:], w.t()], "size": torch.Size([3, 1]),
             "param": torch.nn.Parameter(torch.randn(2))}
    torch.save(state, tmp_path / "a.pt", _use_new_zipfile_serialization=False)
    cid = repo.commit(tmp_path / "a.pt")
    assert repo.manifest(cid).rewritten_files() == [""]
    repo.checkout_to(cid, tmp_path / "out.pt")
    for back in (load(tmp_path / "out.pt"), repo.checkout(cid)):
        assert_identical(load(tmp_path / "a.pt"), back)
        assert_same_sharing(load(tmp_path / "a.pt"), back)


def test_consecutive_checkpoints_have_nearly_the_same_container(repo, tmp_path):
    """Same layout, new values: containers differ only in torch's serialization id (CRCs are kept apart)."""
    containers = []
    for step in range(2):
        torch.save({"model": TinyNet().state_dict(), "step": torch.tensor(step)}, tmp_path / "ckpt.pt")
        containers.append(formats.read_checkpoint(tmp_path / "ckpt.pt").tensors["%container"].data)
    assert containers[0].size == containers[1].size
    assert np.count_nonzero(containers[0] != containers[1]) <= 48  # the 40-digit id and its record's CRC


@pytest.mark.parametrize("lossy", [None, "balanced"])
def test_a_tensor_viewing_its_record_in_another_order_is_stored_once_and_restored_alike(repo, tmp_path, lossy):
    """A transposed or channels_last tensor's record stayed in the container: its bytes stored twice per commit, and
    after a lossy commit the file held the exact values while the in-memory checkout held the lossy ones (auditor)."""
    from ckptstore.repo.manifest import PERMUTED_VERSION

    torch.manual_seed(0)
    state = {"model": {"conv.weight": torch.randn(32, 16, 3, 3).to(memory_format=torch.channels_last),
                       "head.weight": torch.randn(64, 96).t(), "half.weight": torch.randn(48, 80).half().t(),
                       "plain.weight": torch.randn(64, 64)}}
    torch.save(state, tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt", lossy=lossy)
    manifest = repo.manifest(cid)
    (record,) = manifest.files
    assert len(record.container["splices"]) == 4 and manifest.to_record()["version"] == PERMUTED_VERSION
    tensor_bytes = sum(v.numel() * v.element_size() for v in state["model"].values())
    assert record.container["size"] - tensor_bytes < 4096  # the container holds no record's bytes
    repo.checkout_to(cid, tmp_path / "out.pt")
    from_file, in_memory = load(tmp_path / "out.pt")["model"], repo.checkout(cid)["model"]
    for key, value in state["model"].items():
        assert from_file[key].stride() == value.stride() and torch.equal(from_file[key], in_memory[key])
    if lossy is None:
        assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "a.pt").read_bytes()


def test_a_splices_order_that_is_no_order_of_its_tensors_dimensions_is_damage():
    """A manifest is its own bytes' hash, so a remote can forge one: an order of strings or a repeated dimension was
    a TypeError or a wrong file (own read of 1af0bf5)."""
    from ckptstore.errors import CkptError
    from ckptstore.formats.torchcontainer import _record_bytes
    from ckptstore.state import raw_from_torch

    raw = raw_from_torch(torch.arange(6, dtype=torch.float32).reshape(2, 3), "w")
    assert _record_bytes(raw, [[1, 0]], "w").view(np.float32).tolist() == [0, 3, 1, 4, 2, 5]
    for forged in ([["a", "b"]], [[0, 0]], [[0, 1, 2]], [{"0": 1}], [[1, 0], [0, 1]], [[True, False]]):
        with pytest.raises(CkptError, match="manifest is damaged"):
            _record_bytes(raw, forged, "w")


def test_a_view_of_the_first_half_of_a_record_comes_back_byte_for_byte(repo, tmp_path):
    """A tensor viewing only the start of its storage record must not stand for the whole record: the record's
    second half came back as another same-sized record's bytes (mutation audit)."""
    base, other = torch.zeros(64), torch.zeros(64)
    base[40] = 99.0  # in the half of record 0 no tensor of the state views
    other[30] = 1.0  # record 1: the same size, first and last bytes as record 0, another middle
    torch.save({"a": base[:32], "t1": other}, tmp_path / "a.pt")
    assert_round_trip(repo, tmp_path / "a.pt", tmp_path / "out.pt")


@pytest.mark.parametrize("lossy", [None, "balanced"])
def test_a_tensor_viewing_part_of_its_record_is_stored_once_and_restored_alike(repo, tmp_path, lossy):
    """A trimmed vocab's record stayed whole in the container beside the tensor's own entry: a lossless commit stored
    more than the file (auditor 359: 21.6 MiB for a 12.9 MB file). Only the rows no tensor holds stay there now."""
    gen = torch.Generator().manual_seed(0)
    state = {"wte.weight": torch.randn(1032, 64, generator=gen)[:1000],
             "off.weight": torch.randn(400, 30, generator=gen)[100:300],
             "plain.weight": torch.randn(200, 300, generator=gen)}
    torch.save(state, tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt", lossy=lossy)
    (record,) = repo.manifest(cid).files
    assert len(record.container["splices"]) == 3
    gaps = (32 * 64 + 200 * 30) * 4  # the padding rows, and the rows before and after the offset slice
    assert record.container["size"] - sum(v.numel() * v.element_size() for v in state.values()) - gaps < 4096
    assert repo.show(cid)["stored_bytes"] < (tmp_path / "a.pt").stat().st_size
    repo.checkout_to(cid, tmp_path / "out.pt")
    with zipfile.ZipFile(tmp_path / "out.pt") as written:
        assert written.testzip() is None  # every record's CRC holds
    from_file, in_memory = load(tmp_path / "out.pt"), repo.checkout(cid)
    for key, value in state.items():
        assert torch.equal(from_file[key], in_memory[key])
        assert torch.equal(from_file[key], value) == (lossy is None or key != "plain.weight")
    if lossy is None:
        assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "a.pt").read_bytes()
