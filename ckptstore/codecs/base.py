"""The codec contract: bytes of one chunk in, bytes out, optionally relative to a base chunk."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Codec(Protocol):
    """Encodes one chunk of a tensor's raw bytes (uint8, 1-D) against an optional base chunk.

    A codec may also offer `decode_chain(payloads, params, nbytes, out)`, decoding a whole chain of
    its own payloads (newest first) at once when every level shares the same params (or the same
    `chain_params`, when the codec names the only params its payloads decode by); lossy
    codecs add `encode_lossy(data, base, params, hints) -> (payload, reconstruction)` and
    `lossy = True`.
    """

    codec_id: str

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        """Compress `data`; when `base` is given the result may depend on it (a residual)."""

    def decode(
        self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int
    ) -> np.ndarray:
        """Rebuild the chunk. `base` (when the payload needs it) may be overwritten and returned."""

    def needs_base(self, payload: bytes) -> bool:
        """True when `decode` of this payload reads the base chunk."""
