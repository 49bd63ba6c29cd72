"""The checked decode: one entry point that turns any damage to a payload into CorruptObjectError.

A codec alone cannot always tell a flipped bit in stored data (a flipped mantissa byte of a raw
plane decodes fine), so after decoding, the chunk's xxh3 checksum recorded at commit is compared
too. It is the entry point for code that decodes single payloads (the codec contract, tools);
replay does the same checks on whole chains itself (`replay._replay_chunk` compares the checksum
after the chain is decoded, and names the damaged object), so a damaged object never becomes a
crash or a silently wrong tensor there either.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from ckptstore.codecs import capabilities, get_codec
from ckptstore.errors import CkptError, CorruptObjectError
from ckptstore.hashing import chunk_checksum

# What a decoder fed malformed bytes may raise beyond CodecError (the codecs map most of these
# themselves; this is the net under them, so a missed case still names the object).
MALFORMED = (CkptError, ValueError, IndexError, KeyError, OverflowError, MemoryError, struct.error,
             zstandard.ZstdError)


def _guarded(name: str, codec_id: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
    try:
        return decode()
    except CorruptObjectError:
        raise
    except MALFORMED as exc:
        raise CorruptObjectError(name, f"not a valid {codec_id} payload ({type(exc).__name__}: {exc})") from exc


def _verified(name: str, out: np.ndarray, nbytes: int, checksum: str | None) -> np.ndarray:
    raw = np.ascontiguousarray(out).reshape(-1).view(np.uint8)
    if raw.size != nbytes:
        raise CorruptObjectError(name, f"decoded to {raw.size} bytes where {nbytes} were recorded")
    if checksum is not None and chunk_checksum(raw) != checksum:
        raise CorruptObjectError(name, "decoded to bytes whose checksum differs from the one recorded at commit")
    return out


def decode_checked(codec_id: str, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int,
                   checksum: str | None, object_id: str | None = None) -> np.ndarray:
    """`codec.decode` of one chunk, then its size and checksum checked.

    Args:
        codec_id: the codec the chunk was stored with (an unknown id is a CodecError, not damage).
        payload: the stored bytes.
        base: the decoded base chunk for a residual (it may be overwritten, as by `codec.decode`).
        params: the tensor's codec params.
        nbytes: the chunk's size when decoded.
        checksum: `hashing.chunk_checksum` recorded at commit, or None where none was recorded.
        object_id: names the object in errors ("payload" when not given).

    Returns:
        The decoded chunk (uint8), as `codec.decode` returns it.

    Raises:
        CorruptObjectError: the payload does not decode, decodes to the wrong size, or its checksum differs.
    """
    codec, name = get_codec(codec_id), object_id or "payload"
    out = _guarded(name, codec_id, lambda: codec.decode(payload, base, params, nbytes))
    return _verified(name, out, nbytes, checksum)


def decode_chain_checked(codec_id: str, payloads: list[bytes], params: dict[str, Any], nbytes: int,
                         checksum: str | None, object_id: str | None = None,
                         out: np.ndarray | None = None) -> np.ndarray:
    """A whole chain (newest payload first) decoded as `decode_checked` decodes one payload.

    Uses the codec's `decode_chain` where it has one, else decodes level by level. `object_id`
    should name the newest level's object; the checksum is the newest level's.
    """
    codec, name = get_codec(codec_id), object_id or "payload"
    chain = capabilities(codec_id).chain

    def level_by_level() -> np.ndarray:
        result = None
        for payload in reversed(payloads):
            result = codec.decode(payload, result, params, nbytes)
        if out is not None and result is not None:
            out[...] = result
            return out
        return result

    if not payloads:
        raise CorruptObjectError(name, "an empty chain")
    decode = (lambda: chain.decode_chain(payloads, params, nbytes, out)) if chain is not None else level_by_level
    return _verified(name, _guarded(name, codec_id, decode), nbytes, checksum)
