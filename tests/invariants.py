"""What must hold of a millpond pipeline whatever happened, written down once.

The whole-system checker (``tests/system``) asserts all of these after every schedule; role
tests reuse them for their own runs (the producer kill test, GC under load, the exactly-once
cases). Each takes plain data a test collected and raises ``AssertionError`` with the evidence.

* :func:`assert_exactly_once` — every record that was staged (``wait_staged()`` returned) is in
  the sink once; no record is in it twice.
* :func:`assert_in_sink_or_set_aside` — with poison batches set aside: every staged record is
  in the sink once or in exactly one quarantined batch, never both.
* :func:`assert_order_per_source` — each producer's records appear in the order it produced them.
* :func:`assert_last_write_wins` — an upserted table holds, per key, what the key's last write
  left (its value, or nothing after a delete), never an earlier write's: nothing written twice
  out of order, nothing staged lost.
* :func:`assert_recorded_in_queue_order` — the sink recorded every sequence of the queue once
  (written, skipped or set aside), in queue order: nothing behind a batch the consumer stopped
  on was written before that batch was set aside, and nothing was passed over unrecorded.
* :func:`assert_never_back` — ``next_sequence`` (and the epoch) never went back, in the order the
  store applied the manifest writes.
* :func:`assert_no_live_batch_deleted` — no object was deleted while the manifest referenced it,
  nor deleted and then appended without being written again first.
* :func:`assert_fenced_delivered_nothing` — once a newer consumer's ``initialize()`` returned, an
  older consumer delivered and acked nothing.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ConsumerEvent",
    "ObjectEvent",
    "assert_exactly_once",
    "assert_fenced_delivered_nothing",
    "assert_in_sink_or_set_aside",
    "assert_last_write_wins",
    "assert_never_back",
    "assert_no_live_batch_deleted",
    "assert_order_per_source",
    "assert_recorded_in_queue_order",
]


def assert_exactly_once(
    in_sink: Iterable[bytes], staged: Iterable[bytes], *, produced: Iterable[bytes] | None = None
) -> None:
    """Every staged record once in the sink; nothing twice; nothing that was never produced.

    Args:
        in_sink: the records the sink holds (one item per row).
        staged: records whose ``wait_staged()`` returned: each must be in the sink once.
        produced: every record ever handed to a producer (staged or not), when known: the
            sink must hold nothing else.
    """
    counts = Counter(in_sink)
    doubled = sorted(record for record, n in counts.items() if n > 1)
    assert not doubled, f"{len(doubled)} records are in the sink more than once: {doubled[:5]}"
    missing = sorted(set(staged) - set(counts))
    assert not missing, f"{len(missing)} staged records never reached the sink: {missing[:5]}"
    if produced is not None:
        strangers = sorted(set(counts) - set(produced))
        assert not strangers, f"the sink holds records nobody produced: {strangers[:5]}"


def assert_in_sink_or_set_aside(
    in_sink: Iterable[bytes],
    staged: Iterable[bytes],
    set_aside: Mapping[str, Sequence[bytes]],
    *,
    produced: Iterable[bytes] | None = None,
) -> None:
    """Every staged record is in the sink once or in one batch set aside; never both.

    Args:
        in_sink: the records the sink holds (one item per row).
        staged: records whose ``wait_staged()`` returned.
        set_aside: per quarantined batch (recorded in the sink, its dead-letter copy kept),
            the records it holds.
        produced: every record ever handed to a producer, when known.
    """
    counts = Counter(in_sink)
    aside = Counter(record for records in set_aside.values() for record in records)
    doubled = sorted(r for r, n in (counts + aside).items() if n > 1)
    assert not doubled, (
        f"{len(doubled)} records are in the sink or set aside more than once: {doubled[:5]}"
    )
    missing = sorted(set(staged) - set(counts) - set(aside))
    assert not missing, (
        f"{len(missing)} staged records are neither in the sink nor set aside: {missing[:5]}"
    )
    if produced is not None:
        strangers = sorted((set(counts) | set(aside)) - set(produced))
        assert not strangers, f"records nobody produced: {strangers[:5]}"


def assert_order_per_source(
    rows: Sequence[bytes], source_and_number: Callable[[bytes], tuple[str, int] | None]
) -> None:
    """Each source's records appear in ascending number, in sink order (sequence, index).

    Args:
        rows: the sink's records in queue order.
        source_and_number: maps a record to ``(source, n)``, or ``None`` to skip it.
    """
    last: dict[str, int] = {}
    for record in rows:
        key = source_and_number(record)
        if key is None:
            continue
        source, number = key
        previous = last.get(source, -1)
        assert number > previous, (
            f"{source}: record {number} after {previous} in queue order (records of one "
            "producer must keep their order)"
        )
        last[source] = number


def assert_last_write_wins(
    state: Mapping[Any, str],
    writes: Sequence[tuple[Any, str | None, bool]],
    *,
    table: str = "the table",
) -> None:
    """What an upserted table holds is, per key, the effect of its last write that reached it.

    Each key is written by one writer, in order; a write is ``(key, value, staged)``, value
    ``None`` for a delete, ``staged`` when its ``wait_staged()`` returned (it must arrive; one
    that did not may arrive or not). So the key's row must be what a write at or after its last
    staged write left — an earlier one would be a write applied after a newer one (a group
    written twice, out of order) or a staged write lost — and, with no staged write, may be
    absent. A key nobody wrote must not be there.

    Args:
        state: the table's rows, key -> value.
        writes: every write, in each key's order.
        table: for messages.
    """
    history: dict[Any, list[tuple[str | None, bool]]] = {}
    for key, value, staged in writes:
        history.setdefault(key, []).append((value, staged))
    strangers = sorted(map(str, set(state) - set(history)))
    assert not strangers, f"{table} holds keys nobody wrote: {strangers[:5]}"
    for key, made in history.items():
        staged_at = [i for i, (_, staged) in enumerate(made) if staged]
        first = staged_at[-1] if staged_at else 0
        allowed = {value for value, _ in made[first:]}
        if not staged_at:
            allowed.add(None)
        found = state.get(key)
        assert found in allowed, (
            f"{table}, key {key}: holds {found!r}, but its writes from its last staged one on "
            f"left one of {sorted(map(repr, allowed))} (every write, staged or not: {made})"
        )


def assert_recorded_in_queue_order(recorded: Sequence[Sequence[int]], next_sequence: int) -> None:
    """The sink's progress holds each sequence ``0 .. next_sequence - 1`` once, committed in
    queue order.

    Args:
        recorded: the sequences of the sink's progress rows for one queue, one list per commit
            (a group written in one transaction), in commit order. A written, skipped or
            quarantined batch each has one row; a replay adds none.
        next_sequence: the queue's ``next_sequence`` once everything was consumed.
    """
    previous: list[int] = []
    for commit in recorded:
        if previous and commit:
            assert min(commit) > max(previous), (
                f"sequences {sorted(commit)} were recorded after sequences {sorted(previous)}: "
                "the sink must record batches in queue order (nothing behind a stopped batch "
                "before it is set aside)"
            )
        previous = list(commit) or previous
    flat = [sequence for commit in recorded for sequence in commit]
    doubled = sorted(s for s, n in Counter(flat).items() if n > 1)
    assert not doubled, f"sequences recorded more than once: {doubled[:5]}"
    missing = sorted(set(range(next_sequence)) - set(flat))
    assert not missing, (
        f"{len(missing)} sequences of the queue were never recorded in the sink (written, "
        f"skipped or set aside), though the queue moved past them: {missing[:5]}"
    )
    strangers = sorted(s for s in flat if not 0 <= s < next_sequence)
    assert not strangers, f"the sink recorded sequences the queue never had: {strangers[:5]}"


def assert_never_back(footers: Sequence[tuple[int, int]]) -> None:
    """``(next_sequence, epoch)`` of every applied manifest write, in order: neither goes back."""
    for (seq_a, epoch_a), (seq_b, epoch_b) in itertools.pairwise(footers):
        assert seq_b >= seq_a, f"next_sequence went back from {seq_a} to {seq_b}"
        assert epoch_b >= epoch_a, f"the epoch went back from {epoch_a} to {epoch_b}"


@dataclass(frozen=True, slots=True)
class ObjectEvent:
    """Something the store applied to one batch object, in apply order."""

    step: int
    kind: str
    """``write``, ``delete`` or ``append`` (its location entered the manifest)."""
    path: str
    referenced: bool = False
    """For a delete: whether the manifest referenced the path at that moment."""


def assert_no_live_batch_deleted(events: Sequence[ObjectEvent]) -> None:
    """No delete of a referenced object; no append of an object deleted since its last write."""
    present: dict[str, bool] = {}
    for event in events:
        if event.kind == "write":
            present[event.path] = True
        elif event.kind == "delete":
            assert not event.referenced, (
                f"step {event.step}: {event.path} was deleted while the manifest referenced it"
            )
            present[event.path] = False
        elif event.kind == "append":
            assert present.get(event.path, False), (
                f"step {event.step}: {event.path} was appended while it did not exist "
                "(deleted since its last write, or never written)"
            )


@dataclass(frozen=True, slots=True)
class ConsumerEvent:
    """A consumer's delivery, ack, or a newer consumer's ``initialize()`` returning."""

    step: int
    consumer: int
    kind: str
    """``initialized``, ``delivered`` or ``acked``."""
    sequence: int | None = None
    """The batch delivered or acked through; for ``initialized``, the epoch it now holds."""


def assert_fenced_delivered_nothing(events: Sequence[ConsumerEvent]) -> None:
    """After consumer ``c``'s ``initialize()`` returned with epoch ``e``, no consumer holding
    an epoch below ``e`` delivered or acked, or took the queue back.

    Takeovers are ordered by the epoch each bumped to, not by who started or returned first:
    a takeover that runs inside another's, between two of its requests, may return first and
    be fenced by the one it ran inside (which bumped after it), or return last having been
    fenced already (its next call must then fail).
    """
    held: dict[int, int] = {}  # consumer -> the epoch its last initialize() returned
    newest: tuple[int, int] | None = None  # (epoch, consumer) of the newest takeover
    for event in events:
        consumer = event.consumer
        if event.kind == "initialized":
            epoch = event.sequence
            assert epoch is not None, f"step {event.step}: consumer {consumer}: no epoch"
            before = held.get(consumer)
            if before is not None and newest is not None and before < newest[0] < epoch:
                raise AssertionError(
                    f"step {event.step}: consumer {consumer} took the queue back (epoch "
                    f"{epoch}) after consumer {newest[1]} had taken it over (epoch {newest[0]})"
                )
            held[consumer] = epoch
            if newest is None or epoch > newest[0]:
                newest = (epoch, consumer)
        elif newest is not None and held.get(consumer, newest[0]) < newest[0]:
            raise AssertionError(
                f"step {event.step}: consumer {consumer} {event.kind} sequence "
                f"{event.sequence} after consumer {newest[1]} had taken over (epoch "
                f"{held[consumer]} < {newest[0]})"
            )
