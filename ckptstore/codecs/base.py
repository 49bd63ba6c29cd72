"""The codec contract: bytes of one chunk in, bytes out, optionally relative to a base chunk."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Codec(Protocol):
    """Encodes one chunk of a tensor's raw bytes (uint8, 1-D) against an optional base chunk."""

    codec_id: str

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        """Compress `data`; when `base` is given the result may depend on it (a residual)."""

    def decode(
        self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int
    ) -> np.ndarray:
        """Rebuild the chunk. `base` (when the payload needs it) may be overwritten and returned."""

    def decode_chain(self, payloads: list[bytes], params: dict[str, Any], nbytes: int,
                     out: np.ndarray | None = None) -> np.ndarray:
        """Decode newest-first payloads where each is a residual of the next; the last needs no base."""

    def needs_base(self, payload: bytes) -> bool:
        """True when `decode` of this payload reads the base chunk."""
