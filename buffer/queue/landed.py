"""After an append whose outcome is unknown: which entries of the group are provably queued.

One compare-and-swap writes a whole group or nothing, and the consumer dequeues strictly in
sequence order. So when some of a group's locations are found in the manifest, contiguous and
in group order, they fix where the group's first entry went (the *anchor*); a member that is
not found is then either

* **dequeued**: its sequence (anchor + index) is below the manifest's first sequence — it was
  in the queue and the consumer already took it; or
* **missing**: its sequence is still in the queue's range, but another entry (or none) sits
  there. That happens when an *earlier* request for a prefix of the group (say ``[A, B]``,
  delayed in the network) landed while the producer was appending ``[A, B, C]``: ``A`` and
  ``B`` are in, ``C`` is not. Only a suffix of the group can be missing that way, because
  every group a producer writes starts at its oldest unsettled batch.

Anything else — found members out of order or not contiguous, a gap in the middle — means
something other than this producer wrote those locations, and is an error, never a guess.

When nothing of the group is found the answer depends on the queue's head: if nothing at or
after the attempted sequence has been dequeued, the group provably did not land; otherwise it
may have landed and been consumed whole. Either way the caller appends the *same* locations
again, and the sink, which records every location it wrote, skips those it has.

Pure: bytes in, a verdict out (:class:`Landings`: what the writer's ``landings()`` read).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from millpond.errors import MillpondError
from millpond.formats.manifest import Resume, decode_footer, find_locations, first_sequence

__all__ = ["Landing", "LandingStatus", "Landings", "resolve_landing"]


class LandingStatus(enum.Enum):
    LANDED = "landed"
    """Every member is in the manifest or was dequeued from it."""
    PARTIAL = "partial"
    """A prefix landed; ``Landing.missing`` (a suffix) did not."""
    NOT_LANDED = "not_landed"
    """None of the group is in the queue and nothing that could have been it was dequeued."""
    UNKNOWN = "unknown"
    """None of the group is in the manifest, but entries it could have been were dequeued."""


@dataclass(frozen=True, slots=True)
class Landing:
    """The verdict on one group."""

    status: LandingStatus
    sequences: tuple[int | None, ...]
    """Per member, its sequence when it provably landed (found or dequeued), else ``None``."""
    dequeued: frozenset[int] = frozenset()
    """Indices of members that landed and were already dequeued."""
    location: str | None = None  # Landings.of_any: the location the batch was found under

    @property
    def missing(self) -> tuple[int, ...]:
        """Indices of members that did not land (a suffix of the group)."""
        return tuple(i for i, seq in enumerate(self.sequences) if seq is None)


@dataclass(frozen=True, slots=True)
class Landings:
    """The manifest as one read found it (none: empty), to look in for appends in doubt."""

    raw: bytes
    name: str = "manifest"

    @property
    def next_sequence(self) -> int:
        return decode_footer(self.raw, name=self.name).next_sequence

    def of(self, locations: Sequence[str], *, from_sequence: int = 0) -> Landing:
        """The verdict on one group (:func:`resolve_landing`; raises what it raises)."""
        return resolve_landing(self.raw, locations, from_sequence=from_sequence, name=self.name)

    def of_any(self, locations: Sequence[str]) -> Landing:
        """One batch under any of ``locations``: ``LANDED`` as the last found, else ``UNKNOWN``."""
        found = find_locations(self.raw, set(locations))
        hit = next((loc for loc in reversed(locations) if loc in found), None)
        if hit is None:
            return Landing(LandingStatus.UNKNOWN, (None,))
        return Landing(LandingStatus.LANDED, (found[hit],), location=hit)


def resolve_landing(
    raw: bytes,
    locations: Sequence[str],
    *,
    from_sequence: int = 0,
    name: str = "manifest",
    resume: Resume | None = None,
) -> Landing:
    """Decide which of ``locations`` (one group, in append order) are in the queue.

    Args:
        raw: the manifest as read now.
        locations: the group's locations, in the order they were appended.
        from_sequence: the lowest sequence any attempt to append the group could have taken
            (``next_sequence`` when the first attempt was made; 0 when unknown).
        name: the manifest's path, for messages.
        resume: where ``raw`` goes on from the state the attempt was conditional on
            (:func:`~millpond.formats.manifest.resume_after`): only what follows is searched.

    Raises:
        MillpondError: the locations are in the manifest in a way one append of this group
            cannot explain (out of order, not contiguous, a missing member in the middle).
        FormatError: the manifest is corrupt.
    """
    footer = decode_footer(raw, name=name)
    head = first_sequence(raw, footer, name=name)
    found = find_locations(raw, set(locations), from_sequence=from_sequence, resume=resume)
    if not found:
        dequeued_since = head > from_sequence
        status = LandingStatus.UNKNOWN if dequeued_since else LandingStatus.NOT_LANDED
        return Landing(status, (None,) * len(locations))
    index = {location: i for i, location in enumerate(locations)}
    anchors = {sequence - index[location] for location, sequence in found.items()}
    if len(anchors) != 1:
        raise MillpondError(
            f"{name}: {len(found)} of the {len(locations)} locations of one append are in the "
            "manifest but not contiguous in append order; something else wrote them"
        )
    anchor = anchors.pop()
    sequences: list[int | None] = []
    dequeued: set[int] = set()
    for i, location in enumerate(locations):
        sequence = anchor + i
        if location in found:
            sequences.append(sequence)
        elif sequence < head:
            sequences.append(sequence)
            dequeued.add(i)
        else:
            sequences.append(None)
    last_found = max(index[location] for location in found)
    missing = [i for i, sequence in enumerate(sequences) if sequence is None]
    if any(i < last_found for i in missing):
        raise MillpondError(
            f"{name}: entries {min(missing)}.. of one append are absent from sequence "
            f"{anchor + min(missing)} on while later ones are present; something else wrote them"
        )
    status = LandingStatus.PARTIAL if missing else LandingStatus.LANDED
    return Landing(status, tuple(sequences), frozenset(dequeued))
