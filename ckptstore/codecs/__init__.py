"""Codec registry: one codec per file, registered here by its `codec_id`."""

from __future__ import annotations

from ckptstore.codecs.base import Codec
from ckptstore.codecs.bytegroup import ByteGroupCodec
from ckptstore.codecs.deadzone import DeadZoneCodec
from ckptstore.codecs.logmoment import LogMomentCodec
from ckptstore.codecs.normmoment import NormalizedMomentCodec
from ckptstore.errors import CodecError

REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Make `codec` available under its id; ids are permanent once objects use them."""
    REGISTRY[codec.codec_id] = codec
    return codec


def get_codec(codec_id: str) -> Codec:
    """The codec for `codec_id`, or a CodecError naming the ones known."""
    try:
        return REGISTRY[codec_id]
    except KeyError:
        raise CodecError(f"unknown codec {codec_id!r}; known: {', '.join(sorted(REGISTRY))}") from None


register(ByteGroupCodec())
register(DeadZoneCodec())
register(LogMomentCodec())
register(NormalizedMomentCodec())

__all__ = ["Codec", "get_codec", "register", "REGISTRY"]
