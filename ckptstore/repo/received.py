"""Tensor records received from another repository are claims a commit checks before it reuses them.

A record says "tensor ID is these chunks", and fetch, pull, clone and a push into this repository
copy records as they are (each object is verified against its id, but a record's claim only by
decoding it). A commit here whose tensor has that id would reuse the record without a look, so a
crafted remote could make a later commit of your own bytes restore its bytes. The transfer lists
what it received in the `unchecked_tensors` table; before a commit reuses a listed record it
decodes it and hashes the result against its id, once: one that holds is reused and leaves the
list, one that does not is encoded again from the commit's bytes (taking the id's row). A lossy
record's `source` (the content it was made from) cannot be checked by decoding: a lossy record
stays listed, and a commit never reuses a listed one for it. The list is in the database, so in a
shared repository every machine's commits check every machine's fetches.

Restores check them too (`check_restored`, `check_whole`): a checkout, load, export or diff of a
received commit hashes each listed tensor it rebuilt against its id before handing it out, and a
record that holds leaves the list, so the sender's chunk checksums (its own claims) are never all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CkptError, CorruptRecordError
from ckptstore.hashing import TensorId, tensor_id
from ckptstore.metadata import Tx
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, replay

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository


def check(repo: Repository, tx: Tx, ours: Set[TensorId], parents: Mapping[str, TensorRecord],
          known: Mapping[TensorId, TensorRecord] | None = None, lost: Set[TensorId] = frozenset()
          ) -> tuple[dict[str, TensorRecord], set[TensorId], set[TensorId]]:
    """The check of a commit's (or a DCP rank's) received records, before it encodes: three answers.

    `ours` are its tensors' content ids, `parents` the records it may chain on or reuse by path,
    `known` records loaded already (with their chains), `lost` ids it encodes again anyway. Returns
    `parents` less the listed lossy records (their `source` is not checked) and the listed ones that
    lie (a residual on a lie restores wrong once that record is encoded again), the recorded ids of
    ours whose received records lie (to encode again, taking the rows), and those found true that
    leave the list (the caller takes them off with the commit, or at once).
    """
    listed = tensor_rows.unchecked_among(tx, set(ours) | {r.id for r in parents.values()})
    if not listed:
        return dict(parents), set(), set()
    recorded = tensor_rows.existing_tensor_ids(tx, (listed & set(ours)) - set(lost))
    bases = {r.id for r in parents.values() if r.id in listed and "source" not in r.params} - set(lost)
    checked = recorded | bases
    known = known or {}
    records = {**known, **tensor_rows.load_records(tx, checked - set(known), problems={})}
    false = false_claims(repo, records, checked) if checked else set()
    kept = {p: r for p, r in parents.items() if not (r.id in listed and ("source" in r.params or r.id in false))}
    return kept, false & recorded, off_the_list(records, checked - false)


def taken_over(repo: Repository, tx: Tx, ours: Sequence[TensorRecord]) -> tuple[set[TensorId], set[TensorId]]:
    """Of a commit's new records (encoded here, from its own bytes), the listed ids ours replace, and those that leave.

    A listed record of one of our ids is replaced by ours (rows and `source`) where that is safe: it
    is damaged, false, or cut into chunks as ours is (residuals chained on a record split their chunks
    as it does: rows cut otherwise would break them). One cut otherwise that decodes true keeps its
    rows, and leaves the list where its `source` is ours too; one claiming another source stays
    listed, and each commit holding its tensor encodes it again (and decodes it here, under the lock).
    """
    mine = {r.id: r for r in ours}
    listed = tensor_rows.unchecked_among(tx, mine)
    if not listed:
        return set(), set()
    damaged: dict[TensorId, str] = {}
    recorded = tensor_rows.load_records(tx, listed, problems=damaged)
    alike = {tid for tid in listed & recorded.keys() if recorded[tid].cut() == mine[tid].cut()}
    otherwise = (listed & recorded.keys()) - alike
    false = false_claims(repo, recorded, otherwise, writing=tx) if otherwise else set()
    sourced = {tid for tid in otherwise - false if recorded[tid].params.get("source") == mine[tid].params.get("source")}
    _keep_what_rests_on(repo, tx, recorded, (alike | false) & recorded.keys(), mine)
    return (listed - recorded.keys()) | alike | false, sourced


def _keep_what_rests_on(repo: Repository, tx: Tx, recorded: Mapping[TensorId, TensorRecord], replaced: Set[TensorId],
                        mine: Mapping[TensorId, TensorRecord]) -> None:
    """Keep the records chained on one of `replaced` (listed records ours take the rows of) decoding as they did.

    One that decodes to its id gives way to the same bytes. One that does not may still carry records
    that decode true through it (a commit here may have reused one): its rows go to the id of the
    bytes it holds, and those records follow them there. That id's own record, where one is true and
    cut alike, keeps its rows unless it rests on the false one (following it would loop): then it
    takes the false one's. Else they stay on it (and no longer decode, as before).
    """
    for tid in sorted(tensor_rows.resting_on(tx, replaced)):
        held = _id_of_what_it_holds(repo, tx, recorded, recorded[tid])
        if held in (None, tid):
            continue
        # as it is now: an earlier move in this loop may have rebased it (two lies, one on the other)
        rows = replace(tensor_rows.load_records(tx, [tid], with_bases=False)[tid], id=held)
        there = tensor_rows.load_records(tx, [held], problems={})  # with its chain
        target = there.get(held) or mine.get(held)
        if target is not None and (target.cut() != rows.cut() or (held in there and tensor_rows.unchecked_among(
                tx, [held]) and false_claims(repo, there, {held}, writing=tx))):
            continue
        if held not in there:  # ours of that id, if any, gives way: inserted after, it is ignored
            tensor_rows.insert_records(tx, [rows], {})
        elif tid in there:
            tensor_rows.replace_records(tx, [rows], {})
        if held not in there or tid in there:
            tensor_rows.mark_checked(tx, [held])
            if "source" in rows.params:  # what it was made from is as unchecked as it was
                tensor_rows.list_unchecked(tx, [held])
        tensor_rows.rebase(tx, tid, held)


def _id_of_what_it_holds(repo: Repository, writing: Tx, records: Mapping[TensorId, TensorRecord],
                         record: TensorRecord) -> TensorId | None:
    """The id of the bytes `record` decodes to (its objects verified), or None where it does not decode.

    It reads the store inside the commit's write transaction (`writing`), whose idle limit is lifted for it.
    """
    writing.may_idle()
    try:
        out = replay(ChainSource(repo.store, records), [record], repo.pool, verify=False)[record.id]
    except (CkptError, KeyError, ValueError):
        return None
    return tensor_id(record.dtype, record.shape, out)


def off_the_list(records: Mapping[TensorId, TensorRecord], true: Set[TensorId]) -> set[TensorId]:
    """Of the records found `true`, those that may leave the list: not lossy ones, whose `source` stays unchecked."""
    return {tid for tid in true if "source" not in records[tid].params}


def false_claims(repo: Repository, records: Mapping[TensorId, TensorRecord], ids: Set[TensorId],
                 writing: Tx | None = None) -> set[TensorId]:
    """Those of `ids` (received, recorded: `records` holds them with their chains) that do not decode to their id.

    Decoded one at a time, so a commit's memory grows by its largest tensor, not by all of them; a
    record that cannot be decoded at all (an object gone) is as good as false: it is encoded again.
    Called inside a write transaction (`writing`), it lifts that one's idle limit: it reads the store there.
    """
    if writing is not None and ids:
        writing.may_idle()
    false = set()
    source = ChainSource(repo.store, records)
    for tid in sorted(ids):
        try:
            replay(source, [records[tid]], repo.pool, by_id=True)
        except (CkptError, KeyError, ValueError):
            false.add(tid)
    return false


def check_restored(repo: Repository, records: Mapping[TensorId, TensorRecord], buffers: Mapping[TensorId, Any]
                   ) -> None:
    """Raise unless every restored tensor (`buffers`, whole, numpy or torch) whose record is listed hashes to its id.

    The check costs a hash of those tensors, once: the records that hold leave the list.
    """
    # a tensor on the meta device holds no bytes to check: its record stays listed for a load that does
    listed = {t for t in _listed(repo, records, buffers) if not getattr(buffers[t], "is_meta", False)}
    if listed:
        _settle(repo, records, listed, {t for t in listed if tensor_id(records[t].dtype, records[t].shape,
                                                                       _host_bytes(buffers[t])) != t})


def check_whole(repo: Repository, records: Mapping[TensorId, TensorRecord], ids: Set[TensorId]) -> None:
    """As check_restored, for tensors restored in part (a DCP rank's ranges): the listed ones are decoded whole."""
    listed = _listed(repo, records, ids)
    if listed:
        _settle(repo, records, listed, false_claims(repo, records, listed))


# (database, chain) restored and found true in this process: a lossy record stays listed (its `source` is
# unchecked), and a repository this user may not write keeps its list, so each load of them would check again.
# The records down the chain are the key: one received anew after a gc (forged, perhaps) is checked anew.
_TRUE_HERE: set[tuple[str, str]] = set()


def _listed(repo: Repository, records: Mapping[TensorId, TensorRecord], ids: Any) -> set[TensorId]:
    with repo.db.read() as tx:
        listed = tensor_rows.unchecked_among(tx, list(ids))
    return {tid for tid in listed if (repo.db.url, _chain(records, tid)) not in _TRUE_HERE}


def _chain(records: Mapping[TensorId, TensorRecord], tid: TensorId) -> str:
    """The records `tid` replays from, down to its keyframe (as far as `records` holds them), as one text."""
    found, current = [], records.get(tid)
    for _ in range(current.depth + 1 if current is not None else 0):  # a looping chain stops at the top's depth
        if current is None:
            break
        found.append(repr(current))
        current = records.get(current.base_id) if current.base_id else None
    return "\n".join(found)


def _settle(repo: Repository, records: Mapping[TensorId, TensorRecord], listed: set[TensorId],
            false: set[TensorId]) -> None:
    if false:
        first = sorted(false)[0]
        raise CorruptRecordError(f"tensor {first}", "it was received from another repository (a fetch, pull, clone "
                                 "or a push here), or recorded before this repository's upgrade to schema 0009, "
                                 "and does not rebuild the bytes its id names: that repository's record is false, "
                                 "or this one's is damaged. Fetch only from repositories you trust",
                                 tensors=sorted(false), outcome="Nothing was restored from it (`ckpt fsck --full` "
                                 "decodes every record)")
    _TRUE_HERE.update((repo.db.url, _chain(records, tid)) for tid in listed)
    if repo.read_only:
        return
    try:
        with repo.db.write() as tx:
            tensor_rows.mark_checked(tx, off_the_list(records, listed))
    except (CkptError, OSError):  # a database this user may not write: its restores go on checking, nothing lost
        pass


def _host_bytes(buffer: Any) -> Any:
    """A restored flat uint8 buffer as something blake3 reads: numpy as it is, a torch tensor via the host."""
    return buffer if hasattr(buffer, "__array_interface__") else buffer.cpu().numpy()
