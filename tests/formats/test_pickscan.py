"""The C unpickler fast path of torchzip: what `_pickscan.walk` lets through, and that it never changes a verdict."""

import pickle
import random
import zipfile
from collections import OrderedDict

import pytest
import torch

from ckptstore.formats import torchzip

pytestmark = pytest.mark.skipif(torchzip._pickscan is None, reason="built without the C opcode walk")

HEAD = pickle.PROTO + b"\x02"


def walk(data):
    return torchzip._pickscan.walk(data, torchzip._WALK_TABLE, torchzip.MAX_DEPTH, torchzip.MAX_VISITS)


def plain(data):
    return walk(data) == "plain"


def _archive(tmp_path, data=b"", state=None):
    path = tmp_path / "a.pt"
    torch.save(state if state is not None else {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.bfloat16)}, path)
    if data:
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp_path / "b.pt", "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                zout.writestr(info, data if info.filename.endswith("/data.pkl") else zin.read(info))
        path = tmp_path / "b.pt"
    handle = open(path, "rb")  # noqa: SIM115 - closed by the fixture's caller through the archive's zip
    archive = torchzip._Archive(zipfile.ZipFile(path), handle, path.stat().st_size)
    return archive, archive.read("data.pkl")


def test_torch_save_pickles_are_plain_and_read_alike(tmp_path):
    archive, data = _archive(tmp_path, state={"m": torch.nn.Linear(3, 2).state_dict(), "s": torch.Size([2]),
                                              "d": torch.device("cpu"), "t": torch.float16, "n": [1, 2.5, "x", None]})
    assert plain(data)
    fast = torchzip._StandInFlattener().flatten(torchzip._FastUnpickler(data, archive).load(), "")
    slow = torchzip._StandInFlattener().flatten(torchzip._Unpickler(data, archive).load(), "")
    assert fast.skeleton == slow.skeleton
    assert {k: v.data.tobytes() for k, v in fast.tensors.items()} == {
        k: v.data.tobytes() for k, v in slow.tensors.items()}


@pytest.mark.parametrize("data", [
    b"", HEAD, HEAD + pickle.EMPTY_DICT,  # no STOP
    pickle.PROTO + b"\x03" + pickle.EMPTY_DICT + pickle.STOP,  # another protocol
    HEAD + pickle.EMPTY_DICT + pickle.PROTO + b"\x04" + pickle.STOP,
    HEAD + pickle.MARK + pickle.DICT + pickle.STOP,  # an opcode torch does not run
    HEAD + pickle.EMPTY_DICT + pickle.DUP + pickle.POP + pickle.STOP,
    HEAD + pickle.STACK_GLOBAL + pickle.STOP, HEAD + pickle.EXT1 + b"\x01" + pickle.STOP,
    HEAD + pickle.EMPTY_DICT + pickle.LONG_BINPUT + (2**32 - 1).to_bytes(4, "little") + pickle.STOP,  # memo bomb
    HEAD + pickle.BINUNICODE + (2**32 - 1).to_bytes(4, "little") + b"ab" + pickle.STOP,  # length past the end
    HEAD + pickle.SHORT_BINSTRING + b"\x09abc" + pickle.STOP, HEAD + pickle.BININT + b"\x01\x02",
    HEAD + pickle.GLOBAL + b"torch\nfloat32" + pickle.STOP,  # unterminated line
])
def test_pickles_the_c_unpickler_must_not_see_are_not_plain(data):
    assert not plain(data)


def test_a_memo_bomb_is_read_by_the_python_unpickler_without_allocating(tmp_path):
    bomb = HEAD + pickle.EMPTY_DICT + pickle.LONG_BINPUT + (2**32 - 2).to_bytes(4, "little") + pickle.STOP
    archive, data = _archive(tmp_path, bomb)
    assert not plain(data)
    assert torchzip._unpickle(data, archive) == {}  # the pure-Python memo is a dict: one entry



def test_a_memo_index_padded_out_past_stop_is_not_plain():
    """The index was bounded by data.pkl's length, bytes after STOP included: zeros a deflated entry holds for free
    let a 64 KiB file grow the C memo by 1 GiB (auditor helper 278). Now at most the PUTs walked before it."""
    padded = HEAD + pickle.NONE + pickle.LONG_BINPUT + (60_000).to_bytes(4, "little") + pickle.STOP + bytes(70_000)
    assert not plain(padded)
    assert not plain(HEAD + pickle.NONE + pickle.LONG_BINPUT + (1).to_bytes(4, "little") + pickle.STOP)
    assert plain(HEAD + pickle.NONE + pickle.LONG_BINPUT + (0).to_bytes(4, "little") + pickle.STOP)


def test_a_memo_index_reached_by_one_put_repeated_is_not_plain():
    """Counting PUTs let `BINPUT 0` a million times (2 MB that deflate packs into 2 KB) buy LONG_BINPUT 1000000:
    a 47 KB file committed at 466 MB (reviewer helper 295, of 1301b40). A PUT names an index stored or the next."""
    repeated = HEAD + pickle.NONE + (pickle.BINPUT + b"\x00") * 1000 + pickle.LONG_BINPUT + (1000).to_bytes(4, "little")
    assert not plain(repeated + pickle.STOP)
    assert not plain(HEAD + pickle.NONE + pickle.BINPUT + b"\x05" + pickle.STOP)  # a gap: Python's pickler makes none
    in_order = HEAD + pickle.NONE + b"".join(pickle.BINPUT + bytes([i]) for i in range(256))
    assert plain(in_order + pickle.LONG_BINPUT + (256).to_bytes(4, "little") + pickle.BINPUT + b"\x07" + pickle.STOP)


def test_a_torch_save_pickle_with_long_memo_indices_is_still_plain(tmp_path):
    """Over 256 memoized objects torch.save's pickler writes LONG_BINPUT, numbering them in order."""
    archive, data = _archive(tmp_path, state={f"t{i}": torch.full((2,), float(i)) for i in range(300)})
    assert pickle.LONG_BINPUT in data and plain(data)

def _build_on(global_line, state):
    return HEAD + pickle.GLOBAL + global_line + state + pickle.BUILD + pickle.STOP


@pytest.mark.parametrize("module, name", sorted(torchzip._globals()))
@pytest.mark.parametrize("slots", [False, True])
def test_build_on_any_allow_listed_global_is_refused_by_the_c_unpickler(tmp_path, module, name, slots):
    attr = pickle.BINUNICODE + (4).to_bytes(4, "little") + b"evil" + pickle.NEWTRUE
    state = (pickle.NONE + pickle.EMPTY_DICT + attr + pickle.SETITEM + pickle.TUPLE2 if slots
             else pickle.EMPTY_DICT + attr + pickle.SETITEM)
    data = _build_on(f"{module}\n{name}\n".encode(), state)
    archive, data = _archive(tmp_path, data)
    assert plain(data)
    shared = torchzip._globals()[(module, name)]
    with pytest.raises(Exception):  # noqa: B017,PT011 - any refusal will do; the Python unpickler names it
        torchzip._FastUnpickler(data, archive).load()
    assert not hasattr(shared, "evil") and not hasattr(getattr(shared, "target", None), "evil")
    assert not hasattr(OrderedDict, "evil")


def test_damaged_pickles_get_the_verdict_of_the_python_unpickler(tmp_path):
    archive, data = _archive(tmp_path, state={"m": torch.nn.Linear(3, 2).state_dict(), "x": {1, 2}, "c": 1 + 2j})
    rng = random.Random(0)

    def outcome(read, data):
        try:
            flat = torchzip._StandInFlattener().flatten(read(data), "")
        except Exception as exc:  # noqa: BLE001 - the kind of failure is the verdict compared
            return type(exc).__name__
        return flat.skeleton, {k: v.data.tobytes() for k, v in flat.tensors.items()}

    checked = 0
    for _ in range(400):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(2, len(damaged))] = rng.randrange(256)
        damaged = bytes(damaged)
        checked += plain(damaged)
        assert outcome(lambda d: torchzip._unpickle(d, archive), damaged) == outcome(
            lambda d: torchzip._Unpickler(d, archive).load(), damaged)
    assert checked > 50  # the fast path was exercised, not only refused


def _nested(depth):
    value = {"w": torch.ones(2), "p": torch.nn.Parameter(torch.zeros(3)), "s": {1, "a"}, "z": torch.Size([2, 3])}
    for level in range(depth):
        value = [value, (level, (1.5, "x"))] if level % 3 else OrderedDict(k=(value,), v=(None, level))
    return value


def test_real_nesting_tuples_storage_args_and_sets_stay_plain_and_read_alike(tmp_path):
    """The tuple-depth walk refuses nothing a real file holds: tuples in tuples, storage args, containers 60 deep."""
    archive, data = _archive(tmp_path, state={"m": torch.nn.Linear(3, 2).state_dict(), "deep": _nested(60),
                                              ((1, (2, (3,))), "k"): torch.arange(4)})
    assert walk(data) == "plain"
    fast = torchzip._StandInFlattener().flatten(torchzip._FastUnpickler(data, archive).load(), "")
    slow = torchzip._StandInFlattener().flatten(torchzip._Unpickler(data, archive).load(), "")
    assert fast.skeleton == slow.skeleton
    assert {k: v.data.tobytes() for k, v in fast.tensors.items()} == {
        k: v.data.tobytes() for k, v in slow.tensors.items()}


def _tuples(depth):
    return pickle.NONE + pickle.TUPLE1 * depth


@pytest.mark.parametrize("body", [
    _tuples(201),
    pickle.EMPTY_DICT + _tuples(10**6) + pickle.BININT1 + b"\x01" + pickle.SETITEM,  # the 1.5 KB crash
    _tuples(150) + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.TUPLE1 * 60,  # through the memo
    _tuples(150) + pickle.MEMOIZE + pickle.BINGET + b"\x00" + pickle.TUPLE1 * 60,  # protocol 4's memo
    _tuples(150) + pickle.LONG_BINPUT + (9).to_bytes(4, "little") + pickle.LONG_BINGET + (9).to_bytes(4, "little")
    + pickle.TUPLE1 * 60,  # a gap in the memo: any GET is taken as deep as the deepest value so far
    pickle.GLOBAL + b"collections\nOrderedDict\n" + _tuples(150) + pickle.REDUCE + pickle.TUPLE1 * 60,
    pickle.MARK + _tuples(100) + _tuples(201) + pickle.TUPLE,
    pickle.SHORT_BINUNICODE + b"\x01a" + pickle.EMPTY_SET + pickle.MARK + _tuples(201) + pickle.ADDITEMS,
])
@pytest.mark.parametrize("head", [HEAD, pickle.PROTO + b"\x04", pickle.PROTO + b"\x06"])
def test_tuples_nested_past_the_depth_limit_are_too_deep_wherever_a_reader_would_go(body, head):
    """A tuple more than MAX_DEPTH deep, past which CPython 3.11's tuple hash overflows the C stack (auditor
    helper 299): found in any pickle any reader (the C one, the Python one, torch.load) would run that far."""
    assert walk(head + body + pickle.STOP) == "too deep"


def test_the_walk_stops_where_every_reader_stops():
    """Past an opcode no reader runs, a stack underflow or a GET of an index never PUT, nothing is read."""
    assert walk(HEAD + _tuples(200) + pickle.STOP) == "plain"
    assert walk(HEAD + pickle.DUP + _tuples(201) + pickle.STOP) == "other"
    assert walk(HEAD + pickle.FROZENSET + _tuples(201) + pickle.STOP) == "other"  # the Python reader refuses it
    assert walk(HEAD + pickle.TUPLE2 + _tuples(201) + pickle.STOP) == "other"
    assert walk(HEAD + pickle.NONE + pickle.MARK + pickle.TUPLE1 + _tuples(201) + pickle.STOP) == "other"
    assert walk(HEAD + pickle.BINGET + b"\x00" + _tuples(201) + pickle.STOP) == "other"


def test_walk_from_walks_one_pickle_of_a_stream_and_says_where_it_ended():
    """A legacy torch.save file is a stream of pickles: each is walked from where the one before it stopped."""
    first, second = pickle.dumps(1, protocol=2), pickle.dumps({"a": (1, 2)}, protocol=2)
    stream = first + second + b"\x00" * 10  # tensor bytes follow a legacy file's pickles
    table, limits = torchzip._WALK_TABLE, (torchzip.MAX_DEPTH, torchzip.MAX_VISITS)
    assert torchzip._pickscan.walk_from(stream, table, *limits, 0) == ("plain", len(first), True)
    assert torchzip._pickscan.walk_from(stream, table, *limits, len(first)) == ("plain", len(first + second), True)
    assert torchzip._pickscan.walk_from(stream, table, *limits, len(first + second)) == ("other", len(first + second),
                                                                                      False)
    assert torchzip._pickscan.walk_from(HEAD + pickle.NONE + pickle.DUP, table, *limits, 0) == ("other", 3, False)
    assert torchzip._pickscan.walk_from(first + HEAD + _tuples(201) + pickle.STOP, table, *limits, len(first))[0] == (
        "too deep")
    with pytest.raises(ValueError, match="outside"):
        torchzip._pickscan.walk_from(first, table, *limits, len(first) + 1)


def _shared(levels, put=pickle.BINPUT + b"\x00", get=pickle.BINGET + b"\x00"):
    """t = (t, t), `levels` times, through the memo: `levels` deep, and a hash of it visits 2**(levels + 1) - 1."""
    return pickle.NONE + put + (get + pickle.TUPLE2 + put) * levels


@pytest.mark.parametrize("body", [
    _shared(60),  # the 250-byte hang
    pickle.EMPTY_DICT + _shared(60) + pickle.BININT1 + b"\x01" + pickle.SETITEM,
    _shared(23),  # 2**24 - 1 visits: past 10**7
    _shared(60, pickle.LONG_BINPUT + b"\x00" * 4, pickle.LONG_BINGET + b"\x00" * 4),
    pickle.NONE + pickle.MEMOIZE + b"".join(pickle.BINGET + bytes([i]) + pickle.TUPLE2 + pickle.MEMOIZE
                                            for i in range(60)),  # protocol 4's memo, a new index each time
    pickle.NONE + pickle.BINPUT + b"\x00" + (pickle.MARK + (pickle.BINGET + b"\x00") * 3 + pickle.TUPLE + pickle.BINPUT
                                             + b"\x00") * 40,  # (t, t, t)
    pickle.NONE + pickle.LONG_BINPUT + (9).to_bytes(4, "little")
    + ((pickle.LONG_BINGET + (9).to_bytes(4, "little")) * 2 + pickle.TUPLE2) * 60,  # a gap: any GET the biggest yet
    pickle.GLOBAL + b"collections\nOrderedDict\n" + _shared(60) + pickle.TUPLE1 + pickle.REDUCE,
])
@pytest.mark.parametrize("head", [HEAD, pickle.PROTO + b"\x04"])
def test_tuples_whose_hash_visits_too_many_items_are_too_big(body, head):
    """A tuple only 60 deep whose hash visits 2**61 items, as shared tuples are hashed wherever they occur: the
    walk called it plain and every reader hung hashing it as a dict key (auditor helper 299). Now "too big"."""
    assert walk(head + body + pickle.STOP) == "too big"


def test_tuples_shared_within_bounds_and_lists_of_them_stay_plain():
    """A tuple shared 20 levels over (2**21 visits) is within the bound; lists and dicts end the count as the hash
    does, so many shared tuples in a list are not summed."""
    assert walk(HEAD + _shared(20) + pickle.STOP) == "plain"
    many = pickle.EMPTY_LIST + _shared(20) + (pickle.BINGET + b"\x00" + pickle.APPEND) * 100 + pickle.APPEND
    assert walk(HEAD + many + pickle.STOP) == "plain"
    assert walk(HEAD + pickle.EMPTY_LIST + _shared(20) + pickle.APPEND + pickle.TUPLE1 + pickle.STOP) == "plain"
