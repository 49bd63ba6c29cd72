import errno
import hashlib
import io
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import Repository, formats
from ckptstore.errors import CheckpointFormatError, UnsupportedStateError
from ckptstore.formats import torchfile, torchzip
from ckptstore.state import TORCH_ITEMSIZE, RawTensor, flatten
from tests.conftest import Trainer, assert_same, ckpt_env, ckpt_here

DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
          torch.bool, torch.complex64, torch.complex128]


def both(path, prefix=""):
    """(torch path, torch-free path) for one file; the torch-free one must not fall back."""
    reasons = []
    fast = torchzip.read(path, prefix, on_fallback=reasons.append)
    assert fast is not None, reasons
    return flatten(torchfile.load(path), prefix), fast


def assert_same_flat(a, b):
    assert a.skeleton == b.skeleton or repr(a.skeleton) == repr(b.skeleton)  # repr: nan inside npscalars
    assert list(a.tensors) == list(b.tensors)
    for path, x in a.tensors.items():
        y = b.tensors[path]
        assert isinstance(y, RawTensor) and (x.dtype, x.shape) == (y.dtype, y.shape), path
        assert x.data.dtype == y.data.dtype == np.uint8 and x.data.tobytes() == y.data.tobytes(), path
        assert x.data.flags.writeable == y.data.flags.writeable, path


def save_and_compare(tmp_path, obj, name="a.pt"):
    torch.save(obj, tmp_path / name)
    try:
        torchfile.load(tmp_path / name)
    except CheckpointFormatError as exc:  # torch refuses it (b"" pickles as builtins.bytes): so must we
        with pytest.raises(CheckpointFormatError) as info:
            torchzip.read(tmp_path / name, "pre/fix")
        assert str(info.value) == str(exc)
        return None
    a, b = both(tmp_path / name, "pre/fix")
    assert_same_flat(a, b)
    return b


def random_tensor(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    size = 5**3 * 16  # the largest shape, (5, 5, 5), of the widest dtype, complex128
    raw = torch.from_numpy(np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8).copy())
    numel = int(np.prod(shape)) if shape else 1
    base = raw[: numel * dtype.itemsize].view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transpose", "slice", "expand", "param"]))
    if view == "transpose" and base.dim() >= 2:
        return base.transpose(0, -1)
    if view == "slice" and base.dim() >= 1 and base.shape[0] > 1:
        return base[1:][:: draw(st.integers(1, 2))]
    if view == "expand" and base.dim() >= 1 and base.shape[-1] == 1:
        return base.expand(*base.shape[:-1], 3)
    if view == "param":
        return torch.nn.Parameter(base, requires_grad=base.is_floating_point() and draw(st.booleans())
                                  and dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64))
    return base


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8), st.binary(max_size=8),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([torch.Size([2, 3]), torch.Size([]), torch.float32, torch.bfloat16, torch.uint16,
                     torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda:0"), torch.device("meta"),
                     np.dtype("<f4"), np.dtype(">i8"), np.dtype("?")]),
    st.builds(lambda d, n: np.arange(n).astype(d),
              st.sampled_from(["<f4", ">f8", "<i2", "|u1", "?", "<c8", "<u8"]), st.integers(0, 6)),
    st.composite(lambda draw: random_tensor(draw))(),
)
states = st.recursive(leaves, lambda children: st.one_of(
    st.lists(children, max_size=4),
    st.lists(children, max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=5), children, max_size=4),
    st.dictionaries(st.text(max_size=5), children, max_size=4).map(OrderedDict),
    st.sets(st.integers(0, 9) | st.text(max_size=2), max_size=3).filter(
        lambda s: len({type(x) for x in s}) <= 1),
), max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(state=states, share=st.booleans())
def test_hypothesis_states_flatten_like_torch(tmp_path, state, share):
    obj = {"state": state}
    if share:  # the same tensors again, and views of them: aliasing must match
        tensors = [v for v in _leaves(state) if isinstance(v, torch.Tensor)]
        obj["again"] = tensors
        obj["views"] = [t.reshape(-1)[1:] for t in tensors if t.is_contiguous() and t.numel() > 1]
    save_and_compare(tmp_path, obj)


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


@pytest.mark.parametrize("dtype", DTYPES + [torch.complex32, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz])
def test_every_storage_dtype_views_and_shapes(tmp_path, dtype):
    base = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 60 * 16, dtype=np.uint8)).view(dtype)[:60]
    obj = {"full": base.reshape(3, 4, 5), "t": base.reshape(3, 4, 5).permute(2, 0, 1), "s": base[7:19:3],
           "zero_d": base[5], "empty": base[:0].reshape(0, 4), "same": base.reshape(3, 4, 5), "tail": base[40:]}
    flat = save_and_compare(tmp_path, obj)
    # same storage, offset, shape, stride: one entry; a second object on it (torch.load gives two), numbered
    assert flat.skeleton[1][5][1] == ["tensor", "pre/fix/full", {"object": 1}]
    assert flat.tensors["pre/fix/zero_d"].shape == () and flat.tensors["pre/fix/empty"].data.size == 0
    assert all(TORCH_ITEMSIZE[r.dtype] * int(np.prod(r.shape)) == r.nbytes for r in flat.tensors.values())


def test_contiguous_tensors_are_slices_of_the_file(tmp_path):
    torch.save({"w": torch.arange(1000.0), "t": torch.arange(1000.0).reshape(10, 100).T}, tmp_path / "a.pt")
    flat = torchzip.read(tmp_path / "a.pt")
    assert flat.tensors["w"].data.base is not None and not flat.tensors["w"].data.flags.owndata
    assert flat.tensors["t"].data.flags.owndata or flat.tensors["t"].data.base.flags.owndata  # a copy
    assert flat.tensors["w"].data.flags.writeable
    before = (tmp_path / "a.pt").read_bytes()
    flat.tensors["w"].data[:4] = 0  # a private map: the file is never written
    assert (tmp_path / "a.pt").read_bytes() == before


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_real_training_state_flattens_like_torch(tmp_path, kind):
    trainer = Trainer(optimizer_kind=kind)
    trainer.train(3)
    for name, part in [("model.pt", trainer.model.state_dict()), ("optimizer.pt", trainer.optimizer.state_dict()),
                       ("scheduler.pt", trainer.scheduler.state_dict()), ("all.pt", trainer.state()),
                       ("params.pt", {"params": list(trainer.model.parameters())})]:
        save_and_compare(tmp_path, part, name)


def test_trainer_rng_state_flattens_like_torch(tmp_path):
    random.seed(3)
    np.random.seed(3)
    np.random.standard_normal()  # has_gauss=1 and a cached gaussian in the numpy state
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    flat = save_and_compare(tmp_path, rng, "rng_state.pth")
    assert flat.tensors["pre/fix/numpy/1"].dtype == "numpy:<u4" and flat.tensors["pre/fix/cpu"].dtype == "torch.uint8"


def test_parameter_with_hf_flag_is_read_and_other_state_left_to_torch(tmp_path):
    param = torch.nn.Parameter(torch.randn(3))
    param._is_hf_initialized = True
    save_and_compare(tmp_path, {"p": param})
    param.custom = 3
    torch.save({"p": param}, tmp_path / "b.pt")
    assert torchzip.read(tmp_path / "b.pt") is None


@pytest.mark.parametrize("second", ["same name", "other case"])
def test_record_names_that_collide_as_torch_finds_them_are_read_by_torch(tmp_path, second):
    import io

    from ckptstore.state import materialize

    saved = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, saved)
    with zipfile.ZipFile(saved) as source, zipfile.ZipFile(tmp_path / "m.pt", "w") as out:
        for info in source.infolist():
            out.writestr(info, source.read(info))
            if info.filename.endswith("/data/0"):  # torch ignores case: which record it takes is its own rule
                name = info.filename if second == "same name" else info.filename.replace("/data/0", "/DATA/0")
                out.writestr(name, torch.full((4,), 666.0).numpy().tobytes())
    assert torchzip.read(tmp_path / "m.pt") is None
    tensors = formats.read_checkpoint(tmp_path / "m.pt").tensors
    assert torch.equal(materialize(next(iter(tensors.values()))), torch.load(tmp_path / "m.pt", weights_only=True)["w"])


@pytest.mark.parametrize("change", [8, -8])
def test_a_storage_record_of_another_size_than_its_pickle_asks_is_refused_as_torch_load_refuses_it(tmp_path, change):
    import io

    saved = io.BytesIO()
    torch.save({"a": torch.arange(4.0), "b": torch.ones(2)}, saved)
    with zipfile.ZipFile(saved) as source, zipfile.ZipFile(tmp_path / "m.pt", "w") as out:
        for info in source.infolist():
            data = source.read(info)
            out.writestr(info, data + bytes(change) if change > 0 and info.filename.endswith("/data/0")
                         else data[:change] if info.filename.endswith("/data/0") else data)
    with pytest.raises(Exception, match="record size"):
        torch.load(tmp_path / "m.pt", weights_only=True)
    with pytest.raises(CheckpointFormatError, match="record data/0 holds .* bytes, its pickle asks for 16"):
        formats.read_checkpoint(tmp_path / "m.pt")  # torch.load(mmap=True), once the fallback, read past it


def test_formats_reads_without_torch_in_a_fresh_process(tmp_path):
    trainer = Trainer()
    trainer.train(2)
    torch.save(trainer.state(), tmp_path / "a.pt")
    expected = formats.read_checkpoint(tmp_path / "a.pt")
    script = textwrap.dedent(f"""
        import hashlib, json, sys
        from ckptstore import formats
        cp = formats.read_checkpoint({str(tmp_path / 'a.pt')!r})
        digest = {{p: hashlib.sha256(r.data.tobytes()).hexdigest() for p, r in cp.tensors.items()}}
        print(json.dumps({{"torch": "torch" in sys.modules, "skeleton": cp.files[0].skeleton, "digest": digest}}))
    """)
    env = ckpt_env()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout)
    assert result["torch"] is False
    assert result["skeleton"] == json.loads(json.dumps(expected.files[0].skeleton))
    assert result["digest"] == {p: hashlib.sha256(r.data.tobytes()).hexdigest() for p, r in expected.tensors.items()}


class Custom:
    def __init__(self):
        self.x = 1


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _torch_error(path):
    with pytest.raises(CheckpointFormatError) as info:
        torchfile.load(path)
    return str(info.value)


@pytest.mark.parametrize("payload", [Custom(), Evil(), {"args": Custom()}])
def test_disallowed_globals_refused_like_torch_without_running_anything(tmp_path, monkeypatch, payload):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2), "x": payload}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointFormatError) as info:
        torchzip.read(tmp_path / "bad.pt")
    assert str(info.value) == _torch_error(tmp_path / "bad.pt")
    assert "--trust-pickle" in str(info.value) and not (tmp_path / "pwned").exists()


def _replace_pickle(src, dest, data):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, data if info.filename.endswith("/data.pkl") else zin.read(info))


def test_crafted_os_system_pickle_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    crafted = b"\x80\x02cposix\nsystem\nq\x00X\x09\x00\x00\x00touch pwnq\x01\x85q\x02Rq\x03."
    _replace_pickle(tmp_path / "a.pt", tmp_path / "evil.pt", crafted)
    with pytest.raises(CheckpointFormatError) as info:
        torchzip.read(tmp_path / "evil.pt")
    assert str(info.value) == _torch_error(tmp_path / "evil.pt")
    assert not (tmp_path / "pwn").exists()


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_files_saved_with_pickle_protocol_3_4_or_5_are_read_safely(tmp_path, monkeypatch, protocol):
    """torch.load(weights_only=True) refuses them (bytes in protocol 3, "Unsupported operand 149" after), and the
    refusal said the file held objects that are not plain training state, pointing at --trust-pickle (auditor)."""
    monkeypatch.chdir(tmp_path)
    trainer = Trainer()
    trainer.train(2)
    state = {**trainer.state(), "name": "ü" * 300, "ordered": OrderedDict(a=(1, 2.5, None)), "raw": b"\x00\xff",
             "seen": {1, 2.5, "x", None}}  # a set is ADDITEMS from protocol 4 on: it was refused there (review)
    if protocol == 5:  # numpy pickles its arrays by another function (_frombuffer) at 5: refused, as torch does
        state.pop("rng")
    torch.save(state, tmp_path / "p.pt", pickle_protocol=protocol)
    if protocol > 3:
        with pytest.warns(UserWarning, match=f"Detected pickle protocol {protocol}"):  # torch's safe loader cannot
            assert "uses opcode 149, which torch.load(weights_only=True) does not read" in _torch_error(
                tmp_path / "p.pt")
    assert torchzip.read(tmp_path / "p.pt", on_fallback=pytest.fail) is not None  # read here, not left to torch
    with Repository.init(tmp_path / "repo") as repo:
        cid = repo.commit(tmp_path / "p.pt")
        assert_same(repo.checkout(cid), torch.load(tmp_path / "p.pt", weights_only=False))
        assert repo.checkout_to(cid, tmp_path / "back.pt").read_bytes() == (tmp_path / "p.pt").read_bytes()
    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pt", pickle_protocol=protocol)
    with pytest.raises(CheckpointFormatError, match=r"posix\.system is not among the classes"):
        torchzip.read(tmp_path / "evil.pt")  # its global comes by STACK_GLOBAL, through the same allow-list
    assert not (tmp_path / "pwned").exists()
    torch.save({"w": torch.ones(2), "f": frozenset({1})}, tmp_path / "f.pt", pickle_protocol=protocol)
    with pytest.raises(CheckpointFormatError, match=r"frozenset is not among the classes"):  # as at protocol 2
        torchzip.read(tmp_path / "f.pt")


def test_training_args_bin_in_a_folder_stays_a_blob(tmp_path):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    torch.save({"w": torch.ones(3)}, folder / "optimizer.pt")
    torch.save(Custom(), folder / "training_args.bin")
    checkpoint = formats.read_checkpoint(folder)
    kinds = {f.name: (f.format, f.opaque_reason) for f in checkpoint.files}
    assert kinds["training_args.bin"] == ("blob", "pickled objects, kept as bytes")
    assert kinds["optimizer.pt"] == ("torch", "")


class _ObjectScalar:
    """Pickles as numpy's scalar(dtype('O'), [...]): how an object-dtype scalar would come into a file."""

    def __reduce__(self):
        return np.float64(0).__reduce__()[0], (np.dtype("O"), [1])  # numpy's scalar, whichever module holds it


def test_numpy_scalars_of_a_checked_out_state_are_read_back_and_object_ones_refused(tmp_path):
    """A state's np.float64 commits and `ckpt checkout -o` writes it, but committing that file was refused
    ("numpy._core.multiarray.scalar is not among the classes", auditor helper 384). Both readers read numeric ones."""
    state = {"w": torch.ones(2), "best_acc": np.float64(0.91), "epoch": np.int64(3), "half": np.float16(1.5),
             "flag": np.bool_(True), "z": np.complex64(1 + 2j), "nan": np.float32("nan")}
    with Repository.init(tmp_path / "repo") as repo:
        first = repo.commit(state)
        assert ckpt_here(repo.root, "checkout", first, "-o", tmp_path / "c.pt").returncode == 0
        save_and_compare(tmp_path, torch.load(tmp_path / "c.pt", weights_only=False), "again.pt")  # both readers
        again = ckpt_here(repo.root, "commit", tmp_path / "c.pt")
        assert again.returncode == 0, again.stdout + again.stderr
        back = repo.checkout("HEAD")
        assert repo.log()[0].id != first
    assert list(back) == list(state) and torch.equal(back["w"], state["w"])
    bits = lambda values: {k: (type(v), v.dtype, v.tobytes()) for k, v in values.items() if k != "w"}  # NaN too
    assert bits(back) == bits(state)
    torch.save({"o": _ObjectScalar()}, tmp_path / "o.pt")
    with pytest.raises(CheckpointFormatError, match="numpy.dtypes.ObjectDType is not among the classes"):
        formats.read_checkpoint(tmp_path / "o.pt")
    torch.save({"s": np.str_("a")}, tmp_path / "s.pt")  # numpy's StrDType is allowed for arrays: not as a scalar
    with pytest.raises(CheckpointFormatError, match="only numeric and bool numpy scalars are read"):
        formats.read_checkpoint(tmp_path / "s.pt")


def test_a_numpy_object_array_is_refused_naming_the_class_torch_refused(tmp_path):
    """torch says "but got <class 'numpy.dtypes.ObjectDType'>" in its middle lines: the refusal quoted its last one,
    a link to torch's documentation, and named nothing."""
    torch.save({"o": np.array([None, 1], dtype=object)}, tmp_path / "a.pt")
    assert torchzip.read(tmp_path / "a.pt") is None  # not this reader's: torch's decides
    with pytest.raises(CheckpointFormatError, match=r"numpy\.dtypes\.ObjectDType is not among the classes"):
        formats.read_checkpoint(tmp_path / "a.pt")
    other = "WeightsUnpickler error: Only persistent_load of storage is allowed, but got <class 'str'>"
    assert torchfile.refusal_reason(other) == other  # no class refused there: torch's line, not "str is not among"


@pytest.mark.parametrize("make", ["legacy", "bigendian", "sparse", "user_global"])  # protocols 3-5: read here
def test_cases_it_does_not_model_fall_back_to_torch(tmp_path, monkeypatch, make):
    path = tmp_path / "a.pt"
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    if make == "legacy":
        torch.save(state, path, _use_new_zipfile_serialization=False)
    elif make == "user_global":  # a global this process added to torch's allow-list: torch decides
        torch.save({"x": Custom()}, path)
        monkeypatch.setattr(torchzip, "_added_to_torch", lambda name: name.endswith(".Custom"))
    elif make == "sparse":
        torch.save({"s": torch.eye(3).to_sparse()}, path)
    else:
        torch.save(state, tmp_path / "src.pt")
        with zipfile.ZipFile(tmp_path / "src.pt") as zin, zipfile.ZipFile(path, "w") as zout:
            for info in zin.infolist():
                data = zin.read(info)
                if make == "bigendian" and info.filename.endswith("/byteorder"):
                    data = b"big"
                zout.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)
    reasons = []
    assert torchzip.read(path, on_fallback=reasons.append) is None and reasons
    # and read_checkpoint gives exactly what torch's path gives
    try:
        expected = flatten(torchfile.load(path))
    except (CheckpointFormatError, UnsupportedStateError) as exc:
        with pytest.raises(type(exc)) as info:
            formats.read_checkpoint(path)
        assert str(info.value) == str(exc)
    else:
        checkpoint = formats.read_checkpoint(path)
        assert checkpoint.files[0].skeleton == expected.skeleton


def test_trust_pickle_goes_to_torch(tmp_path):
    torch.save({"x": Custom()}, tmp_path / "a.pt")
    with pytest.raises(UnsupportedStateError, match="Custom"):
        formats.read_checkpoint(tmp_path / "a.pt", trust_pickle=True)


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_or_corrupted_zip_is_a_format_error(tmp_path, cut):
    torch.save({"w": torch.randn(1000)}, tmp_path / "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: int(len(data) * cut)])
    assert torchzip.read(tmp_path / "t.pt") is None
    with pytest.raises(CheckpointFormatError, match="truncated"):
        formats.read_checkpoint(tmp_path / "t.pt")
    corrupted = bytearray(data)
    start = data.index(b"data.pkl") + 40
    corrupted[start : start + 20] = b"\xff" * 20
    (tmp_path / "c.pt").write_bytes(bytes(corrupted))
    assert torchzip.read(tmp_path / "c.pt") is None
    with pytest.raises(CheckpointFormatError):
        formats.read_checkpoint(tmp_path / "c.pt")


def _raising(exc: BaseException):
    """A stand-in reader that fails with `exc`."""
    def read(*args, **kwargs):
        raise exc
    return read


EMFILE = OSError(errno.EMFILE, "Too many open files", "torch/utils/serialization/__init__.py")
NOT_MODELLED = NotImplementedError("a case the native reader leaves to torch")


@pytest.mark.parametrize(("native", "by_torch", "trust", "said"), [
    (EMFILE, None, False, "too many open files"),
    (NOT_MODELLED, EMFILE, False, "too many open files"),
    (NOT_MODELLED, EMFILE, True, "too many open files"),
    (NOT_MODELLED, MemoryError(), False, "out of memory"),
])
def test_a_limit_met_while_reading_is_said_not_called_damage(tmp_path, monkeypatch, native, by_torch, trust, said):
    """Out of file descriptors (RLIMIT_NOFILE 9), the native reader's EMFILE fell back to torch, whose import failed
    with EMFILE too, and `ckpt commit` said the good file was "truncated or corrupted" (auditor 383): the limit now."""
    torch.save({"w": torch.randn(1000)}, tmp_path / "big.pt")
    ckpt_here(tmp_path, "init")
    monkeypatch.setattr(torchzip, "_load", _raising(native))
    if by_torch is not None:
        monkeypatch.setattr(torch, "load", _raising(by_torch))
    result = ckpt_here(tmp_path, "commit", "big.pt", *(["--trust-pickle"] if trust else []))
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {said}") and "corrupted" not in result.stderr, result.stderr
    if said == "too many open files":
        assert "`ulimit -n" in result.stderr


def test_tensor_past_its_storage_falls_back(tmp_path):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    bigger = data.replace(b"K\x04\x85", b"K\x09\x85", 1)  # size (4,) -> (9,) over a 4-element storage
    assert bigger != data
    _replace_pickle(tmp_path / "a.pt", tmp_path / "b.pt", bigger)
    assert torchzip.read(tmp_path / "b.pt") is None
    with pytest.raises(CheckpointFormatError):
        formats.read_checkpoint(tmp_path / "b.pt")


def test_sets_bytes_and_complex_like_torch(tmp_path):
    flat = save_and_compare(tmp_path, {"s": {3, 1, 2}, "b": b"\x00\xff", "e": set(), "n": [None, True, 2**80]})
    assert flat.skeleton[1][0][1] == ["set", [1, 2, 3]]
    torch.save({"c": 1 + 2j}, tmp_path / "c.pt")  # read by both as torch.load(weights_only=True) reads it
    fast, slow = torchzip.read(tmp_path / "c.pt"), flatten(torchfile.load(tmp_path / "c.pt"))
    assert fast.skeleton == slow.skeleton == ["dict", [["c", ["complex", 1.0, 2.0]]]]


_MILLION_DEEP = pickle.NONE + pickle.TUPLE1 * 1_000_000  # 1 MB of pickle, 1 KB deflated
_DEEP_PICKLES = {
    "dict key": pickle.EMPTY_DICT + _MILLION_DEEP + pickle.BININT1 + b"\x01" + pickle.SETITEM,
    "set item": pickle.GLOBAL + b"builtins\nset\n" + pickle.EMPTY_LIST + _MILLION_DEEP + pickle.APPEND
    + pickle.TUPLE1 + pickle.REDUCE,
}


@pytest.mark.parametrize("what", sorted(_DEEP_PICKLES))
@pytest.mark.parametrize("protocol, c_walk", [(2, True), (2, False), (6, True)])  # 6: the Python reader leaves it
def test_tuples_a_million_deep_are_refused_not_a_crash(tmp_path, what, protocol, c_walk):
    """{((((None,),),)…): 1} in a 1.5 KB file segfaulted `ckpt commit` (auditor helper 299): CPython 3.11 hashes a
    tuple recursively with no guard, in the C unpickler, the Python one and torch.load's. Now refused, naming why."""
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    data = pickle.PROTO + bytes([protocol]) + _DEEP_PICKLES[what] + pickle.STOP
    _replace_pickle(tmp_path / "a.pt", tmp_path / "deep.pt", data)
    said = _read_in_a_subprocess(tmp_path / "deep.pt", c_walk=c_walk)
    assert said.startswith(f"CheckpointFormatError {tmp_path / 'deep.pt'} is refused: its pickle nests tuples "
                           "more than 200 deep"), said


@pytest.mark.parametrize("stop", [pickle.POP, pickle.DUP + pickle.POP])
def test_a_pickle_naming_numpy_past_an_opcode_the_walk_stops_at_is_refused_not_a_crash(tmp_path, stop):
    """The walk stopped at DUP or POP ("other"), the Python reader fell back to torch.load's path, and there the
    numpy dry run (dtypestate), which runs every opcode, hashed the million-deep key: a segfault (fixer 312).
    Now the dry run reads only what the walk followed."""
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    data = (pickle.PROTO + b"\x02" + pickle.SHORT_BINSTRING + b"\x05numpy" + stop + pickle.EMPTY_DICT + _MILLION_DEEP
            + pickle.BININT1 + b"\x01" + pickle.SETITEM + pickle.STOP)
    _replace_pickle(tmp_path / "a.pt", tmp_path / "deep.pt", data)
    said = _read_in_a_subprocess(tmp_path / "deep.pt")
    assert said.startswith("PickledObjectsError") and "does not read" in said, said  # a clean refusal, no crash


def _read_in_a_subprocess(path, c_walk=True, timeout=300):
    """read_checkpoint(path) in a child: what it printed (the error's type and text), or why it died.

    Without `c_walk`, as built without a C compiler: the Python unpickler checks what it hashes.
    """
    script = textwrap.dedent(f"""
        from ckptstore import formats
        from ckptstore.errors import CkptError
        from ckptstore.formats import torchzip
        if not {c_walk}:
            torchzip._pickscan = None
        try:
            formats.read_checkpoint({str(path)!r})
        except CkptError as exc:
            print(type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ckpt_env(),
                         timeout=timeout)
    assert out.returncode == 0, f"died with {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout


def _legacy_file(path, state=pickle.EMPTY_DICT, keys=pickle.EMPTY_LIST):
    """A legacy (pre-zip) torch.save stream: magic number, protocol version, system info, state, storage keys."""
    system = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    head = b"".join(pickle.dumps(value, protocol=2) for value in (0x1950A86A20F9469CFC6C, 1001, system))
    path.write_bytes(head + b"".join(pickle.PROTO + b"\x02" + body + pickle.STOP for body in (state, keys)))


@pytest.mark.parametrize("where", ["state", "storage keys"])
def test_a_legacy_file_with_tuples_a_million_deep_is_refused_not_a_crash(tmp_path, where):
    """A legacy torch.save file went straight to torch.load (and the numpy dtype dry run before it): the
    million-deep tuple key the zip reader refuses segfaulted it there (auditor helper 299). Its pickles are now
    walked first, and refused with the zip reader's error."""
    deep = pickle.NONE + pickle.TUPLE1 * 1_000_000
    if where == "state":
        _legacy_file(tmp_path / "deep.pt", state=pickle.EMPTY_DICT + deep + pickle.BININT1 + b"\x01" + pickle.SETITEM)
    else:
        _legacy_file(tmp_path / "deep.pt", keys=pickle.EMPTY_LIST + deep + pickle.APPEND)
    assert _read_in_a_subprocess(tmp_path / "deep.pt").startswith(
        f"CheckpointFormatError {tmp_path / 'deep.pt'} is refused: its pickle nests tuples more than 200 deep")
    _legacy_file(tmp_path / "ok.pt", state=pickle.EMPTY_DICT + pickle.NONE + pickle.TUPLE1 * 150 + pickle.BININT1
                 + b"\x01" + pickle.SETITEM)
    assert formats.read_checkpoint(tmp_path / "ok.pt").files[0].skeleton  # 150 deep: read as before
    state = {"w": torch.arange(4.0), "n": np.arange(3), ((1, (2,)), "k"): torch.ones(2), "s": {"a", 1}}
    torch.save(state, tmp_path / "real.pt", _use_new_zipfile_serialization=False)
    assert_same(torchfile.load(tmp_path / "real.pt"), state)


_SHARED_60 = pickle.NONE + pickle.BINPUT + b"\x00" + (pickle.BINGET + b"\x00" + pickle.TUPLE2 + pickle.BINPUT
                                                  + b"\x00") * 60  # t = (t, t), 60 times: the one on the stack twice
_SHARED_KEY = pickle.EMPTY_DICT + _SHARED_60 + pickle.BININT1 + b"\x01" + pickle.SETITEM


@pytest.mark.parametrize("make", ["zip", "zip without the C walk", "zip protocol 4", "legacy"])
def test_a_tuple_key_whose_hash_visits_2_to_the_61_items_is_refused_not_a_hang(tmp_path, make):
    """A 250-byte data.pkl building t = (t, t) 60 times through the memo, then {t: 1}: only 60 deep, so the walk
    called it plain, and hashing it (the unpickler's dict, torch.load's too) visits 2**61 items: read_checkpoint
    never finished (auditor helper 299). Now refused, naming why, by the walk and by the Python unpickler."""
    path = tmp_path / "shared.pt"
    if make == "legacy":
        _legacy_file(path, state=_SHARED_KEY)
    else:
        torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
        _replace_pickle(tmp_path / "a.pt", path, pickle.PROTO + (b"\x04" if "4" in make else b"\x02") + _SHARED_KEY
                        + pickle.STOP)
    said = _read_in_a_subprocess(path, c_walk="without" not in make, timeout=60)
    assert said.startswith(f"CheckpointFormatError {path} is refused: its pickle builds a tuple whose hash "
                           "would visit more than 10,000,000 items"), said


def _build_on_shared_globals(path):
    """A pickle that BUILDs new attributes onto the storage type and dtype the allow-list hands out."""
    def text(value):
        raw = value.encode()
        return pickle.BINUNICODE + len(raw).to_bytes(4, "little") + raw

    def poison(global_line, attribute):
        return (pickle.GLOBAL + global_line + pickle.NONE + pickle.EMPTY_DICT + text(attribute)
                + text("torch.int32") + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.SETITEM)

    body = (pickle.PROTO + b"\x02" + pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE
            + pickle.REDUCE + pickle.EMPTY_DICT + text("a") + poison(b"torch\nFloatStorage\n", "dtype")
            + text("b") + poison(b"torch\nfloat32\n", "name") + pickle.BUILD + pickle.STOP)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", body)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/.data/version", "3\n")


def test_a_file_cannot_change_how_later_files_are_read(tmp_path):
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, tmp_path / "good.pt")
    before = torchzip.read(tmp_path / "good.pt")
    _build_on_shared_globals(tmp_path / "evil.pt")
    reasons = []
    assert torchzip.read(tmp_path / "evil.pt", on_fallback=reasons.append) is None
    assert reasons and "BUILD on" in reasons[0]
    with pytest.raises(CheckpointFormatError):
        formats.read_checkpoint(tmp_path / "evil.pt")
    after = torchzip.read(tmp_path / "good.pt")
    assert after.skeleton == before.skeleton
    assert {k: (v.dtype, v.data.tobytes()) for k, v in after.tensors.items()} == {
        k: (v.dtype, v.data.tobytes()) for k, v in before.tensors.items()}


@pytest.mark.parametrize("body", [
    pickle.PROTO + b"\x02" + pickle.MARK + pickle.DICT + pickle.STOP,  # protocol-0 DICT: not among torch's opcodes
    pickle.PROTO + b"\x06" + pickle.EMPTY_DICT + pickle.STOP,  # a protocol this Python does not know
    pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.DUP + pickle.POP + pickle.STOP,
])
def test_opcodes_and_protocols_torch_does_not_run_go_to_torch(tmp_path, body):
    with zipfile.ZipFile(tmp_path / "odd.pt", "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", body)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/.data/version", "3\n")
    reasons = []
    assert torchzip.read(tmp_path / "odd.pt", on_fallback=reasons.append) is None and reasons


def test_an_expanded_view_is_refused_before_it_is_copied(tmp_path):
    # 1.5 KB on disk, 37 GiB as a dense tensor: refused by the view bound, never allocated
    path = tmp_path / "expand.pt"
    torch.save({"e": torch.zeros(1).expand(10**5, 10**5)}, path)
    with pytest.raises(UnsupportedStateError, match="views one 4-byte storage"):
        torchzip.read(path)


def test_two_parameters_on_the_same_bytes_come_back_as_two_with_their_own_flags(tmp_path):
    """They came back as one Parameter with the first one's requires_grad, from a file and from memory alike; one
    Parameter saved twice is still one object (fuzz auditor, high)."""
    from ckptstore import Repository

    x = torch.randn(3)
    p, q = torch.nn.Parameter(x), torch.nn.Parameter(x, requires_grad=False)
    g, h = x.detach().requires_grad_(True), x.detach().requires_grad_(True)  # two leaves needing grad, one storage
    state = {"p": p, "q": q, "p again": p, "g": g, "h": h}
    torch.save(state, tmp_path / "pq.pt")
    with Repository.init(tmp_path / "repo") as repo:
        for committed in (tmp_path / "pq.pt", state):
            back = repo.checkout(repo.commit(committed, allow_empty=True))
            assert [back[k].requires_grad for k in ("p", "q", "g", "h")] == [True, False, True, True]
            assert back["p"] is back["p again"] and back["p"] is not back["q"] and back["g"] is not back["h"]
            assert back["q"].data_ptr() == back["p"].data_ptr() and torch.equal(back["q"], x)


def _with_dtype_state(path, edit, legacy=False) -> None:
    """torch.save of a float32 numpy array whose dtype's pickled BUILD state `edit` changed."""
    state = b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"  # (..., None, None, None, -1, -1, 0) as torch pickles it
    buffer = io.BytesIO()
    torch.save({"np": np.arange(6, dtype=np.float32)}, buffer, _use_new_zipfile_serialization=not legacy)
    if legacy:
        path.write_bytes(buffer.getvalue().replace(state, edit(state)))
        return
    archive = zipfile.ZipFile(buffer)
    records = [(info.filename.split("/", 1)[1], archive.read(info)) for info in archive.infolist()]
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, data in records:
        data = data.replace(state, edit(state)) if name == "data.pkl" else data
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("edit", [lambda s: s.replace(b"NNN", b"N\x80N"),  # a tuple cut short: numpy crashed
                                  lambda s: s.replace(b"K\x00t", b"K\x01t")])  # other flags: numpy's "Internal error"
def test_a_numpy_dtype_state_numpy_would_crash_on_is_refused(tmp_path, legacy, edit):
    """A 1.5 KB torch.save file killed `ckpt commit` with SIGSEGV: numpy's dtype.__setstate__ trusts its tuple, and
    both torch's loader and ours handed it the file's (fuzz auditor, high)."""
    _with_dtype_state(tmp_path / "bad.pt", edit, legacy)
    assert subprocess.run([sys.executable, "-m", "ckptstore", "init"], cwd=tmp_path, env=ckpt_env(),
                          timeout=120).returncode == 0
    out = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "bad.pt"], cwd=tmp_path, env=ckpt_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "is none numpy writes for" in out.stderr, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and "Internal error" not in out.stderr
    _with_dtype_state(tmp_path / "good.pt", lambda s: s, legacy)  # the file untouched: committed, as torch reads it
    assert subprocess.run([sys.executable, "-m", "ckptstore", "commit", "good.pt"], cwd=tmp_path, env=ckpt_env(),
                          timeout=120).returncode == 0


@pytest.mark.parametrize("legacy", [False, True])
def test_numpy_arrays_of_strings_bytes_and_times_still_commit_as_torch_reads_them(tmp_path, legacy):
    """The dtype state check first took only numeric dtypes' states: string, bytes and datetime arrays, which
    torch.load reads, were refused (reader)."""
    from ckptstore import Repository

    state = {"u": np.array(["cat", "dog"]), "s": np.array([b"ab"]), "t": np.array(["2020-01-01"], dtype="M8[ns]"),
             "d": np.array([1], dtype="m8[s]")}
    torch.save(state, tmp_path / "c.pt", _use_new_zipfile_serialization=not legacy)
    with Repository.init(tmp_path / "repo") as repo:
        back = repo.checkout(repo.commit(tmp_path / "c.pt"))
    for key, value in state.items():
        assert back[key].dtype == value.dtype and (back[key] == value).all(), key


class _BadScalarCall:
    """Pickles as numpy's scalar called with `args`: a hand-made file's, not numpy's."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return np.float64(0).__reduce__()[0], self.args


@pytest.mark.parametrize("args, said", [((np.dtype("f8"),), "1 arguments, not a dtype and its bytes"),
                                        ((np.dtype("f8"), b"\0" * 8, 1), "3 arguments"),
                                        ((np.dtype("f8"), b"\0" * 4), "data of 4 bytes, not float64's 8 bytes"),
                                        ((np.dtype("f8"), "12345678"), "data of a str")])
def test_a_malformed_numpy_scalar_call_is_refused_saying_what_is_wrong_not_called_damage(tmp_path, args, said):
    """scalar() with other arguments than a dtype and its bytes was called a damaged file (the call's TypeError), and
    bytes of the wrong size refused as if the dtype were the fault (reviewer helper 388)."""
    torch.save({"x": _BadScalarCall(*args)}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointFormatError, match="only numeric and bool numpy scalars are read") as refused:
        formats.read_checkpoint(tmp_path / "bad.pt")
    assert said in str(refused.value) and "truncated or corrupted" not in str(refused.value)
