import math
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from ckptstore.errors import UnsupportedStateError
from ckptstore.state import flatten, materialize, unflatten
from tests.conftest import assert_same

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


def _round_trip(obj):
    flat = flatten(obj)
    return unflatten(flat.skeleton, lambda p: materialize(flat.tensors[p]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_checkpoint_dtype_round_trips_bit_exact(dtype):
    source = (torch.randn(7, 5) * 3).to(dtype) if dtype != torch.bool else torch.rand(7, 5) > 0.5
    back = _round_trip({"t": source, "scalar": source[0, 0].clone(), "empty": source[:0]})
    assert_same({"t": source, "scalar": source[0, 0].clone(), "empty": source[:0]}, back)


def test_nested_training_state_with_odd_values():
    state = OrderedDict(
        a=[1, 2.5, None, True, "s", (3, float("nan"), float("inf"))],
        b={0: torch.arange(4), 1: {"x": -math.inf}},
        rng={"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        misc=[torch.float16, torch.Size([2, 3]), torch.device("cpu"), np.float32(1.5), b"raw\x00bytes", {3, 1}],
        noncontig=torch.randn(4, 6).t(),
    )
    back = _round_trip(state)
    assert isinstance(back, OrderedDict)
    assert back["misc"][:4] == [torch.float16, torch.Size([2, 3]), torch.device("cpu"), np.float32(1.5)]
    assert back["misc"][4] == b"raw\x00bytes" and back["misc"][5] == {1, 3}
    back["noncontig"] = back["noncontig"]
    assert_same(state["noncontig"].contiguous(), back["noncontig"])
    del state["misc"], back["misc"]
    state["noncontig"] = state["noncontig"].contiguous()
    assert_same(state, back)


def test_shared_storage_is_stored_once_and_restored_shared():
    weight = torch.randn(10, 4)
    flat = flatten({"embed": weight, "head": weight})
    assert list(flat.tensors) == ["embed"]
    back = unflatten(flat.skeleton, lambda p: materialize(flat.tensors[p]))
    assert back["embed"] is back["head"]


def test_keys_with_slashes_do_not_collide():
    flat = flatten({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    assert len(flat.tensors) == 2


def test_unpicklable_objects_are_refused_with_their_path():
    with pytest.raises(UnsupportedStateError, match="model/thing"):
        flatten({"model": {"thing": object()}})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int64, torch.bool, torch.complex64])
def test_float64_values_match_torch_and_skip_what_is_not_a_float(dtype):
    from ckptstore.state import float64_values

    source = torch.randn(2, 3, generator=torch.Generator().manual_seed(0)) * 3
    tensor = source.to(dtype)
    values = float64_values(flatten({"t": tensor}).tensors["t"])
    if tensor.is_floating_point():
        assert values is not None and values.tobytes() == tensor.double().reshape(-1).numpy().tobytes()
    else:
        assert values is None
    assert float64_values(flatten({"a": np.arange(3, dtype=np.float16)}).tensors["a"]).tolist() == [0.0, 1.0, 2.0]
    assert float64_values(flatten({"a": np.arange(3)}).tensors["a"]) is None
