"""Folding replayed WAL records back into the producer's state. Pure: no IO.

Records are applied in sequence order:

* DATA adds a live record;
* BIND takes the live DATA records in its range into a batch bound to its location (a second
  BIND of the same range is a re-mint: the batch moves to the new location and remembers the
  old one, because either may be in the manifest);
* DROP removes the live DATA records in its range, and any batch entirely inside it.

What is left is a list of bound batches, which must be looked up in the manifest before
anything else happens (a crash between the manifest append and the WAL release leaves them
published), and the unbound records, which are batched afresh.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from millpond.formats.wal import RecordType
from millpond.wal import WalRecord

__all__ = ["RecoveredBatch", "RecoveredState", "fold_records"]


@dataclass(slots=True)
class RecoveredBatch:
    """A batch that was bound to a location before the restart."""

    first_seq: int
    last_seq: int
    location: str
    records: list[WalRecord]
    prior_locations: list[str] = field(default_factory=list)
    complete: bool = True
    """Whether every record the BIND counted survived: only then may the same location be
    written again (its object, if it landed, holds exactly these records)."""


@dataclass(slots=True)
class RecoveredState:
    """Bound batches (in bind order) and unbound live DATA records (in sequence order)."""

    batches: list[RecoveredBatch]
    unbound: list[WalRecord]


def fold_records(records: list[WalRecord]) -> RecoveredState:
    """Apply replayed records (sorted by sequence) and return what is still to publish."""
    unbound: dict[int, WalRecord] = {}
    order: list[int] = []  # the keys of ``unbound``, ascending (DATA arrives in seq order)
    batches: list[RecoveredBatch] = []
    by_range: dict[tuple[int, int], RecoveredBatch] = {}

    def take(first: int, last: int) -> list[WalRecord]:
        low, high = bisect.bisect_left(order, first), bisect.bisect_right(order, last)
        taken = [unbound.pop(seq) for seq in order[low:high]]
        del order[low:high]
        return taken

    for record in sorted(records, key=lambda r: r.seq):
        if record.type is RecordType.DATA:
            unbound[record.seq] = record
            order.append(record.seq)
        elif record.type is RecordType.BIND:
            bind = record.bind
            assert bind is not None
            key = (bind.first_seq, bind.last_seq)
            existing = by_range.get(key)
            if existing is not None:
                existing.prior_locations.append(existing.location)
                existing.location = bind.location
                continue
            members = take(bind.first_seq, bind.last_seq)
            if not members:
                continue
            batch = RecoveredBatch(
                first_seq=bind.first_seq,
                last_seq=bind.last_seq,
                location=bind.location,
                records=members,
                complete=len(members) == bind.record_count,
            )
            batches.append(batch)
            by_range[key] = batch
        else:
            drop = record.drop
            assert drop is not None
            take(drop.first_seq, drop.last_seq)
            for batch in [
                b for b in batches if drop.first_seq <= b.first_seq and b.last_seq <= drop.last_seq
            ]:
                batches.remove(batch)
                del by_range[(batch.first_seq, batch.last_seq)]
    return RecoveredState(batches=batches, unbound=[unbound[seq] for seq in order])
