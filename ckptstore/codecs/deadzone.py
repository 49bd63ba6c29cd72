"""Lossy codec for weights: dead-zone uniform quantization, then entropy coding.

It quantizes the tensor itself (keyframe) or its residual against the base's reconstruction
(closed loop).

Small residuals fall in the dead zone and become exact zeros, which the entropy coder makes nearly
free; a residual skipped now is still there against the reconstruction next time, so the error of
any reconstruction stays below one step however long the chain. Params: dtype, step (absolute),
rounding (0.5 rounds to nearest; less widens the dead zone). Layout: b"DZ1", has-base flag (u8),
then the entropy-coded symbols.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ckptstore.codecs.entropy import decode_symbols, encode_symbols
from ckptstore.codecs.floats import from_float32, to_float32
from ckptstore.errors import CodecError

MAGIC = b"DZ1"
_HEAD = struct.Struct("<3sB")


def quantize(values: np.ndarray, step: float, rounding: float) -> np.ndarray:
    """Signed integer levels with a dead zone: |v| < (1 - rounding) * step maps to 0."""
    levels = np.floor(np.abs(values) / np.float32(step) + np.float32(rounding))
    return (np.sign(values) * levels).astype(np.int32)


def dequantize(levels: np.ndarray, step: float) -> np.ndarray:
    return levels.astype(np.float32) * np.float32(step)


def _reconstruct(levels: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> np.ndarray:
    values = dequantize(levels, params["step"])
    if base is not None:
        values = to_float32(base, params["dtype"]) + values
    return from_float32(values, params["dtype"])


class DeadZoneCodec:
    """Dead-zone uniform quantizer for float tensors (keyframes and closed-loop residuals)."""

    codec_id = "deadzone"
    lossy = True

    def encode_lossy(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
                     hints: dict[str, Any] | None = None) -> tuple[bytes, np.ndarray]:
        values = to_float32(data, params["dtype"])
        if not np.isfinite(values).all():
            raise CodecError("deadzone: non-finite values cannot be quantized")
        target = values - to_float32(base, params["dtype"]) if base is not None else values
        levels = quantize(target, params["step"], params.get("rounding", 0.5))
        if hints and hints.get("prune") is not None:
            levels[hints["prune"]] = 0
        payload = _HEAD.pack(MAGIC, base is not None) + encode_symbols(levels)
        return payload, _reconstruct(levels, base, params)

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        return self.encode_lossy(data, base, params)[0]

    def needs_base(self, payload: bytes) -> bool:
        return bool(self._head(payload))

    def _head(self, payload: bytes) -> int:
        if len(payload) < _HEAD.size or payload[:3] != MAGIC:
            raise CodecError("deadzone: payload does not start with a valid header")
        return _HEAD.unpack_from(payload)[1]

    def decode(self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int) -> np.ndarray:
        has_base = self._head(payload)
        if has_base and (base is None or base.size != nbytes):
            raise CodecError("deadzone: residual chunk decoded without its base")
        levels = decode_symbols(memoryview(payload)[_HEAD.size :])
        out = _reconstruct(levels, base if has_base else None, params)
        if out.size != nbytes:
            raise CodecError(f"deadzone: decoded {out.size} bytes, expected {nbytes}")
        return out
