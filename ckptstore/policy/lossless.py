"""Per tensor: keyframe or residual against the parent, and the codec parameters to use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.errors import CkptError
from ckptstore.policy.chaincost import AUTO, ChainCosts, chain_limit
from ckptstore.records import TensorRecord

MAX_WIDTH = 255  # byte planes a lossless payload's header can name (one byte)

LOSSLESS_CODEC = "bytegroup"


@dataclass(frozen=True)
class EncodingSettings:
    """Repository-wide knobs that decide how tensors are encoded.

    `max_chain` is "auto" (the chain grows while checkout stays faster than torch.load, by measured
    decode costs: policy/chaincost.py) or a number, a hard cap on the chain's length.
    """

    max_chain: int | str = AUTO
    chunk_bytes: int = 4 << 20
    zstd_level: int = 1

    def __post_init__(self) -> None:
        value = self.max_chain
        if isinstance(value, str) and value.isascii() and value.isdigit():  # "²" is a digit to str, not to int
            object.__setattr__(self, "max_chain", int(value))
        elif value != AUTO and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise CkptError(f"max_chain must be {AUTO!r} or a count of levels (0 or more), not {value!r}; "
                            f"set [encoding] max_chain in .ckpt/config.toml or `ckpt init --max-chain`")
        for name, low, high in (("chunk_bytes", 1, 1 << 40), ("zstd_level", -(1 << 17), 22)):  # zstd's own range
            number = getattr(self, name)
            if not isinstance(number, int) or isinstance(number, bool) or not low <= number <= high:
                raise CkptError(f"[encoding] {name} must be an integer from {low} to {high}, not {number!r}")


@dataclass
class EncodePlan:
    """What the writer does with one new tensor."""

    codec: str
    params: dict[str, Any]
    base: TensorRecord | None
    limit: int = 0  # the longest chain this tensor may have: the next commit chains on it while depth < limit


def plan_tensor(dtype: str, nbytes: int, itemsize: int, parent: TensorRecord | None,
                settings: EncodingSettings, costs: dict[int, ChainCosts] | None = None,
                anchor: TensorRecord | None = None) -> EncodePlan:
    """Residual against the parent's tensor when it has the same layout and the chain has room.

    The room is `chain_limit`: the user's `max_chain`, or with "auto" what `costs` (measured decode
    and torch.load times per element width) allow. A parent already at the limit is not the end of
    the chain: the residual goes against the parent's own base (`anchor`, one level down), so
    every later commit restores at the same depth, until the cycle's bytes say a keyframe pays
    again (`_rekey`).

    Rebuilding the parent costs about as much as encoding, so a tensor whose last residual attempt
    did not pay (Adam's first moment, typically) skips the attempt for a while: 1, 2, then 4
    commits after each consecutive miss, then tries again.
    """
    width = itemsize if 0 < itemsize <= MAX_WIDTH else 1  # numpy's wide records (a <U300) and empty ones as bytes
    chunk_bytes = max(itemsize, settings.chunk_bytes // max(itemsize, 1) * max(itemsize, 1))
    params: dict[str, Any] = {"width": width, "level": settings.zstd_level, "chunk_bytes": chunk_bytes}
    limit = chain_limit(settings.max_chain, width, costs)
    base = parent if parent is not None and limit >= 1 and nbytes > 0 and _same_layout(parent, dtype, nbytes) else None
    if base is not None and base.depth + 1 > limit:
        base = anchor if (anchor is not None and anchor.id == base.base_id and anchor.depth == limit - 1
                          and _same_layout(anchor, dtype, nbytes) and not _rekey(base)) else None
    if base is None:
        return EncodePlan(LOSSLESS_CODEC, params, None, limit)
    params["chunk_bytes"] = int(base.params["chunk_bytes"])
    misses = int(parent.params.get("residual_misses", 0))
    wait = int(parent.params.get("residual_wait", 0))
    if wait > 0:
        params.update(residual_misses=misses, residual_wait=wait - 1)
        return EncodePlan(LOSSLESS_CODEC, params, None, limit)
    params["residual_misses"] = misses
    params["cycle"] = list(parent.params.get("cycle") or [parent.stored_bytes, 1])
    if parent.depth >= 1 and "plane_modes" in parent.params:  # the parent chose between XOR and not
        params["plane_hints"] = parent.params["plane_modes"]
    return EncodePlan(LOSSLESS_CODEC, params, base, limit)


def _same_layout(record: TensorRecord, dtype: str, nbytes: int) -> bool:
    """Whether a new tensor of `dtype` and `nbytes` may be coded against `record` bit for bit."""
    return record.codec == LOSSLESS_CODEC and record.dtype == dtype and record.raw_bytes == nbytes


def _rekey(parent: TensorRecord) -> bool:
    """Whether the tensor should start a new keyframe instead of another residual on `parent`'s base.

    A cycle (a keyframe and the residuals since) costs its bytes over its commits. Residuals on an
    aging base grow as training drifts, so once the last one is larger than the cycle's average,
    a new cycle lowers the average. Records without the cycle's figures (written before them)
    keyframe at the limit, as chains used to.
    """
    cycle = parent.params.get("cycle")
    if not cycle:
        return True
    total, commits = cycle
    return parent.stored_bytes * commits > total


def cycle_after(params: dict[str, Any], stored: int, residual: bool) -> list[int]:
    """The cycle figures of a new lossless record: its bytes added to the parent's, or a new cycle."""
    if not residual or "cycle" not in params:
        return [stored, 1]
    total, commits = params["cycle"]
    return [int(total) + stored, int(commits) + 1]


def after_attempt(params: dict[str, Any], residual_paid: bool) -> dict[str, Any]:
    """Record whether a residual attempt paid, which sets how long the next attempts wait."""
    if residual_paid:
        return {k: v for k, v in params.items() if k not in ("residual_misses", "residual_wait")}
    misses = int(params.get("residual_misses", 0)) + 1
    return dict(params, residual_misses=misses, residual_wait=min(2 ** (misses - 1), 4))


def chunk_sizes(nbytes: int, chunk_bytes: int) -> list[int]:
    """Split `nbytes` into chunks of `chunk_bytes` (the last may be shorter); one empty chunk for 0."""
    if nbytes == 0:
        return [0]
    full, rest = divmod(nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])
