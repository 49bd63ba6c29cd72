"""Lossy codec for Adam's first moment, coded as the step Adam takes: u = m / sqrt(v + eps).

u is quantized uniformly with a dead zone against the reconstructed second moment of the same
commit (the base), then entropy coded.

|u| is about 1 at most whatever the tensor's scale, so one step size fits every tensor, and error
lands where it moves the weights least. Params: dtype, v_dtype (the base's), step, rounding, eps.
Layout: b"MN1", then the entropy-coded symbols.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptstore.codecs.deadzone import dequantize, quantize
from ckptstore.codecs.entropy import decode_symbols, encode_symbols
from ckptstore.codecs.floats import from_float32, to_float32
from ckptstore.errors import CodecError

MAGIC = b"MN1"


def _scale(base: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    return np.sqrt(to_float32(base, params["v_dtype"]) + np.float32(params["eps"]))


class NormalizedMomentCodec:
    """First moments relative to the square root of the (reconstructed) second moment."""

    codec_id = "normmoment"
    lossy = True

    def encode_lossy(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
                     hints: dict[str, Any] | None = None) -> tuple[bytes, np.ndarray]:
        if base is None:
            raise CodecError("normmoment: needs the reconstructed second moment as its base")
        values = to_float32(data, params["dtype"])
        if not np.isfinite(values).all():
            raise CodecError("normmoment: non-finite values cannot be quantized")
        scale = _scale(base, params)
        levels = quantize(values / scale, params["step"], params.get("rounding", 0.5))
        if hints and hints.get("prune") is not None:
            levels[hints["prune"]] = 0
        return MAGIC + encode_symbols(levels), self._reconstruct(levels, scale, params)

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        return self.encode_lossy(data, base, params)[0]

    @staticmethod
    def _reconstruct(levels: np.ndarray, scale: np.ndarray, params: dict[str, Any]) -> np.ndarray:
        return from_float32(dequantize(levels, params["step"]) * scale, params["dtype"])

    def needs_base(self, payload: bytes) -> bool:
        if payload[:3] != MAGIC:
            raise CodecError("normmoment: payload does not start with a valid header")
        return True

    def decode(self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int) -> np.ndarray:
        self.needs_base(payload)
        if base is None:
            raise CodecError("normmoment: decoded without its second moment")
        levels = decode_symbols(memoryview(payload)[3:])
        return self._reconstruct(levels, _scale(base, params), params)
