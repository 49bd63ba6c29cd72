"""formats/snapshot.py: a snapshot equals `from_state` byte for byte, owns its bytes, and reuses its buffers."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from ckptstore import formats
from ckptstore.errors import UnsupportedStateError
from ckptstore.formats.snapshot import HostBuffers, _Copier, snapshot
from ckptstore.state import flatten


def _awkward_state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "t": base.t(),  # not contiguous
        "view": base[1:3],  # a view of the same storage: checkout must share it again
        "base": base,
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "neg": torch._neg_view(torch.tensor([1.0, -2.0])),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "param": torch.nn.Parameter(torch.ones(2)),
        "array": np.arange(6, dtype=np.int16),
        "blob": bytearray(b"abc"),
        "other": {"lr": 0.1, "names": ["a", "b"], "size": torch.Size([2, 3])},
    }


def test_snapshot_equals_from_state_byte_for_byte():
    state = _awkward_state()
    expected = formats.from_state(state)
    got, lent = snapshot(state, HostBuffers())
    assert got.files[0].to_json() == expected.files[0].to_json()
    assert list(got.tensors) == list(expected.tensors)
    for path, raw in expected.tensors.items():
        mine = got.tensors[path]
        assert (mine.dtype, mine.shape) == (raw.dtype, raw.shape), path
        assert mine.data.tobytes() == raw.data.tobytes(), path
    assert len(lent) == 9  # every tensor with bytes got a buffer; the empty one and the numpy leaves did not


def test_snapshot_owns_its_bytes():
    state = _awkward_state()
    got, _ = snapshot(state, HostBuffers())
    before = {path: raw.data.tobytes() for path, raw in got.tensors.items()}
    with torch.no_grad():
        for key in ("base", "bf16", "param"):
            state[key].add_(1)
    state["array"][:] = -1
    state["blob"][0] = ord("z")
    state["other"]["names"].append("c")
    assert {path: raw.data.tobytes() for path, raw in got.tensors.items()} == before
    assert got.files[0].to_json() == formats.from_state(_awkward_state()).files[0].to_json()


def test_buffers_are_reused_within_the_budget():
    state = {"a": torch.randn(1000), "b": torch.randn(10, 10)}
    buffers = HostBuffers(budget=4000 + 400)
    _, lent = snapshot(state, buffers)
    assert buffers.kept == 4400
    buffers.give_back(lent)
    _, again = snapshot(state, buffers)
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in lent]  # the same memory, no new allocation
    buffers.give_back(again)
    _, grown = snapshot({"a": torch.randn(1000), "b": torch.randn(20, 10)}, buffers)  # "b" changed shape
    assert grown[0].data_ptr() == lent[0].data_ptr()
    assert buffers.kept == 4000  # the old "b" buffer was freed; the new one is past the budget, a one-off
    buffers.give_back(grown)
    _, last = snapshot({"b": torch.randn(20, 10)}, buffers)  # the kept "a" buffer makes room for it
    assert buffers.kept == 800
    buffers.give_back(last)
    _, again = snapshot({"b": torch.randn(20, 10)}, buffers)
    assert again[0].data_ptr() == last[0].data_ptr()


def test_a_failed_snapshot_gives_its_buffers_back():
    buffers = HostBuffers()
    state = {"a": torch.randn(100), "sparse": torch.randn(4).to_sparse()}
    with pytest.raises(UnsupportedStateError, match="layout"):
        snapshot(state, buffers)
    _, lent = snapshot({"a": torch.randn(100)}, buffers)
    assert buffers.kept == 400 and len(lent) == 1


class _Tagged(torch.Tensor):
    """A tensor subclass, as libraries wrap parameters: copied one by one, not in the batched call."""


def test_tensor_subclasses_are_copied_byte_for_byte_and_owned():
    state = {"tagged": torch.arange(6, dtype=torch.float32).as_subclass(_Tagged), "plain": torch.ones(3)}
    got, _ = snapshot(state, HostBuffers())
    expected = {path: raw.data.tobytes() for path, raw in formats.from_state(state).tensors.items()}
    with torch.no_grad():
        state["tagged"].add_(1)  # after the snapshot: its copy keeps the bytes it had
    assert {path: raw.data.tobytes() for path, raw in got.tensors.items()} == expected


def test_a_kept_buffer_lent_again_as_other_dtypes_and_shapes_holds_each_new_tensors_bytes():
    buffers = HostBuffers()
    states = [{"a": torch.randn(10)}, {"a": torch.arange(10, dtype=torch.int32)}, {"a": torch.randn(2, 5)},
              {"a": torch.randn(10)}, {"a": torch.randn(20, dtype=torch.bfloat16)}]
    first = None
    for state in states:  # each 40 bytes: one kept buffer serves them all, seen through a view per dtype and shape
        got, lent = snapshot(state, buffers)
        first = first or lent[0].data_ptr()
        assert lent[0].data_ptr() == first
        expected = formats.from_state(state).tensors["a"]
        assert (got.tensors["a"].dtype, got.tensors["a"].shape) == (expected.dtype, expected.shape)
        assert got.tensors["a"].data.tobytes() == expected.data.tobytes()
        buffers.give_back(lent)
    kept = weakref.ref(got.tensors["a"].data)  # the cached numpy view of the buffer
    del got, lent
    snapshot({"b": torch.randn(3)}, buffers)  # the 40-byte buffer is dropped: its cached views must not hold it
    assert buffers.kept == 12 and kept() is None


def test_parameters_with_and_without_grad_go_in_the_batched_copy_as_plain_tensors():
    """A frozen model's Parameters (requires_grad False) copy in the one batched call, as trained ones do."""
    copier = _Copier(HostBuffers())
    state = {"frozen": torch.nn.Parameter(torch.ones(3), requires_grad=False),
             "trained": torch.nn.Parameter(torch.ones(3)), "plain": torch.ones(3)}
    flatten(state, to_raw=copier)
    assert len(copier.sources) == 3 and all(type(source) is torch.Tensor for source in copier.sources)
    copier.wait()


def test_a_lowered_budget_frees_the_kept_buffers_no_snapshot_holds():
    buffers = HostBuffers(budget=1 << 20)
    lent = [buffers.take(1000, False), buffers.take(2000, False)]
    buffers.give_back(lent)
    assert buffers.kept == 3000
    buffers.budget = 0
    one_off = buffers.take(1000, False)  # the next take frees the rest and keeps nothing new
    assert buffers.kept == 0 and one_off.numel() == 1000
