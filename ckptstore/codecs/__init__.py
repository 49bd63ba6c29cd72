"""Codec registry: one codec per file, registered here by its `codec_id`.

Each codec's optional capabilities (base.py) are checked once, at registration, and looked up
by id afterwards, so no other module probes codecs with hasattr.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptstore.codecs.base import ChainDecoder, Codec, DeclaresSize, LossyCodec, PlaneCodec, SteppedCodec
from ckptstore.codecs.bytegroup import ByteGroupCodec
from ckptstore.codecs.deadzone import DeadZoneCodec, capped, chunk_step
from ckptstore.codecs.floats import to_float32
from ckptstore.codecs.logmoment import LogMomentCodec
from ckptstore.codecs.normmoment import NormalizedMomentCodec
from ckptstore.errors import CodecError


@dataclass(frozen=True)
class Capabilities:
    """What a registered codec can do beyond the base contract."""

    chain: ChainDecoder | None
    chain_params: tuple[str, ...] | None
    planes: PlaneCodec | None
    lossy: LossyCodec | None
    stepped: SteppedCodec | None
    declares: DeclaresSize | None


REGISTRY: dict[str, Codec] = {}
CAPABILITIES: dict[str, Capabilities] = {}


def register(codec: Codec) -> Codec:
    """Make `codec` available under its id; ids are permanent once objects use them."""
    if not isinstance(codec, Codec):
        raise TypeError(f"{codec!r} does not implement the codec contract (codecs/base.py)")
    REGISTRY[codec.codec_id] = codec
    CAPABILITIES[codec.codec_id] = Capabilities(
        chain=codec if isinstance(codec, ChainDecoder) else None,
        chain_params=getattr(codec, "chain_params", None),
        planes=codec if isinstance(codec, PlaneCodec) else None,
        lossy=codec if isinstance(codec, LossyCodec) else None,
        stepped=codec if isinstance(codec, SteppedCodec) else None,
        declares=codec if isinstance(codec, DeclaresSize) else None,
    )
    return codec


def get_codec(codec_id: str) -> Codec:
    """The codec for `codec_id`, or a CodecError naming the ones known."""
    try:
        return REGISTRY[codec_id]
    except KeyError:
        raise CodecError(f"unknown codec {codec_id!r}; known: {', '.join(sorted(REGISTRY))}") from None


def capabilities(codec_id: str) -> Capabilities:
    """The optional capabilities of the codec registered as `codec_id`."""
    get_codec(codec_id)
    return CAPABILITIES[codec_id]


register(ByteGroupCodec())
register(DeadZoneCodec())
register(LogMomentCodec())
register(NormalizedMomentCodec())

# The lossy step rules and float view that a commit's pruning and error measurement share with the codecs.
__all__ = ["CAPABILITIES", "REGISTRY", "Capabilities", "Codec", "capabilities", "capped", "chunk_step", "get_codec",
           "register", "to_float32"]
