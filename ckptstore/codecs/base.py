"""The codec contract: bytes of one chunk in, bytes out, optionally relative to a base chunk.

Optional capabilities are protocols of their own; the registry (codecs/__init__.py) checks each
codec against them once, when it is registered.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Codec(Protocol):
    """Encodes one chunk of a tensor's raw bytes (uint8, 1-D) against an optional base chunk."""

    codec_id: str

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        """Compress `data`; when `base` is given the result may depend on it (a residual)."""

    def decode(
        self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int
    ) -> np.ndarray:
        """Rebuild the chunk. `base` (when the payload needs it) may be overwritten and returned."""

    def needs_base(self, payload: bytes) -> bool:
        """True when `decode` of this payload reads the base chunk."""


class LevelsNeeded(Exception):
    """Raised by `decode_chain` where a level below the newest needs its own record's params.

    A version-1 payload kept its step there: the caller decodes that chain level by level instead.
    """


@runtime_checkable
class ChainDecoder(Protocol):
    """Decodes a whole chain of its own payloads (newest first) in one pass.

    Valid when every level shares the same params, or the same `chain_params` where the codec
    names the only params its payloads decode by (an attribute, optional).
    """

    def decode_chain(self, payloads: list[bytes], params: dict[str, Any], nbytes: int, out: np.ndarray) -> np.ndarray:
        """Decode the chain into `out` and return it."""


@runtime_checkable
class PlaneCodec(Protocol):
    """A lossless codec that stores byte planes and can hand them out without interleaving."""

    def decode_planes(self, payloads: list[bytes], nbytes: int) -> list[np.ndarray]:
        """The byte planes of a chain of payloads (newest first)."""

    def plane_modes(self, payload: bytes) -> list[int]:
        """How each byte plane of `payload` was stored (kept as a hint for the next residual)."""

    def encode_grouped_parts(self, grouped: np.ndarray, base_planes: list[np.ndarray] | None,
                             params: dict[str, Any]) -> tuple[list[bytes | memoryview], list[int]]:
        """`encode` of a chunk split into byte planes (rows of `grouped`): payload parts, unjoined, and plane modes."""


@runtime_checkable
class LossyCodec(Protocol):
    """A codec whose encoding is approximate; the reconstruction it returns is what decode gives."""

    def encode_lossy(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
                     hints: dict[str, Any]) -> tuple[bytes, np.ndarray]:
        """(payload, reconstruction); `base` is the parent's reconstruction (closed loop)."""


@runtime_checkable
class SteppedCodec(Protocol):
    """A lossy codec whose payloads record the quantization step they were coded with."""

    def step_of(self, payload: bytes) -> float:
        """The step `payload` was quantized with."""


@runtime_checkable
class DeclaresSize(Protocol):
    """A codec whose payloads say how many raw bytes they decode to (checked before a buffer is taken)."""

    def declared_bytes(self, payload: bytes | memoryview, params: dict[str, Any]) -> tuple[int, int] | None:
        """The fewest and most raw bytes `payload` decodes to with `params` (equal: exact); None: it does not say."""
