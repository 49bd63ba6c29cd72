"""Lossy codec for weights: dead-zone uniform quantization, then entropy coding.

It quantizes the tensor itself (keyframe) or its residual against the base's reconstruction
(closed loop).

Small residuals fall in the dead zone and become exact zeros, which the entropy coder makes nearly
free; a residual skipped now is still there against the reconstruction next time, so the error of
any reconstruction stays below one step however long the chain. Params: dtype, step (absolute),
rounding (0.5 rounds to nearest; less widens the dead zone, except where relative_step caps the
step), relative_step (residual steps at most
this fraction of the residual's RMS), fine_below and base_error (apply relative_step only where the
weights moved less than fine_below since the parent; see chunk_step), settled_step (the fraction
once the parent's error is below the movement), grid_step (the base chunk's step, kept), tighten
(< 1: the writer's retry at a finer step, rounding to nearest, to meet a level's error bound).
Layout: b"DZ2", has-base flag (u8), the chunk's step (f32), then the entropy-coded symbols.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from ckptstore.codecs import codebook
from ckptstore.codecs.base import LevelsNeeded
from ckptstore.codecs.entropy import decode_sparse, decode_symbols, encode_symbols, symbol_count
from ckptstore.codecs.floats import from_float32, itemsize, overflows, round_to_bfloat16, rounding_error, to_float32
from ckptstore.errors import CodecError, NonFiniteError, UnquantizableError

MAGIC, MAGIC_V1 = b"DZ2", b"DZ1"
_HEAD = struct.Struct("<3sBf")
_HEAD_V1 = struct.Struct("<3sB")
# Every payload layout `decode`/`decode_chain` accept (magic: keyframe or residual); tests/fixtures
# holds one of each, forever.
DECODES = ("DZ1:keyframe", "DZ1:residual", "DZ2:keyframe", "DZ2:residual", "CB1:keyframe", "CB1:residual",
           "chain")


def quantize(values: np.ndarray, step: float, rounding: float) -> np.ndarray:
    """Signed integer levels with a dead zone: |v| < (1 - rounding) * step maps to 0.

    Values 2^31 steps or more from zero have no int32 level (a step far finer than the values,
    such as a first moment over a second moment that underflowed to zero): refused, not wrapped.
    """
    levels = np.floor(np.abs(values) / np.float32(step) + np.float32(rounding))
    if levels.size and not levels.max() < 2.0**31:
        if not math.isfinite(step):  # a sharded save: the whole tensor's statistics, some other rank's NaN
            raise UnquantizableError(f"its step is {step} (the whole tensor holds NaN or inf)")
        if not np.isfinite(values).all():  # its own values are finite (checked first): the parent's are not
            raise UnquantizableError("its residual against the parent holds NaN or inf (the parent's values do, "
                                     "or their difference passes float32)")
        raise UnquantizableError(f"values up to {float(np.abs(values).max()):.3g} are 2^31 or more steps of "
                                 f"{step:.3g}: no integer level holds them")
    return (np.sign(values) * levels).astype(np.int32)


def finite(rebuilt: np.ndarray, dtype: str) -> np.ndarray:
    """`rebuilt` (a float32 reconstruction of finite values), refused if it overflows `dtype`."""
    if overflows(rebuilt, dtype):
        raise UnquantizableError(f"the reconstruction overflows {dtype.removeprefix('torch.')} "
                                 "(values near its largest)")
    return rebuilt


def dequantize(levels: np.ndarray, step: float) -> np.ndarray:
    with np.errstate(over="ignore"):  # encoders refuse what overflows (finite()); nothing stored does
        return levels.astype(np.float32) * np.float32(step)


def _reconstruct(levels: np.ndarray, base: np.ndarray | None, step: float, dtype: str) -> np.ndarray:
    return _rebuild(dequantize(levels, step), base, dtype, encoding=True)


def _rebuild(update: np.ndarray, base: np.ndarray | None, dtype: str, encoding: bool = False) -> np.ndarray:
    """The float32 `update` (a keyframe's values, or a residual added to `base`) rounded to `dtype`.

    `encoding`: refuse a reconstruction that overflowed, so that none is ever stored.
    """
    if base is not None:
        update = to_float32(base, dtype) + update
    return from_float32(finite(update, dtype) if encoding else update, dtype)


def chunk_step(target: np.ndarray, params: dict[str, Any], residual: bool) -> float:
    """The step for one chunk: the planned step, or finer when a residual is small against it.

    Fine-tuning moves weights by a tiny fraction of their spread; with `relative_step` a residual
    step never exceeds that fraction of the residual's own RMS, so small updates are tracked
    instead of vanishing in the dead zone. With `fine_below` that cap applies only where the
    weights moved less than it (an absolute RMS) since the parent: a residual is the parent's
    quantization error (RMS `base_error`, measured when the parent was stored) plus the movement,
    two nearly independent parts, so the movement's RMS is sqrt(rms^2 - base_error^2). Training
    from scratch moves weights far enough that the closed loop tracks them at the planned step.
    With `settled_step`, that fraction replaces relative_step once the parent's error is below the
    movement: the reconstruction has caught up with the run (after a keyframe it first refines
    at relative_step) and only has to follow it. With `grid_step` (the base chunk's own capped
    step, see writer._lattice_step) the chunk keeps that step instead: the reconstruction stays on
    the base's lattice, so entries that did not move quantize to exact zeros, the error stays
    below half a step however long the chain, and a move is coded as the lattice lines it crossed.
    """
    step = float(params["step"])
    relative = params.get("relative_step")
    if residual and relative and target.size:
        rms = float(np.sqrt(np.mean(target.astype(np.float64) ** 2)))
        fine_below = params.get("fine_below")
        base_error = float(params.get("base_error", 0.0))
        moved = np.sqrt(max(0.0, rms * rms - base_error * base_error))
        if rms > 0 and (fine_below is None or moved < fine_below):
            settled, lattice = params.get("settled_step"), params.get("grid_step")
            if lattice:  # the base chunk's refined step: stay on its lattice
                return float(np.float32(min(step, lattice)))
            step = min(step, (settled if settled and moved >= base_error else relative) * rms)
    return float(np.float32(step))


def capped(step: float, params: dict[str, Any]) -> bool:
    """Whether a chunk's step is finer than planned: `chunk_step` capped it for a small residual."""
    return step < np.float32(params["step"])


class DeadZoneCodec:
    """Dead-zone uniform quantizer for float tensors (keyframes and closed-loop residuals)."""

    codec_id = "deadzone"
    chain_params = ("dtype",)  # each payload carries its own step

    def encode_lossy(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
                     hints: dict[str, Any] | None = None) -> tuple[bytes, np.ndarray]:
        values = to_float32(data, params["dtype"])
        if not np.isfinite(values).all():
            raise NonFiniteError("deadzone: non-finite values cannot be quantized")
        if base is None:
            target = values
        else:
            with np.errstate(over="ignore"):  # a difference past float32 is refused below, by name, not warned of
                target = values - to_float32(base, params["dtype"])
        step = chunk_step(target, params, base is not None)
        # A capped step tracks a fine-tune's small, steady updates: a wider dead zone would hold
        # them back every time, a lag in the direction of training, so it rounds to nearest.
        rounding = 0.5 if capped(step, params) else params.get("rounding", 0.5)
        if params.get("tighten", 1.0) < 1.0:  # the writer's retry to meet the level's error bound
            step, rounding = float(np.float32(step * params["tighten"])), 0.5
        levels = quantize(target, step, rounding)
        pruned = hints is not None and hints.get("prune") is not None
        if pruned:
            levels[hints["prune"]] = 0
        payload = _HEAD.pack(MAGIC, base is not None, step) + encode_symbols(levels)
        if params.get("codebooks") and not pruned:  # the alternative of codebook.py, at no larger error
            error_sq = float(np.sum((dequantize(levels, step) - target).astype(np.float64) ** 2))
            bound = step * max(rounding, 1 - rounding)  # the most a dead-zone level is off by
            alternative = codebook.try_encode(target, error_sq, bound, len(payload), base is not None, step)
            if alternative is not None:
                payload, update = alternative
                return payload, _rebuild(update, base, params["dtype"], encoding=True)
        return payload, _reconstruct(levels, base, step, params["dtype"])

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        return self.encode_lossy(data, base, params)[0]

    @staticmethod
    def error_bound(data: np.ndarray, base: np.ndarray | None, rebuilt: np.ndarray,
                    params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(|reconstruction - value|, the bound it keeps) per entry, for chunks encoded without prune hints.

        The bound: step * max(rounding, 1 - rounding) (a dead-zone level, or the codebook that
        replaced it, is never off by more; a capped step is finer and rounds to nearest), plus the
        rounding to the dtype and float32's in the residual's subtraction.
        """
        dtype = params["dtype"]
        values, got = to_float32(data, dtype).astype(np.float64), to_float32(rebuilt, dtype).astype(np.float64)
        rounding = float(params.get("rounding", 0.5))
        quantized = float(np.float32(params["step"])) * max(rounding, 1 - rounding)
        arithmetic = rounding_error(values, "torch.float32") * 4  # target = values - base, update + base
        return np.abs(got - values), quantized * (1 + 2.0**-20) + rounding_error(got, dtype) + arithmetic

    def needs_base(self, payload: bytes) -> bool:
        return bool(self._head(payload, {})[0])

    def step_of(self, payload: bytes) -> float:
        """The step a chunk was quantized with (finer than planned where `relative_step` capped it)."""
        return self._head(payload, {})[1]

    def _head(self, payload: bytes, params: dict[str, Any]) -> tuple[int, float, int]:
        """(has base, step, header size); version 1 kept its step in the params; codebook payloads: size 0."""
        if codebook.is_codebook(payload):
            return (*codebook.head(payload), 0)
        if len(payload) >= _HEAD.size and payload[:3] == MAGIC:
            _, has_base, step = _HEAD.unpack_from(payload)
            return has_base, step, _HEAD.size
        if len(payload) >= _HEAD_V1.size and payload[:3] == MAGIC_V1:
            return _HEAD_V1.unpack_from(payload)[1], params.get("step", 0.0), _HEAD_V1.size
        raise CodecError("deadzone: payload does not start with a valid header")

    def declared_bytes(self, payload: bytes | memoryview, params: dict[str, Any]) -> tuple[int, int] | None:
        """The raw size `payload` says it decodes to: its symbol stream's count (one per value) times the dtype's size.

        Every layout (DZ1, DZ2, CB1) holds one symbol per value, so a record claiming far more bytes than
        its payload decodes to is refused before its buffer is taken (replay.py), as a lossless one is.
        """
        try:
            header = self._head(payload, {})[2] or codebook.stream_start(payload)
        except CodecError:  # no payload of ours: it does not say
            return None
        return stream_declares(payload, header, params)

    def decode_chain(self, payloads: list[bytes], params: dict[str, Any], nbytes: int,
                     out: np.ndarray | None = None) -> np.ndarray:
        """A whole chain (newest payload first) accumulated in one float32 buffer.

        Bit for bit what level-by-level decoding gives: float32 adds in the same order, rounded
        to the tensor's dtype after each level as the encoder did.
        """
        dtype = params["dtype"]
        values, count = None, nbytes // itemsize(dtype)
        if any(payload[:3] == MAGIC_V1 for payload in payloads[1:]):
            raise LevelsNeeded("deadzone: a version-1 level below the newest kept its step in its own record")
        for position, payload in enumerate(reversed(payloads)):
            has_base, step, header = self._head(payload, params)
            if has_base != (values is not None):
                raise CodecError("deadzone: chain does not start at a keyframe")
            body = memoryview(payload)[header:]
            sparse = decode_sparse(body, np.float32, count) if values is not None and header else None
            if not header:  # a codebook payload
                update = self._sized(codebook.decode_update(payload, count), count)
                values = update if values is None else values + update
            elif sparse is not None and sparse.common == 0 and sparse.count == values.size:
                if dtype != "torch.float32":
                    values += np.float32(0)  # a rounding's -0.0 becomes +0.0, as adding a zero level makes it
                values[sparse.positions] += sparse.values * np.float32(step)  # other levels are zero
            else:
                update = self._sized(decode_symbols(body, np.float32, count), count)
                update *= np.float32(step)
                if values is None:
                    values = update
                else:
                    values += update
            if position < len(payloads) - 1:  # the last rounds below
                if dtype == "torch.bfloat16":
                    round_to_bfloat16(values)
                elif dtype != "torch.float32":
                    values = to_float32(from_float32(values, dtype), dtype)
        if values is None or values.size * itemsize(dtype) != nbytes:
            raise CodecError(f"deadzone: chain decoded to the wrong size, expected {nbytes} bytes")
        result = from_float32(values, dtype)
        if out is None:
            return result
        out[...] = result
        return out

    @staticmethod
    def _sized(update: np.ndarray, count: int) -> np.ndarray:
        if update.size != count:  # before it meets the other levels, whose size is the chunk's
            raise CodecError(f"deadzone: payload holds {update.size} values, expected {count}")
        return update

    def decode(self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int) -> np.ndarray:
        has_base, step, header = self._head(payload, params)
        if has_base and (base is None or base.size != nbytes):
            raise CodecError("deadzone: residual chunk decoded without its base")
        count = nbytes // itemsize(params["dtype"])
        if not header:  # a codebook payload
            update = codebook.decode_update(payload, count)
        else:
            update = dequantize(decode_symbols(memoryview(payload)[header:], limit=count), step)
        out = _rebuild(self._sized(update, count), base if has_base else None, params["dtype"])
        if out.size != nbytes:
            raise CodecError(f"deadzone: decoded {out.size} bytes, expected {nbytes}")
        return out


def stream_declares(payload: bytes | memoryview, start: int, params: dict[str, Any]) -> tuple[int, int] | None:
    """The raw bytes a payload whose symbol stream (one symbol per value) starts at `start` decodes to, twice.

    None where the stream or the record's dtype does not say (a damaged record's params).
    """
    try:
        size = itemsize(params["dtype"])
    except (KeyError, TypeError):
        return None
    values = symbol_count(memoryview(payload)[start:])
    return None if values is None else (values * size, values * size)
