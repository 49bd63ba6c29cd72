"""Lossy codec for Adam's first moment, coded as the step Adam takes: u = m / sqrt(v + eps).

u is quantized uniformly with a dead zone against the reconstructed second moment of the same
commit (the base), then entropy coded. Given the original second moment (hint "v"), the encoder
quantizes the original update m / sqrt(v) instead, so the restored update is the original's up to
one step even where v was stored coarsely; decoding is the same either way. It then also leaves
the restored update's squared error and norm in hints["update_error"], saving the writer a pass.

|u| is about 1 at most whatever the tensor's scale, so one step size fits every tensor, and error
lands where it moves the weights least. Params: dtype, v_dtype (the base's), step, rounding, eps, tighten (< 1: the
writer's retry at a finer step, rounding to nearest, to meet a level's error bound).
Layout: b"MN2", the step (f32), then the entropy-coded symbols (version 1, b"MN1", kept its step in
the params, and still decodes).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ckptstore.codecs.deadzone import dequantize, finite, quantize, stream_declares
from ckptstore.codecs.entropy import decode_symbols, encode_symbols
from ckptstore.codecs.floats import from_float32, itemsize, rounding_error, sum_of_squares, to_float32
from ckptstore.errors import CodecError, NonFiniteError, UnquantizableError

MAGIC, MAGIC_V1 = b"MN2", b"MN1"
_HEAD = struct.Struct("<3sf")
# Every payload layout `decode` accepts (always against the second moment); tests/fixtures holds one of each.
DECODES = ("MN1", "MN2")


def _scale(base: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    return np.sqrt(to_float32(base, params["v_dtype"]) + np.float32(params["eps"]))


def _quantized(direction: np.ndarray, step: float, rounding: float, values: np.ndarray, v: np.ndarray,
               params: dict[str, Any]) -> np.ndarray:
    """`quantize`, its refusal told as v's underflow where that is the cause (not the first moment's size).

    A float16 v that underflowed to 0 beside a nonzero m makes m / sqrt(v + eps) far too large for any level: the
    range's figures named the first moment's values, as if they were the fault.
    """
    try:
        return quantize(direction, step, rounding)
    except UnquantizableError as exc:
        if np.any((to_float32(v, params["v_dtype"]) == 0) & (values != 0)):
            raise UnquantizableError("its second moment is 0 where the first is not (underflow, as in fp16 "
                                     "training): stored lossless") from exc
        raise


class NormalizedMomentCodec:
    """First moments relative to the square root of the (reconstructed) second moment."""

    codec_id = "normmoment"

    def encode_lossy(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
                     hints: dict[str, Any] | None = None) -> tuple[bytes, np.ndarray]:
        if base is None:
            raise CodecError("normmoment: needs the reconstructed second moment as its base")
        values = to_float32(data, params["dtype"])
        if not np.isfinite(values).all():
            raise NonFiniteError("normmoment: non-finite values cannot be quantized")
        scale, step = _scale(base, params), float(np.float32(params["step"] * params.get("tighten", 1.0)))
        # The step Adam would take is m / sqrt(v) with the original v: quantize that (when the writer
        # has it), so a coarse reconstructed v changes the first moment, not the restored update.
        original_v = hints.get("v") if hints else None
        direction = values / (_scale(original_v, params) if original_v is not None else scale)
        rounding = params.get("rounding", 0.5) if params.get("tighten", 1.0) >= 1.0 else 0.5
        levels = _quantized(direction, step, rounding, values, original_v if original_v is not None else base, params)
        if hints and hints.get("prune") is not None:
            levels[hints["prune"]] = 0
        recon = self._reconstruct(levels, scale, step, params, encoding=True)
        if original_v is not None and hints is not None:  # the writer's bound is on this (policy/fidelity.py)
            restored = to_float32(recon, params["dtype"]) / scale
            hints["update_error"] = (sum_of_squares(restored - direction), sum_of_squares(direction))
        return _HEAD.pack(MAGIC, step) + encode_symbols(levels), recon

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        return self.encode_lossy(data, base, params)[0]

    @staticmethod
    def error_bound(data: np.ndarray, base: np.ndarray, rebuilt: np.ndarray,
                    params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(|reconstruction - value|, the bound it keeps) per entry, without prune hints.

        The bound: step * max(rounding, 1 - rounding) in Adam's step u = m / sqrt(v + eps), so
        that times sqrt(v + eps) in m, plus the rounding to the dtype and float32's in the division.
        """
        values = to_float32(data, params["dtype"]).astype(np.float64)
        got = to_float32(rebuilt, params["dtype"]).astype(np.float64)
        rounding = float(params.get("rounding", 0.5))
        scale = _scale(base, params).astype(np.float64)
        quantized = float(np.float32(params["step"])) * max(rounding, 1 - rounding) * scale
        arithmetic = rounding_error(values, "torch.float32") * 4 + rounding_error(got, "torch.float32") * 2
        return np.abs(got - values), quantized * (1 + 2.0**-20) + rounding_error(got, params["dtype"]) + arithmetic

    @staticmethod
    def _reconstruct(levels: np.ndarray, scale: np.ndarray, step: float, params: dict[str, Any],
                     encoding: bool = False) -> np.ndarray:
        update = dequantize(levels, step) * scale
        return from_float32(finite(update, params["dtype"]) if encoding else update, params["dtype"])

    def needs_base(self, payload: bytes) -> bool:
        self._head(payload, {})
        return True

    def step_of(self, payload: bytes) -> float:
        """The step a chunk was quantized with (a level's `fine_moment_step` where its weight barely moved)."""
        return self._head(payload, {})[0]

    @staticmethod
    def _head(payload: bytes, params: dict[str, Any]) -> tuple[float, int]:
        """(step, header size); version 1 kept its step in the params."""
        if len(payload) >= _HEAD.size and payload[:3] == MAGIC:
            return _HEAD.unpack_from(payload)[1], _HEAD.size
        if payload[:3] == MAGIC_V1:
            return params.get("step", 0.0), 3
        raise CodecError("normmoment: payload does not start with a valid header")

    def declared_bytes(self, payload: bytes | memoryview, params: dict[str, Any]) -> tuple[int, int] | None:
        """The raw size `payload` says it decodes to: its symbol stream's count (one per value) times the dtype's size.

        Checked before a record's buffer is taken (replay.py): a forged record cannot claim far more.
        """
        try:
            header = self._head(payload, {})[1]
        except CodecError:  # no payload of ours: it does not say
            return None
        return stream_declares(payload, header, params)

    def decode(self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int) -> np.ndarray:
        step, header = self._head(payload, params)
        if base is None:
            raise CodecError("normmoment: decoded without its second moment")
        count = nbytes // itemsize(params["dtype"])
        if base.size != count * itemsize(params["v_dtype"]):
            raise CodecError("normmoment: the second moment does not match the chunk's size")
        levels = decode_symbols(memoryview(payload)[header:], limit=count)
        if levels.size != count:
            raise CodecError(f"normmoment: payload holds {levels.size} values, expected {count}")
        return self._reconstruct(levels, _scale(base, params), step, params)
