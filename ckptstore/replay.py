"""Rebuild tensors from their delta chains, chunk by chunk, in parallel on CPU threads.

A chunk at the top of a chain is decoded by walking down until a payload that needs no base,
then applying each level upward in place in the output buffer, so no intermediate copies exist.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from ckptstore import threadlocal
from ckptstore.codecs import REGISTRY, capabilities, get_codec
from ckptstore.codecs.base import LevelsNeeded
from ckptstore.codecs.checked import MALFORMED
from ckptstore.errors import CodecError, CorruptObjectError, CorruptRecordError, StoreUnavailableError
from ckptstore.hashing import HEX_LENGTH, ObjectId, TensorId, chunk_checksum, tensor_id
from ckptstore.objectstore.base import ObjectStore, RangeReader, read_whole, reading_ahead, tells_lacking
from ckptstore.objectstore.fallback import held_here
from ckptstore.objectstore.pack import PackReader, check_range
from ckptstore.records import Chunk, TensorRecord


@dataclass
class ChainSource:
    """Everything replay needs: the store and the records of every tensor in the chains.

    Payloads in packs are read through a PackReader (pack.py): whole packs verified and cached,
    or, where objects need no verification here and `ranges` is given (the store's
    `open_ranges()`), each payload read alone.
    """

    store: ObjectStore
    records: Mapping[TensorId, TensorRecord]
    pack_cache_bytes: int = 256 << 20
    verify_objects: bool = True
    ranges: RangeReader | None = None
    last_try: bool = False  # replay's second try: a failure on sound objects is the records' (see diagnose)
    packs: PackReader = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ranges = self.ranges if not self.verify_objects else None
        self.packs = PackReader(self.store, self.verify_objects, ranges, self.pack_cache_bytes)

    def payload(self, chunk: Chunk, slot: int = 0) -> bytes | memoryview:
        """The stored bytes of one chunk.

        They are verified with the object that holds them, unless `verify_objects` is off because
        the caller hashes what it decodes. A packed payload read alone lands in this thread's
        buffer for `slot` (its level in the chain being decoded): valid until the thread reads
        another payload for that slot.
        """
        if chunk.length is None:
            return read_whole(self.store, chunk.object_id, self.verify_objects)
        check_range(chunk.object_id, chunk.offset, chunk.length)  # before a buffer of that length is taken
        into = threadlocal.scratch("payload", slot, chunk.length) if self.packs.ranges is not None else None
        return self.packs.read(chunk.object_id, chunk.offset, chunk.length, into)

    def diagnose(self, record: TensorRecord, error: Exception) -> Exception:
        """What is damaged behind a failed replay of `record`: an object (CorruptObjectError) or a record.

        Every object of the record's chain is verified first; when they all are sound, the records
        are what is damaged (CorruptRecordError), or `error` itself is returned. A store that could
        not be read is no damage: that error is returned without reading the store again. Bytes that
        did not match where every object now reads back sound may have been damaged on their way (a
        network store's two reads running): unless this is the last try, ReadAgain, and `replay` tries
        once more before blaming the records.
        """
        if isinstance(error, StoreUnavailableError):  # reading again would spend the store's retry budget again
            return error
        seen: set[str] = set()
        current: TensorRecord | None = record
        while current is not None and current.id not in seen:
            seen.add(current.id)
            for chunk in current.chunks:
                if chunk.object_id not in seen:
                    seen.add(chunk.object_id)
                    self.store.get(chunk.object_id)
            current = self.records.get(current.base_id) if current.base_id else None
        if isinstance(error, CorruptObjectError) and not self.last_try:
            return ReadAgain(error)
        if isinstance(error, CorruptObjectError):  # bytes that decoded wrong from sound objects: the record's fault
            return CorruptRecordError(f"tensor {record.id}", f"{error.problem}, though every object of its chain is "
                                      "sound (`ckpt fsck --full` checks records)", tensors=[record.id])
        if isinstance(error, (CodecError, CorruptRecordError)):
            return error
        # sound objects that do not decode with the recorded codec and params: the record is damaged
        return CorruptRecordError(f"tensor {record.id}", f"its chunks do not decode with its recorded codec and "
                                  f"params ({error!r})", tensors=[record.id])

    def levels(self, record: TensorRecord, index: int, stop_at: TensorId | None = None
               ) -> list[tuple[TensorRecord, bytes]]:
        """Chunk `index` down its chain, newest first.

        It ends at the first payload that needs no base, or just above the tensor `stop_at`.
        """
        levels = []
        current = record
        while True:
            if index >= len(current.chunks) or len(levels) > len(self.records):  # checked before replay; never loop
                raise CorruptRecordError(f"tensor {record.id}", f"chunk {index} of its chain has no record",
                                         tensors=[record.id])
            payload = self.payload(current.chunks[index], len(levels))
            levels.append((current, payload))
            if current.base_id in (None, stop_at) or not get_codec(current.codec).needs_base(payload):
                return levels
            if current.base_id not in self.records:
                raise CorruptRecordError(f"tensor {current.id}", f"its base tensor {current.base_id} has no record",
                                         tensors=[current.id])
            current = self.records[current.base_id]

    def replay_chunk(self, record: TensorRecord, index: int, out: np.ndarray,
                     below: tuple[TensorId, Future, np.ndarray] | None = None) -> np.ndarray:
        """Decode chunk `index` of `record` into `out` (a writable uint8 slice of the right size).

        `below` is (id, future, chunk buffer) of a tensor down this chain that is being replayed
        alongside (a first moment's second moment): the walk stops above it and starts from its
        chunk once that is done, instead of decoding its chain a second time.
        """
        if below is None:
            return self.decode_levels(self.levels(record, index), out)
        levels = self.levels(record, index, stop_at=below[0])
        bottom, payload = levels[-1]
        if bottom.base_id != below[0] or not get_codec(bottom.codec).needs_base(payload):
            return self.decode_levels(levels, out)
        below[1].result()
        out[...] = below[2]
        return _apply(levels, out)

    @staticmethod
    def decode_levels(levels: list[tuple[TensorRecord, bytes]], out: np.ndarray) -> np.ndarray:
        """Decode a chunk from its already-read `levels` (as `levels()` returns them) into `out`.

        The bottom run of levels sharing one coding is decoded in one pass when its codec can (a
        first moment's chain ends in its second moment's whole chain); the levels above it are
        applied one by one, each with its own params.
        """
        start = len(levels) - 1
        while start > 0 and _same_coding(levels[start - 1][0], levels[-1][0]):
            start -= 1
        bottom, chain = levels[start:], capabilities(levels[-1][0].codec).chain
        if len(bottom) > 1 and chain is not None:
            try:
                chain.decode_chain([p for _, p in bottom], bottom[0][0].params, out.size, out)
                levels = levels[:start]
            except LevelsNeeded:  # an old payload whose params are its record's: each level with its own
                pass
        return _apply(levels, out)

    def replay_planes(self, record: TensorRecord, index: int) -> list[np.ndarray] | None:
        """Chunk `index` of a lossless byte-grouped `record` as byte planes (None for other codecs)."""
        planes = capabilities(record.codec).planes
        if planes is None:
            return None
        levels = self.levels(record, index)
        nbytes = record.chunks[index].raw_bytes
        if one_coding(levels):
            return planes.decode_planes([p for _, p in levels], nbytes)
        raw = self.decode_levels(levels, np.empty(nbytes, dtype=np.uint8))
        return list(raw.reshape(-1, int(record.params["width"])).T)


def _apply(levels: list[tuple[TensorRecord, bytes]], out: np.ndarray) -> np.ndarray:
    """Apply `levels` (newest first) to `out` from the bottom up, each with its own params."""
    for level, payload in reversed(levels):
        result = get_codec(level.codec).decode(payload, out, level.params, out.size)
        if result is not out:
            out[...] = result
    return out


def one_coding(levels: list[tuple[TensorRecord, bytes]]) -> bool:
    """True when every level of a chain decodes with the same codec and coding params."""
    top = levels[0][0]
    return all(_same_coding(level, top) for level, _ in levels[1:])


def _same_coding(a: TensorRecord, b: TensorRecord) -> bool:
    """True when payloads of `a` and `b` decode with the same codec and coding params."""
    if a.codec != b.codec:
        return False
    decoding = capabilities(a.codec).chain_params
    return _coding_params(a.params, decoding) == _coding_params(b.params, decoding)


_OBJECT_ID = re.compile(f"[0-9a-f]{{{HEX_LENGTH}}}")  # what hashing.object_id returns
_CHECKSUM = re.compile("[0-9a-f]{32}")  # what hashing.chunk_checksum returns

BOOKKEEPING = ("source", "rel_error", "max_error", "measured_as", "level", "residual_misses", "residual_wait",
               "plane_modes", "cycle")


def _coding_params(params: dict, decoding: tuple[str, ...] | None) -> dict:
    """The params that change how a payload decodes.

    The codec's `chain_params` when it names them, else all but what was recorded about the encoding.
    """
    if decoding is not None:
        return {k: params.get(k) for k in decoding}
    return {k: v for k, v in params.items() if k not in BOOKKEEPING}


class ReadAgain(Exception):  # noqa: N818 - no error the user sees: `replay` catches it and tries once more
    """A replay failed on bytes that did not match, and every object of the chain reads back sound now."""

    def __init__(self, error: CorruptObjectError) -> None:
        super().__init__(str(error))
        self.error = error


def replay(source: ChainSource, wanted: Iterable[TensorRecord], pool: Executor,
           verify: bool = True, on_chunk: Callable[[int], None] | None = None,
           by_id: bool = False) -> dict[TensorId, np.ndarray]:
    """Rebuild every wanted tensor as a flat uint8 array; chunks run concurrently on `pool`.

    With `verify`, every byte decoded is checked: each chunk against its recorded checksum right
    after it is replayed, and tensors whose chunks have none (written before schema 0005), or all
    tensors with `by_id`, by hashing them whole against their tensor id (blake3). Objects are then
    read without hashing them too; only a failure verifies the chain's objects to name the
    damaged one. A failure whose objects all read back sound then (bytes damaged in transit, see
    `diagnose`) is replayed once more before the records are called damaged.
    """
    wanted = list(wanted)  # a second try iterates it again
    tries = _reported_once(on_chunk)
    try:
        return _replay_verifying(source, wanted, pool, verify, tries(), by_id)
    except ReadAgain:
        return _replay_verifying(replace(source, last_try=True), wanted, pool, verify, tries(), by_id)


def _replay_verifying(source: ChainSource, wanted: list[TensorRecord], pool: Executor, verify: bool,
                      on_chunk: Callable[[int], None] | None, by_id: bool) -> dict[TensorId, np.ndarray]:
    """One try of `replay` (a second try's `source` is a copy, whose pack reader kept no failed read of the first)."""
    if not verify:
        return _replay(source, wanted, pool, verify, on_chunk, by_id)
    ranges = source.store.open_ranges()
    try:
        return _replay(replace(source, verify_objects=False, ranges=ranges), wanted, pool, verify, on_chunk, by_id)
    finally:
        ranges.close()


def _reported_once(on_chunk: Callable[[int], None] | None) -> Callable[[], Callable[[int], None] | None]:
    """A maker of `on_chunk` for each of replay's tries: bytes an earlier try reported are not reported again.

    Each try reports its chunks in the same order, so its progress is the bytes past what was reported before.
    """
    reported = 0

    def one_try() -> Callable[[int], None] | None:
        done = 0

        def report(size: int) -> None:
            nonlocal done, reported
            done += size
            if done > reported:
                on_chunk(done - reported)
                reported = done
        return report if on_chunk is not None else None
    return one_try


def _replay(source: ChainSource, wanted: Iterable[TensorRecord], pool: Executor, verify: bool,
            on_chunk: Callable[[int], None] | None, by_id: bool) -> dict[TensorId, np.ndarray]:
    records = {r.id: r for r in unique(wanted)}
    outputs: dict[TensorId, np.ndarray] = {}
    chunk_futures: dict[TensorId, list[Future]] = {}
    futures, jobs = [], []
    ordered = _bases_first(records)
    for record in ordered:
        problem = _record_problem(record) or _claim_problem(source, record)  # before its buffer is allocated
        if problem is not None:
            raise CorruptRecordError(f"tensor {record.id}", problem, tensors=[record.id])
        buffer = outputs[record.id] = np.empty(record.raw_bytes, dtype=np.uint8)
        base = records.get(record.base_id) if record.base_id else None
        shared = base is not None and base.cut() == record.cut()
        chunk_futures[record.id] = []
        for index, offset in enumerate(record.chunk_offsets()):
            end = offset + record.chunks[index].raw_bytes
            below = (base.id, chunk_futures[base.id][index], outputs[base.id][offset:end]) if shared else None
            future: Future = Future()
            jobs.append((future, partial(_replay_chunk, source, record, index, buffer[offset:end], below, verify)))
            chunk_futures[record.id].append(future)
            futures.append((record, end - offset, future))
    with reading_ahead(source.store, _objects_in_order(source, ordered)):
        run_here_and_on(pool, jobs)
        _collect(source, futures, on_chunk)
    if verify:
        whole = [r for r in records.values() if by_id or any(c.checksum is None for c in r.chunks)]
        checks = [(r, pool.submit(tensor_id, r.dtype, r.shape, outputs[r.id])) for r in whole]
        for record, check in checks:
            if check.result() != record.id:
                raise source.diagnose(record, CorruptObjectError(
                    object_ids_of(record), f"decoded to bytes that do not match tensor {record.id}"))
    return outputs


def _objects_in_order(source: ChainSource, ordered: list[TensorRecord]) -> Iterator[ObjectId]:
    """The objects the replay of `ordered` reads, about in the order it reads them: each chunk down its chain."""
    for record in ordered:
        current: TensorRecord | None = record
        for _ in range(min(record.depth, 64) + 1):  # a damaged depth or a looping chain is found elsewhere
            if current is None:
                break
            yield from (chunk.object_id for chunk in current.chunks)
            current = source.records.get(current.base_id) if current.base_id else None


def _collect(source: ChainSource, futures: list, on_chunk: Callable[[int], None] | None) -> None:
    """Wait for every chunk in order, reporting progress; damage becomes a ckptstore error naming the object."""
    for record, size, future in futures:
        try:
            future.result()
        except (*MALFORMED, TypeError) as exc:  # damage in the chain or its records: a ckptstore error, never a crash
            raise source.diagnose(record, exc) from None
        if on_chunk:
            on_chunk(size)


def chain_problem(record: TensorRecord, records: Mapping[TensorId, TensorRecord],
                  held: Container[TensorId] = frozenset()) -> str | None:
    """Why `record` or a record down its chain cannot be replayed exactly, or None when every byte is accounted for.

    Each record's chunks must cover its bytes exactly, and each base must be recorded, the chain
    ending without looping. Replaying over records that fail this would hand out whatever memory
    the buffer held where a chunk is missing. (A base's depth need not be one less: a tensor
    recorded earlier keeps its first record, while a residual against it counted the depth of
    the record this commit would have written.) A base in `held` ends the chain: a push or fetch does
    not send it, the other side holding it already.
    """
    seen: set[TensorId] = set()
    current: TensorRecord | None = record
    while current is not None:
        seen.add(current.id)
        problem, base = _record_problem(current), None
        if problem is None and current.base_id is not None and current.base_id not in held:
            base = records.get(current.base_id)
            if base is None:
                problem = f"its base tensor {current.base_id} has no record"
            elif base.id in seen:
                problem = f"its chain loops back to tensor {base.id}"
            elif base.raw_bytes != current.raw_bytes:  # a chain's links, and m on v (the two 16-bit types), are alike
                problem = (f"its base tensor {base.id} holds {base.raw_bytes} bytes of {base.dtype}, not "
                           f"{current.raw_bytes} of {current.dtype}")
        if problem is not None:
            return problem if current is record else f"tensor {current.id} down its chain: {problem}"
        current = base
    return None


def _record_problem(record: TensorRecord) -> str | None:
    """Why one record's own fields and chunks do not add up, or None."""
    if not (type(record.raw_bytes) is type(record.depth) is int and record.raw_bytes >= 0 and record.depth >= 0):
        return f"its size {record.raw_bytes!r} or depth {record.depth!r} is not a count"
    if (record.base_id is None) != (record.depth == 0):
        return f"it is at depth {record.depth} with {'no base' if record.base_id is None else 'a base'}"
    if not isinstance(record.codec, str) or record.codec not in REGISTRY:
        return (f"its codec {record.codec!r} is none this ckptstore knows ({', '.join(sorted(REGISTRY))}): damaged, "
                "or written by a newer ckptstore")
    covered = 0
    for chunk in record.chunks:
        sizes = (chunk.raw_bytes, chunk.offset, 0 if chunk.length is None else chunk.length)
        if not (type(sizes[0]) is type(sizes[1]) is type(sizes[2]) is int and min(sizes) >= 0):
            return f"a chunk record has a size or offset that is not a count ({sizes!r})"
        if not isinstance(chunk.object_id, str) or not _OBJECT_ID.fullmatch(chunk.object_id):
            return f"a chunk record names {chunk.object_id!r}, which is not an object id"
        if chunk.checksum is not None and not (isinstance(chunk.checksum, str) and _CHECKSUM.fullmatch(chunk.checksum)):
            return f"a chunk record's checksum {chunk.checksum!r} is not one"
        covered += chunk.raw_bytes
    if covered != record.raw_bytes:
        return f"its {len(record.chunks)} chunk records cover {covered} of its {record.raw_bytes} bytes"
    return None


# A real chunk decodes to at most ~20x its payload, except planes of zeros or of one value, which code to a few
# hundred bytes whatever their size: beyond this ratio (and this slack), the payload's own header must say so.
# A record under CLAIM_RECORD is taken on its word: a buffer that size is no harm, and small tensors cost nothing.
CLAIM_RATIO = 64
CLAIM_SLACK = 64 << 10
CLAIM_RECORD = 64 << 20


def _claim_problem(source: ChainSource, record: TensorRecord) -> str | None:
    """Why `record` claims more bytes than its stored payloads decode to, or None: before its buffer is taken.

    A false record of a few KiB claiming terabytes made checkout, diff and `fsck --full` fail "out of
    memory". A chunk within CLAIM_RATIO of its payload's size is taken on its word (no object read);
    beyond it, the payload is read once and must declare that size (a codec that cannot say, or a
    bucket's whole object, not asked its size per chunk, is believed: a real tensor is never refused).
    """
    declares, checked = capabilities(record.codec).declares, set()
    if record.raw_bytes <= CLAIM_RECORD or declares is None:
        return None
    sized = tells_lacking(held_here(source.store))  # a folder says an object's size with a stat
    for index, chunk in enumerate(record.chunks):
        place = (chunk.object_id, chunk.offset, chunk.length, chunk.raw_bytes)
        if chunk.raw_bytes <= CLAIM_SLACK or place in checked or (chunk.length is None and not sized):
            continue
        checked.add(place)
        stored = chunk.length if chunk.length is not None else source.store.size(chunk.object_id)
        if chunk.raw_bytes <= CLAIM_RATIO * stored + CLAIM_SLACK:
            continue
        declared = declares.declared_bytes(source.payload(chunk), record.params)
        if declared is not None and not declared[0] <= chunk.raw_bytes <= declared[1]:
            fewest, most = declared
            return (f"chunk {index} claims {chunk.raw_bytes} bytes, but its stored payload ({stored} bytes of "
                    f"object {chunk.object_id[:12]}) decodes to {fewest if fewest == most else f'{fewest}-{most}'}")
    return None


def run_here_and_on(pool: Executor, jobs: list[tuple[Future, Callable[[], object]]]) -> None:
    """Run `jobs` in order on this thread and the pool's (as many in all as the pool has), then return.

    Each job's future then holds its result or exception. The calling thread is running already,
    while the pool's threads sleep until woken: on the 2-core benchmark VM a bf16 checkout whose
    tasks all went to the pool took 32.8 ms after a `gc.collect()` and 25.2 ms back to back; with
    the caller taking its share, 24.0 and 23.5 ms. Jobs taken in order may wait for earlier ones
    (a first moment's chunk for its second moment's), which are then already running.
    """
    taken = itertools.count()

    def drain() -> None:
        for index in taken:  # a shared counter: each index goes to one thread
            if index >= len(jobs):
                return
            future, job = jobs[index]
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # delivered to whoever waits on the future
                    future.set_exception(exc)

    threads = getattr(pool, "_max_workers", None) or os.cpu_count() or 1  # ThreadPoolExecutor's size
    helpers = [pool.submit(drain) for _ in range(min(len(jobs), threads) - 1)]
    drain()
    for helper in helpers:
        helper.result()


def _replay_chunk(source: ChainSource, record: TensorRecord, index: int, out: np.ndarray,
                  below: tuple[TensorId, Future, np.ndarray] | None, verify: bool) -> None:
    """One replay task: decode the chunk, then compare its checksum while the bytes are in cache."""
    source.replay_chunk(record, index, out, below)
    expected = record.chunks[index].checksum
    if verify and expected is not None and chunk_checksum(out) != expected:
        raise CorruptObjectError(object_ids_of(record), f"chunk {index} of tensor {record.id} decoded to bytes "
                                                      "that do not match its checksum")


def object_ids_of(record: TensorRecord) -> list[ObjectId]:
    """The objects holding `record`'s chunks, each once, in chunk order."""
    return list(dict.fromkeys(c.object_id for c in record.chunks))


def _base_cycle(record: TensorRecord) -> CorruptRecordError:
    return CorruptRecordError(f"tensor {record.id}", "its chain of bases loops back on itself", tensors=[record.id])


def _bases_first(records: Mapping[TensorId, TensorRecord]) -> list[TensorRecord]:
    """The records ordered so that one whose base is also among them comes after that base.

    The pool runs tasks in the order they were submitted, so a chunk that waits for its base's
    chunk never waits for a task that has not started.
    """
    def local_depth(record: TensorRecord) -> int:
        depth = 0
        while record.base_id in records:
            record, depth = records[record.base_id], depth + 1
            if depth > len(records):  # damaged records whose bases loop: refuse instead of walking forever
                raise _base_cycle(record)
        return depth

    return sorted(records.values(), key=local_depth)


def unique(records: Iterable[TensorRecord]) -> list[TensorRecord]:
    seen: dict[TensorId, TensorRecord] = {}
    for record in records:
        seen.setdefault(record.id, record)
    return list(seen.values())
