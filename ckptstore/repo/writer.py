"""The encoding half of a commit: new tensors become chunk objects, in parallel.

This is step 1 of the write path in DESIGN.md: no metadata is written until it is done. Each job
encodes one tensor chunk by chunk on the pool. A lossy job's reconstruction (what checkout will
return) names it; a first moment is coded against its second moment's reconstruction, and the
moments may follow the pruning mask of their weight, so jobs are submitted weights first, then
second moments, then first moments, and a chunk waits only for chunks submitted before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import numpy as np

from ckptstore.codecs import capabilities, capped, chunk_step, get_codec, to_float32
from ckptstore.codecs.planes import group
from ckptstore.errors import CorruptObjectError, NonFiniteError, UnquantizableError, UnquantizableTensorsError
from ckptstore.hashing import ObjectId, TensorId, chunk_checksum, tensor_id_of_parts
from ckptstore.objectstore.base import put_parts
from ckptstore.objectstore.pack import PACK_BELOW, PackSlot, PackWriter
from ckptstore.policy import (
    ChainCosts,
    EncodingSettings,
    after_attempt,
    chunk_sizes,
    cycle_after,
    fidelity,
    plan_tensor,
)
from ckptstore.records import Chunk, TensorRecord
from ckptstore.replay import ChainSource
from ckptstore.repo.planecache import PlaneCache
from ckptstore.state import RawTensor

SMALL_CHUNK = 64 << 10  # lossless tensors up to this size are encoded in batches (see _submit)
BATCH_BYTES = 1 << 20
JOIN_BELOW = 64 << 10  # larger payloads' raw planes are the plane cache's arrays too: joined, they were held twice


@dataclass
class Job:
    """One tensor to encode."""

    key: str
    raw: RawTensor
    codec: str
    params: dict
    base: TensorRecord | None = None
    sibling: str | None = None
    mask_from: str | None = None
    importance: RawTensor | None = None
    prune: float = 0.0
    stage: int = 0
    known_id: TensorId | None = None
    paced_by: str | None = None  # a first moment's weight: its "fine_step" applies where that weight's step was capped
    reference: RawTensor | None = None  # a first moment's original second moment: its update's scale
    keep_planes: bool = False  # lossless: the next commit may code against this tensor (repo/planecache.py)
    keep_base: bool = False  # lossless at its chain's limit: the next commit codes against the same base again


@dataclass
class ChunkResult:
    object_id: ObjectId | None  # None until its pack is written
    stored: int
    needs_base: bool
    recon: np.ndarray | None = None
    mask: np.ndarray | None = None
    error_sq: float = 0.0  # lossy: in the quantity of the level's promise (policy/fidelity.py)
    norm_sq: float = 0.0
    payload: list[bytes | memoryview] | None = None  # kept for a pack, as consecutive parts
    slot: PackSlot | None = None  # where in a pack it went (object_id is the pack's once written)
    modes: list[int] | None = None  # lossless: how each byte plane was stored
    capped: bool = False  # lossy: quantized finer than planned (the tensor barely moved since its base)
    step: float | None = None  # lossy: the step the chunk was quantized with, where its codec has one
    checksum: str | None = None  # of what checkout will decode: the data, or a lossy chunk's reconstruction


def _stored(source: ChainSource, parts: list[bytes | memoryview], length: int
            ) -> tuple[ObjectId | None, list | None]:
    """Write a large payload (consecutive parts, `length` bytes) as its own object now; keep a small one for a pack."""
    if length < PACK_BELOW:  # a tiny one's planes joined: each view kept its array and ~200 B alive until packed
        return None, [b"".join(parts)] if len(parts) > 1 and length < JOIN_BELOW else parts
    return put_parts(source.store, parts), None


def _prune_mask(job: Job, params: dict, data: np.ndarray, base: np.ndarray | None,
                start: int) -> np.ndarray | None:
    """Residual entries whose estimated loss impact |dW|^2 * sqrt(v) is in the lowest `prune` fraction.

    None where the residual step is capped (see chunk_step): a fine-tune's small updates all count.
    """
    if job.prune <= 0 or base is None or job.importance is None:
        return None
    dtype = params["dtype"]
    with np.errstate(over="ignore"):  # a difference past float32 is refused by chunk_step below, by name
        delta = to_float32(data, dtype) - to_float32(base, dtype)
    if capped(chunk_step(delta, params, residual=True), params):
        return None  # a fine-tune-sized move, quantized finer than planned: its updates are the signal
    count = delta.size
    width = job.importance.itemsize
    v = to_float32(job.importance.data[start // job.raw.itemsize * width:][: count * width], job.importance.dtype)
    with np.errstate(over="ignore"):  # an infinite impact is only the largest: it is kept
        impact = delta * delta * np.sqrt(v)
    cut = int(job.prune * count)
    if cut <= 0:
        return None
    threshold = np.partition(impact, cut - 1)[cut - 1]
    return impact <= threshold


def _base_planes(job: Job, source: ChainSource, index: int, start: int, size: int,
                 cache: PlaneCache | None) -> list[np.ndarray] | None:
    """The base's planes of chunk `index`: kept by the commit that encoded them, else replayed from the store."""
    if job.base is None:
        return None
    keep = cache is not None and job.keep_base
    planes = cache.take(job.base.id, start, int(job.params["width"]), size, keep) if cache is not None else None
    if planes is None:
        planes = source.replay_planes(job.base, index)
        if keep and planes is not None:
            cache.put(job.base.id, start, np.stack(planes))
    return planes


def _encode_chunk(job: Job, source: ChainSource, index: int, start: int, size: int,
                  waits: dict[str, list[Future]], cache: PlaneCache | None = None) -> ChunkResult:
    codec, able = get_codec(job.codec), capabilities(job.codec)
    data = np.ascontiguousarray(job.raw.data[start : start + size])
    if able.lossy is None:
        planes = _base_planes(job, source, index, start, size, cache) if able.planes is not None else None
        base = (source.replay_chunk(job.base, index, np.empty(size, dtype=np.uint8))
                if job.base is not None and planes is None else None)  # a base of another codec
        hints = job.params.get("plane_hints")
        params = dict(job.params, plane_hints=hints[index]) if hints and len(hints) > index else job.params
        if able.planes is not None and base is None:
            grouped = group(data, int(params["width"]))
            parts, modes = able.planes.encode_grouped_parts(grouped, planes, params)
            if cache is not None and job.keep_planes:
                cache.put(job.known_id, start, grouped)
        else:
            payload = codec.encode(data, base, params, base_planes=planes)
            parts, modes = [payload], able.planes.plane_modes(payload) if able.planes is not None else None
        length = sum(len(part) for part in parts)
        oid, kept = _stored(source, parts, length)
        # parts[0] holds every plane header (all that needs_base reads) or is the whole payload
        return ChunkResult(oid, length, job.base is not None and codec.needs_base(parts[0]),
                           payload=kept, modes=modes, checksum=chunk_checksum(data))
    return _encode_lossy_chunk(job, source, index, start, data, waits)


def _encode_lossy_chunk(job: Job, source: ChainSource, index: int, start: int, data: np.ndarray,
                        waits: dict[str, list[Future]]) -> ChunkResult:
    """A lossy chunk, encoded again at finer steps until it keeps its level's bound (policy/fidelity.py)."""
    able = capabilities(job.codec)
    base = None
    if job.sibling is not None:
        base = waits[job.sibling][index].result().recon
    elif job.base is not None:
        base = source.replay_chunk(job.base, index, np.empty(data.size, dtype=np.uint8))
    params = _chunk_base_error(job, index, job.params)
    lattice = _lattice_step(job, index)
    if lattice is not None:
        params = dict(params, grid_step=lattice)
    mask = _prune_mask(job, params, data, base, start) if job.stage == 0 else None
    if job.mask_from is not None:
        mask = waits[job.mask_from][index].result().mask
    if job.paced_by is not None and _weight_capped(job, index, waits[job.paced_by]):
        params = dict(params, step=params["fine_step"])
    v = _reference_chunk(job, start, data.size)
    bound, tighten, attempt = params.get("max_error"), 1.0, 0
    while True:
        hints = {"prune": mask, "v": v}
        payload, recon = able.lossy.encode_lossy(data, base, dict(params, tighten=tighten) if attempt else params,
                                                 hints)
        error_sq, norm_sq = hints.get("update_error") or fidelity.chunk_error(job.codec, data, recon, params, v, base)
        step = able.stepped.step_of(payload) if able.stepped is not None else None
        if attempt == 0:  # the plan's own step: whether it was capped for a barely moving tensor
            was_capped = step is not None and capped(step, params)
        if fidelity.within(error_sq, norm_sq, bound):
            bulk = fidelity.bulk_error(job.codec, data, recon, params, bound, norm_sq)
            if bulk is None or fidelity.within(*bulk, bound):
                break
            error_sq, norm_sq = bulk  # outliers held the norm: retry at the step the rest needs
        if attempt == fidelity.MAX_TIGHTEN:
            raise UnquantizableError(f"{job.key}: chunk {index} cannot keep its level's error bound {bound:.3g} "
                             f"(relative error {math.sqrt(error_sq / norm_sq) if norm_sq else math.inf:.3g})")
        if mask is not None:  # pruning is what a finer step cannot undo
            mask = None
        else:
            tighten = fidelity.finer(tighten, error_sq, norm_sq, bound)
        attempt += 1
    oid, kept = _stored(source, [payload], len(payload))
    return ChunkResult(oid, len(payload), get_codec(job.codec).needs_base(payload), recon, mask, error_sq, norm_sq,
                       payload=kept, capped=was_capped, checksum=chunk_checksum(recon), step=step)


def _reference_chunk(job: Job, start: int, count_bytes: int) -> np.ndarray | None:
    """The original second moment under a first moment's chunk (its update's scale), else None."""
    if job.reference is None:
        return None
    first = start // job.raw.itemsize
    width = job.reference.itemsize
    return np.ascontiguousarray(job.reference.data[first * width : (first + count_bytes // job.raw.itemsize) * width])


def _chunk_base_error(job: Job, index: int, params: dict) -> dict:
    """`params` with the base's own error in this chunk (RMS, where the base kept it per chunk).

    The fine-tune rules take a residual's movement as sqrt(rms^2 - base_error^2) (deadzone.chunk_step),
    a difference of two near-equal figures: against the tensor's average error, a chunk whose base
    error was a few percent above it read that as movement and kept the coarse planned step, whose
    dead zone then held the fine-tune's updates back for the rest of the chain (MiniLM's word
    embeddings at `extreme`: its eval loss off by up to 6%).
    """
    errors = job.base.params.get("chunk_errors") if job.base is not None and "base_error" in params else None
    return dict(params, base_error=errors[index]) if errors and index < len(errors) else params


def _lattice_step(job: Job, index: int) -> float | None:
    """With `fine_grid`, the step of the base's chunk where that chunk was capped (refined), else None.

    A keyframe's chunks and uncapped residuals keep their planned steps, so the first fine-tune
    residual after them refines at relative_step; later ones reuse its step (see chunk_step).
    """
    if not job.params.get("fine_grid") or job.base is None:
        return None
    steps = job.base.params.get("chunk_steps")
    if not steps or len(steps) <= index or "step" not in job.base.params:
        return None
    return steps[index] if capped(steps[index], job.base.params) else None


def _weight_capped(job: Job, index: int, weight_chunks: list[Future]) -> bool:
    """Whether the weight pacing this moment chunk was coded finer than planned.

    Its own chunk when both are chunked alike, else any of its chunks.
    """
    if len(weight_chunks) == len(chunk_sizes(job.raw.nbytes, job.params["chunk_bytes"])):
        return weight_chunks[index].result().capped
    return any(chunk.result().capped for chunk in weight_chunks)


class _Part:
    """One chunk's result out of a batch task's list, read like a Future."""

    def __init__(self, batch: Future, index: int) -> None:
        self.batch, self.index = batch, index

    def result(self) -> ChunkResult:
        return self.batch.result()[self.index]


def _encode_batch(batch: list[tuple[Job, int]], source: ChainSource, waits: dict[str, list[Future]],
                  cache: PlaneCache | None) -> list[ChunkResult]:
    """Several small single-chunk lossless jobs in one task, in order."""
    return [_encode_chunk(job, source, 0, 0, size, waits, cache) for job, size in batch]


def _submit(ordered: list[Job], sizes: dict[str, list[int]], source: ChainSource, pool: Executor,
            cache: PlaneCache | None) -> dict[str, list[Future | _Part]]:
    """Submit every chunk; small lossless tensors go in batches of about BATCH_BYTES, one task each.

    A task per bias or norm cost more in futures and thread hand-offs than its encoding. Lossy
    chunks, which may wait on each other, each keep a task of their own; payloads are the same
    either way, and `encode_jobs` packs them in job order.
    """
    futures: dict[str, list[Future | _Part]] = {}
    batch: list[tuple[Job, int]] = []

    filled = 0  # bytes in `batch`

    def flush() -> None:
        nonlocal filled
        if batch:
            done = pool.submit(_encode_batch, list(batch), source, futures, cache)
            for index, (job, _) in enumerate(batch):
                futures[job.key] = [_Part(done, index)]
            batch.clear()
            filled = 0

    for job in ordered:
        chunks = sizes[job.key]
        if job.known_id is not None and len(chunks) == 1 and chunks[0] <= SMALL_CHUNK:
            batch.append((job, chunks[0]))
            filled += chunks[0]
            if filled >= BATCH_BYTES:
                flush()
            continue
        futures[job.key], start = [], 0
        for index, size in enumerate(chunks):
            futures[job.key].append(pool.submit(_encode_chunk, job, source, index, start, size, futures, cache))
            start += size
    flush()
    return futures


def encode_jobs(jobs: list[Job], source: ChainSource, pool: Executor,
                on_bytes: Callable[[int], None] | None = None, cache: PlaneCache | None = None,
                remeasured: dict[str, list] | None = None
                ) -> tuple[dict[str, TensorRecord], dict[ObjectId, int]]:
    """Encode every job's chunks on `pool`; return the new records by job key and each object's size.

    With `cache`, lossless chunks take their base's planes from it and leave their own for the next commit.
    `remeasured` gets [error, bound, codec] of this encoding by job key where a lossy tensor restores as a record
    made before (its change rounded to nothing): that record keeps the figures of its own commit.
    """
    ordered = sorted(jobs, key=lambda j: j.stage)
    sizes = {job.key: chunk_sizes(job.raw.nbytes, job.params["chunk_bytes"]) for job in ordered}
    futures = _submit(ordered, sizes, source, pool, cache)
    results_of, ids, repeats = _packed_results(ordered, futures, PackWriter(source.store), on_bytes)
    if cache is not None:
        cache.next_commit()
    records: dict[str, TensorRecord] = {}
    by_id: dict[TensorId, TensorRecord] = {}
    object_sizes: dict[ObjectId, int] = {}
    for job in ordered:
        results, tid = results_of[job.key], ids[job.key]
        uses_base = any(r.needs_base for r in results)
        params = dict(job.params)
        if job.known_id is not None:
            params.pop("plane_hints", None)
            if job.base is not None:
                params = after_attempt(params, uses_base)
                params["plane_modes"] = [r.modes for r in results]
            params["cycle"] = cycle_after(params, sum(r.stored for r in results), uses_base)
        else:
            params.update(_lossy_measured(job, results, sizes[job.key]))
        base = None
        if uses_base:
            base = records[job.sibling] if job.sibling is not None else job.base
        if job.key in repeats:  # the same reconstruction as a record made before (all-zero m and v): that one
            same = by_id.get(tid) or base  # names it; a second record of the id could be based on the first: a loop
            records[job.key] = same
            figures = [params.get("rel_error"), params.get("max_error")]
            if remeasured is not None and job.known_id is None and figures != [same.params.get("rel_error"),
                                                                                same.params.get("max_error")]:
                remeasured[job.key] = [*figures, job.codec]
            continue
        for r in results:
            oid, end = (r.slot.object_id, r.slot.offset + r.stored) if r.slot else (r.object_id, r.stored)
            object_sizes[oid] = max(object_sizes.get(oid, 0), end)
        records[job.key] = by_id[tid] = TensorRecord(
            id=tid, dtype=job.raw.dtype, shape=job.raw.shape, codec=job.codec, params=params,
            base_id=base.id if base else None, depth=base.depth + 1 if base else 0,
            raw_bytes=job.raw.nbytes, stored_bytes=sum(r.stored for r in results),
            chunks=[_chunk(r, size) for r, size in zip(results, sizes[job.key])],
        )
    return records, object_sizes


def _packed_results(ordered: list[Job], futures: dict[str, list[Future]], packer: PackWriter,
                    on_bytes: Callable[[int], None] | None
                    ) -> tuple[dict[str, list[ChunkResult]], dict[str, TensorId], set[str]]:
    """Each job's chunk results, in order, and its tensor id; small payloads written to packs.

    A job whose tensor id an earlier job or its own base already has (a lossy change rounded to
    nothing, all-zero moments) is a repeat: its record is that one, and its payloads go nowhere.
    A lossy tensor its level cannot quantize does not stop the others: UnquantizableTensorsError names
    every such one, so the commit encodes once more with all of them lossless (commit.py).
    """
    results_of: dict[str, list[ChunkResult]] = {}
    ids: dict[str, TensorId] = {}
    fresh: set[TensorId] = set()  # the ids of the jobs that make records
    repeats: set[str] = set()
    unquantizable: dict[str, str] = {}
    raised: set[int] = set()  # a job coded with a failed one re-raises its error: named once, by its own job
    damaged: CorruptObjectError | None = None
    for job in ordered:
        try:
            results_of[job.key] = [f.result() for f in futures[job.key]]
        except NonFiniteError:
            raise  # a diverged run: the whole checkpoint is kept lossless
        except CorruptObjectError as exc:  # a base's object: raised once every task is done (the commit encodes again)
            damaged = damaged or exc
            continue
        except UnquantizableError as exc:
            if id(exc) not in raised:
                raised.add(id(exc))
                unquantizable[job.key] = str(exc)
            continue
        results = results_of[job.key]
        ids[job.key] = tid = job.known_id or tensor_id_of_parts(job.raw.dtype, job.raw.shape,
                                                                 [r.recon for r in results])
        base_id = ids.get(job.sibling) if job.sibling is not None else job.base.id if job.base else None
        if tid in fresh or (base_id == tid and any(r.needs_base for r in results)):
            repeats.add(job.key)
        else:
            fresh.add(tid)
            for result in results:
                if result.payload is not None:
                    result.slot, result.payload = packer.add(result.payload), None
        if on_bytes:
            on_bytes(job.raw.nbytes)
    if damaged is not None:
        raise damaged
    if unquantizable:
        raise UnquantizableTensorsError(unquantizable)
    packer.close()
    return results_of, ids, repeats


def _lossy_measured(job: Job, results: list[ChunkResult], spans: list[int]) -> dict:
    """What a lossy record keeps of its encoding: its error, and per chunk what its next residual starts from."""
    norm = sum(r.norm_sq for r in results)
    measured: dict = {"rel_error": float(np.sqrt(sum(r.error_sq for r in results) / norm)) if norm else 0.0}
    if job.params.get("fine_grid") and any(r.capped for r in results):  # a lattice to keep (_lattice_step)
        measured["chunk_steps"] = [r.step for r in results]
    if job.codec == "deadzone" and len(results) > 1:  # each chunk's own error (_chunk_base_error)
        measured["chunk_errors"] = [float(np.sqrt(r.error_sq / max(1, n // job.raw.itemsize)))
                                    for r, n in zip(results, spans)]
    return measured


def _chunk(result: ChunkResult, raw_bytes: int) -> Chunk:
    """Where a chunk's payload went: its own object, or a range of a pack."""
    if result.slot is None:
        return Chunk(result.object_id, raw_bytes, 0, None, result.checksum)
    return Chunk(result.slot.object_id, raw_bytes, result.slot.offset, result.stored, result.checksum)


def lossless_jobs(new: dict[TensorId, RawTensor], parents: dict[TensorId, TensorRecord | None],
                  settings: EncodingSettings, costs: dict[int, ChainCosts] | None,
                  anchors: Mapping[TensorId, TensorRecord] | None = None) -> list[Job]:
    """Jobs for tensors stored bit for bit: keyframe, or residual against the parent's tensor.

    `anchors` holds the parents' bases by id (every record down their chains will do): a parent at
    the chain's limit is coded against its base instead (policy/lossless.py's plan_tensor).

    With `max_chain = "auto"` the chain's length comes from measured decode `costs`: the repository's
    (repo/chaincost.py's auto_costs; commit.encoding_jobs passes them). None where no tensor has a
    parent (a first commit keyframes anyway): the fallback limit then only decides `keep_planes`.
    """
    jobs = []
    for tid, raw in new.items():
        parent = parents.get(tid)
        anchor = (anchors or {}).get(parent.base_id) if parent is not None and parent.base_id else None
        plan = plan_tensor(raw.dtype, raw.nbytes, raw.itemsize, parent, settings, costs, anchor)
        depth = plan.base.depth + 1 if plan.base is not None else 0
        jobs.append(Job(tid, raw, plan.codec, plan.params, plan.base, known_id=tid,
                        keep_planes=depth < plan.limit, keep_base=0 < depth == plan.limit))
    return jobs
