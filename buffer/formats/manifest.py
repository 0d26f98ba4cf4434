"""The queue manifest wire format, version 1 (OpenData RFC 0001, "Manifest Format").

Pure functions over bytes: no IO, no clock. Layout, little-endian::

    entry*  := entry_len u32 | sequence u64 | location_len u16 | location |
               metadata_count u32 | (start_index u32 | ingestion_time_ms i64 |
                                     payload_len u32 | payload)*
    footer  := entry_count u32 | next_sequence u64 | epoch u64 | version u16   (22 bytes)

``entry_len`` counts the bytes after itself. Appending strips the footer, adds encoded entries
and writes a new footer; existing entries are never decoded on that path.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from millpond.errors import FormatError, InvalidInputError

__all__ = [
    "FOOTER_SIZE",
    "MANIFEST_VERSION",
    "Footer",
    "Manifest",
    "ManifestEntry",
    "ManifestView",
    "Metadata",
    "PendingEntry",
    "Resume",
    "append_entries",
    "decode_footer",
    "decode_manifest",
    "decode_tail",
    "empty_manifest",
    "encode_entry",
    "find_locations",
    "first_sequence",
    "iter_locations",
    "locations_from",
    "remove_through",
    "resume_after",
    "view_manifest",
    "with_epoch",
]

MANIFEST_VERSION = 1
_FOOTER = struct.Struct("<IQQH")
_ENTRY_HEAD = struct.Struct("<IQH")  # entry_len, sequence, location_len
_SEQ_LOC = struct.Struct("<QH")  # the same fields after entry_len
_U32 = struct.Struct("<I")
_META_HEAD = struct.Struct("<Iq")  # start_index, ingestion_time_ms
FOOTER_SIZE = _FOOTER.size  # 22
_LEN_SIZE = 4
# Bytes of an entry after entry_len with an empty location and no metadata.
_MIN_ENTRY_LEN = 8 + 2 + 4
_META_FIXED = 4 + 8 + 4

_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFF_FFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Metadata:
    """One metadata item: the records from ``start_index`` up to the next item share it."""

    start_index: int
    """Index in the batch of the first record this item covers."""
    ingestion_time_ms: int
    """Wall-clock milliseconds since the Unix epoch when the records were produced."""
    payload: bytes = b""
    """Opaque, application-defined bytes from ``produce(..., metadata=...)``."""


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """An entry about to be appended; the manifest assigns its sequence."""

    location: str
    metadata: tuple[Metadata, ...] = ()


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """An entry as stored: a batch location with its sequence and metadata items."""

    sequence: int
    location: str
    metadata: tuple[Metadata, ...] = ()


@dataclass(frozen=True, slots=True)
class Footer:
    """The fixed 22-byte trailer."""

    entry_count: int
    next_sequence: int
    epoch: int
    version: int = MANIFEST_VERSION

    def encode(self) -> bytes:
        return _FOOTER.pack(self.entry_count, self.next_sequence, self.epoch, self.version)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A fully decoded and validated manifest."""

    footer: Footer
    entries: tuple[ManifestEntry, ...]

    @property
    def epoch(self) -> int:
        return self.footer.epoch

    @property
    def next_sequence(self) -> int:
        return self.footer.next_sequence

    @property
    def first_sequence(self) -> int | None:
        """Sequence of the oldest entry, or ``None`` when the queue is empty."""
        return self.entries[0].sequence if self.entries else None


def empty_manifest(*, epoch: int = 0, next_sequence: int = 0) -> bytes:
    """The footer alone: a manifest with no entries."""
    return Footer(entry_count=0, next_sequence=next_sequence, epoch=epoch).encode()


def encode_entry(sequence: int, entry: PendingEntry) -> bytes:
    """Encode one entry, validating every field against its wire width.

    Raises:
        InvalidInputError: a location over u16 bytes, a payload over u32 bytes, or an
            integer outside its field's range.
    """
    location = entry.location.encode("utf-8")
    if not location:
        raise InvalidInputError("location: expected a non-empty path, found ''")
    if len(location) > _U16_MAX:
        raise InvalidInputError(
            f"location: expected at most {_U16_MAX} bytes, found {len(location)}"
        )
    _check_range("sequence", sequence, 0, _U64_MAX)
    _check_range("metadata_count", len(entry.metadata), 0, _U32_MAX)
    parts = [b"", _SEQ_LOC.pack(sequence, len(location)), location, _U32.pack(len(entry.metadata))]
    for item in entry.metadata:
        _check_range("start_index", item.start_index, 0, _U32_MAX)
        _check_range("ingestion_time_ms", item.ingestion_time_ms, _I64_MIN, _I64_MAX)
        payload = bytes(item.payload)
        _check_range("payload_len", len(payload), 0, _U32_MAX)
        parts.append(_META_HEAD.pack(item.start_index, item.ingestion_time_ms))
        parts.append(_U32.pack(len(payload)))
        parts.append(payload)
    body_len = sum(len(p) for p in parts)
    _check_range("entry_len", body_len, 0, _U32_MAX)
    parts[0] = _U32.pack(body_len)
    return b"".join(parts)


def decode_footer(raw: bytes | memoryview, *, name: str = "manifest") -> Footer:
    """Read and validate the footer only (size, version, counts that bytes can hold).

    Raises:
        FormatError: too short for a footer, or an unknown version.
    """
    if len(raw) < FOOTER_SIZE:
        raise FormatError(
            f"{name}: footer at byte 0: expected at least {FOOTER_SIZE} bytes, found {len(raw)}",
            field="footer",
            offset=0,
        )
    start = len(raw) - FOOTER_SIZE
    entry_count, next_sequence, epoch, version = _FOOTER.unpack_from(raw, start)
    if version != MANIFEST_VERSION:
        raise FormatError(
            f"{name}: version at byte {start + 20}: expected {MANIFEST_VERSION}, found {version}",
            field="version",
            offset=start + 20,
        )
    # Every entry takes at least 4 + _MIN_ENTRY_LEN bytes; a count the body cannot hold is
    # corrupt, and checking it here keeps later loops bounded by the bytes present.
    if entry_count * (_LEN_SIZE + _MIN_ENTRY_LEN) > start:
        raise FormatError(
            f"{name}: entry_count at byte {start}: {entry_count} entries cannot fit in "
            f"{start} bytes",
            field="entry_count",
            offset=start,
        )
    return Footer(entry_count=entry_count, next_sequence=next_sequence, epoch=epoch)


def decode_tail(tail: bytes | memoryview, *, name: str = "manifest") -> Footer:
    """The footer from the manifest's last :data:`FOOTER_SIZE` bytes alone.

    Checks the size and the version; the entries are not there to check the counts against.

    Raises:
        FormatError: not a footer's size, or an unknown version.
    """
    if len(tail) != FOOTER_SIZE:
        raise FormatError(
            f"{name}: footer: expected the last {FOOTER_SIZE} bytes, found {len(tail)}",
            field="footer",
        )
    entry_count, next_sequence, epoch, version = _FOOTER.unpack_from(tail, 0)
    if version != MANIFEST_VERSION:
        raise FormatError(
            f"{name}: version at footer byte 20: expected {MANIFEST_VERSION}, found {version}",
            field="version",
        )
    return Footer(entry_count=entry_count, next_sequence=next_sequence, epoch=epoch)


def append_entries(raw: bytes, entries: Sequence[PendingEntry]) -> tuple[bytes, range]:
    """Append ``entries`` to an encoded manifest without decoding the existing ones.

    Returns:
        The new manifest bytes and the sequences assigned, in order.

    Raises:
        FormatError: the existing footer is invalid.
        InvalidInputError: an entry does not fit the wire format.
    """
    footer = decode_footer(raw)
    first = footer.next_sequence
    _check_range("next_sequence", first + len(entries), 0, _U64_MAX)
    encoded = [encode_entry(first + i, entry) for i, entry in enumerate(entries)]
    new_footer = replace(
        footer, entry_count=footer.entry_count + len(entries), next_sequence=first + len(entries)
    )
    _check_range("entry_count", new_footer.entry_count, 0, _U32_MAX)
    body = memoryview(raw)[: len(raw) - FOOTER_SIZE]
    return b"".join([body, *encoded, new_footer.encode()]), range(first, first + len(entries))


def with_epoch(raw: bytes, epoch: int) -> bytes:
    """The same manifest with a new epoch in its footer.

    Raises:
        FormatError: the existing footer is invalid.
    """
    footer = decode_footer(raw)
    _check_range("epoch", epoch, 0, _U64_MAX)
    return raw[: len(raw) - FOOTER_SIZE] + replace(footer, epoch=epoch).encode()


def remove_through(raw: bytes, through: int) -> tuple[bytes, int]:
    """Drop every entry with ``sequence <= through``, walking entries by ``entry_len``.

    Returns:
        The new manifest bytes and how many entries were removed (0 means unchanged).

    Raises:
        FormatError: the entry framing is inconsistent.
    """
    footer = decode_footer(raw)
    cut = 0
    removed = 0
    for _start, end, sequence in _entry_spans(raw, footer, name="manifest"):
        if sequence > through:
            break
        cut = end
        removed += 1
    if removed == 0:
        return raw, 0
    new_footer = replace(footer, entry_count=footer.entry_count - removed)
    return raw[cut : len(raw) - FOOTER_SIZE] + new_footer.encode(), removed


@dataclass(frozen=True)
class Resume:
    """Where a later state of a manifest goes on from an earlier one it kept whole.

    A writer that lost a race looks only at what the winners appended after the state its
    write was conditional on; when nothing was dequeued in between, the later state begins
    with the earlier one's entries byte for byte, and a walk can start where they end instead
    of at the first entry (a lost race then costs what the winners wrote, not the backlog).
    """

    offset: int
    """Byte offset in the later state where the earlier state's entries end."""
    entries: int
    """Entries before ``offset``."""
    next_sequence: int
    """The earlier state's ``next_sequence``: every entry from ``offset`` on is at or above it."""


def resume_after(earlier: bytes, later: bytes) -> Resume | None:
    """The :class:`Resume` of ``later`` after ``earlier``, or ``None`` when ``later`` does not
    begin with every entry of ``earlier`` (something was dequeued, or it is another manifest).

    Equal leading bytes are enough: framing is parsed from the first byte on, so the same
    bytes frame the same entries and end on an entry boundary at the earlier body's end.

    Raises:
        FormatError: ``earlier`` has no valid footer.
    """
    footer = decode_footer(earlier)
    body = len(earlier) - FOOTER_SIZE
    if len(later) < body + FOOTER_SIZE or not later.startswith(memoryview(earlier)[:body]):
        return None  # (startswith compares in place; slicing bytes would copy both)
    return Resume(body, footer.entry_count, footer.next_sequence)


def find_locations(
    raw: bytes, locations: set[str], *, from_sequence: int = 0, resume: Resume | None = None
) -> dict[str, int]:
    """Map each of ``locations`` found at ``sequence >= from_sequence`` to its sequence.

    Used after an ambiguous write to learn whether our own append already landed; only the
    location field of candidate entries is decoded. ``resume`` (:func:`resume_after`) skips
    the entries of an earlier state when they all lie below ``from_sequence``.

    Raises:
        FormatError: the entry framing is inconsistent.
    """
    return {
        location: sequence
        for sequence, location in iter_locations(raw, from_sequence, resume=resume)
        if location in locations
    }


def locations_from(raw: bytes, from_sequence: int, *, resume: Resume | None = None) -> list[str]:
    """The locations of the entries at ``sequence >= from_sequence``, in queue order.

    Only the location field is decoded (what a writer that lost a race reads of the winners).
    ``resume`` as in :func:`find_locations`.

    Raises:
        FormatError: the entry framing is inconsistent.
    """
    return [location for _sequence, location in iter_locations(raw, from_sequence, resume=resume)]


def iter_locations(
    raw: bytes, from_sequence: int = 0, *, resume: Resume | None = None
) -> Iterator[tuple[int, str]]:
    """``(sequence, location)`` of each entry at ``sequence >= from_sequence``, one at a time
    (only the location field is decoded; nothing is kept). ``resume`` as in
    :func:`find_locations`.

    Raises:
        FormatError: the footer or the entry framing is invalid (while iterating).
    """
    footer = decode_footer(raw)
    view = memoryview(raw)
    if resume is not None and resume.next_sequence > from_sequence:
        resume = None  # entries before the resume point may be wanted
    for start, _end, sequence in _entry_spans(raw, footer, name="manifest", resume=resume):
        if sequence < from_sequence:
            continue
        location_len = _ENTRY_HEAD.unpack_from(view, start)[2]
        begin = start + _ENTRY_HEAD.size
        yield sequence, bytes(view[begin : begin + location_len]).decode("utf-8", "replace")


def first_sequence(
    raw: bytes | memoryview, footer: Footer | None = None, *, name: str = "manifest"
) -> int:
    """The lowest sequence still in the queue: the first entry's, or ``next_sequence`` when the
    queue is empty. Every sequence below it has been dequeued. Reads one entry header only.

    Raises:
        FormatError: the footer or the first entry's framing is invalid.
    """
    footer = footer if footer is not None else decode_footer(raw, name=name)
    if footer.entry_count == 0:
        return footer.next_sequence
    for _start, _end, sequence in _entry_spans(raw, footer, name=name):
        return sequence
    return footer.next_sequence


def decode_manifest(raw: bytes | memoryview, *, name: str = "manifest") -> Manifest:
    """Decode and validate a whole manifest.

    Checks the version, every ``entry_len`` against its fields, that sequences are
    contiguous and end at ``next_sequence - 1``, and ``entry_count`` against the entries found.

    Raises:
        FormatError: naming the field and byte offset of the first inconsistency.
    """
    footer = decode_footer(raw, name=name)
    view = memoryview(raw)
    entries = [
        _decode_entry(view, start, end, sequence, name)
        for start, end, sequence in _contiguous_spans(view, footer, name)
    ]
    return Manifest(footer=footer, entries=tuple(entries))


def _contiguous_spans(
    raw: bytes | memoryview, footer: Footer, name: str
) -> Iterator[tuple[int, int, int]]:
    """:func:`_entry_spans`, checking also that the sequences are contiguous and end at
    ``next_sequence - 1``."""
    previous: int | None = None
    for start, end, sequence in _entry_spans(raw, footer, name=name):
        if previous is not None and sequence != previous + 1:
            raise FormatError(
                f"{name}: sequence at byte {start + 4}: expected {previous + 1} "
                f"(contiguous), found {sequence}",
                field="sequence",
                offset=start + 4,
            )
        previous = sequence
        yield start, end, sequence
    if previous is not None and previous + 1 != footer.next_sequence:
        offset = len(raw) - FOOTER_SIZE + 4
        raise FormatError(
            f"{name}: next_sequence at byte {offset}: expected {previous + 1} "
            f"(one past the last entry), found {footer.next_sequence}",
            field="next_sequence",
            offset=offset,
        )


def _entry_spans(
    raw: bytes | memoryview, footer: Footer, *, name: str, resume: Resume | None = None
) -> Iterator[tuple[int, int, int]]:
    """Yield ``(start, end, sequence)`` of each entry, validating the framing only; with
    ``resume``, of the entries from its offset on."""
    body_end = len(raw) - FOOTER_SIZE
    offset = resume.offset if resume is not None else 0
    count = resume.entries if resume is not None else 0
    while offset < body_end:
        if body_end - offset < _LEN_SIZE + _MIN_ENTRY_LEN:
            raise FormatError(
                f"{name}: entry_len at byte {offset}: expected an entry of at least "
                f"{_LEN_SIZE + _MIN_ENTRY_LEN} bytes, found {body_end - offset} bytes left",
                field="entry_len",
                offset=offset,
            )
        entry_len, sequence, location_len = _ENTRY_HEAD.unpack_from(raw, offset)
        end = offset + _LEN_SIZE + entry_len
        if entry_len < _MIN_ENTRY_LEN + location_len or end > body_end:
            raise FormatError(
                f"{name}: entry_len at byte {offset}: {entry_len} does not fit "
                f"(location_len {location_len}, {body_end - offset - _LEN_SIZE} bytes left)",
                field="entry_len",
                offset=offset,
            )
        count += 1
        yield offset, end, sequence
        offset = end
    if count != footer.entry_count:
        raise FormatError(
            f"{name}: entry_count at byte {body_end}: expected {count} (entries found), "
            f"found {footer.entry_count}",
            field="entry_count",
            offset=body_end,
        )


def _decode_entry(
    view: memoryview, start: int, end: int, sequence: int, name: str
) -> ManifestEntry:
    location_len = _ENTRY_HEAD.unpack_from(view, start)[2]
    pos = start + _ENTRY_HEAD.size
    try:
        location = str(view[pos : pos + location_len], "utf-8")
    except UnicodeDecodeError as err:
        raise FormatError(
            f"{name}: location at byte {pos}: not valid UTF-8 ({err.reason})",
            field="location",
            offset=pos,
        ) from err
    pos += location_len
    (metadata_count,) = _U32.unpack_from(view, pos)
    if metadata_count * _META_FIXED > end - pos - 4:
        raise FormatError(
            f"{name}: metadata_count at byte {pos}: {metadata_count} items cannot fit in "
            f"{end - pos - 4} bytes of entry {sequence}",
            field="metadata_count",
            offset=pos,
        )
    pos += 4
    items: list[Metadata] = []
    for _ in range(metadata_count):
        start_index, ingestion_time_ms = _META_HEAD.unpack_from(view, pos)
        (payload_len,) = _U32.unpack_from(view, pos + _META_HEAD.size)
        payload_start = pos + _META_FIXED
        if payload_start + payload_len > end:
            raise FormatError(
                f"{name}: payload_len at byte {pos + _META_HEAD.size}: {payload_len} runs past "
                f"the end of entry {sequence} (byte {end})",
                field="payload_len",
                offset=pos + _META_HEAD.size,
            )
        payload = bytes(view[payload_start : payload_start + payload_len])
        items.append(Metadata(start_index, ingestion_time_ms, payload))
        pos = payload_start + payload_len
        if pos + (_META_FIXED if len(items) < metadata_count else 0) > end:
            raise FormatError(
                f"{name}: metadata_count at byte {pos}: entry {sequence} ends before its "
                f"{metadata_count} metadata items",
                field="metadata_count",
                offset=pos,
            )
    if pos != end:
        raise FormatError(
            f"{name}: entry_len at byte {start}: fields end at byte {pos}, entry_len says {end}",
            field="entry_len",
            offset=start,
        )
    return ManifestEntry(sequence=sequence, location=location, metadata=tuple(items))


def _check_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidInputError(f"{field}: expected {low}..{high}, found {value}")


class ManifestView:
    """A manifest whose framing and sequences are checked, its entries decoded only when asked.

    A backlog of a million entries is 82 MB of manifest but about half a gigabyte as
    :class:`ManifestEntry` objects: a reader that goes through it in order (the consumer's
    read-ahead, a move into the backlog index, a collector's floor) decodes one entry at a
    time from the bytes instead. Each entry's fields (its UTF-8, its metadata) are checked
    when it is decoded; :func:`view_manifest` checks everything else up front, as
    :func:`decode_manifest` does.
    """

    __slots__ = ("_offsets", "footer", "name", "raw")

    def __init__(self, raw: bytes, footer: Footer, offsets: array[int], name: str) -> None:
        self.raw = raw
        self.footer = footer
        self.name = name
        self._offsets = offsets  # where each entry starts, then where the body ends

    @property
    def epoch(self) -> int:
        return self.footer.epoch

    @property
    def next_sequence(self) -> int:
        return self.footer.next_sequence

    @property
    def first_sequence(self) -> int | None:
        """Sequence of the oldest entry, or ``None`` when the queue is empty."""
        return self.footer.next_sequence - len(self) if len(self) else None

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def entries_from(self, sequence: int) -> Iterator[ManifestEntry]:
        """The entries at ``sequence`` and after, in order, each decoded as it is taken.

        Raises:
            FormatError: an entry's fields do not decode (while iterating).
        """
        first = self.first_sequence
        if first is None:
            return
        view = memoryview(self.raw)
        for i in range(max(0, sequence - first), len(self)):
            start, end = self._offsets[i], self._offsets[i + 1]
            yield _decode_entry(view, start, end, first + i, self.name)

    def entry(self, sequence: int) -> ManifestEntry | None:
        """The entry ``sequence``, or ``None`` when the manifest does not hold it.

        Raises:
            FormatError: its fields do not decode.
        """
        first = self.first_sequence
        if first is None or not first <= sequence < self.footer.next_sequence:
            return None
        return next(self.entries_from(sequence))

    def decode(self) -> Manifest:
        """Every entry, decoded (:func:`decode_manifest`).

        Raises:
            FormatError: an entry's fields do not decode.
        """
        return Manifest(footer=self.footer, entries=tuple(self.entries_from(0)))


def view_manifest(raw: bytes, *, name: str = "manifest") -> ManifestView:
    """Check a manifest's footer, framing and sequences (as :func:`decode_manifest` does, but
    each entry's fields) and return a :class:`ManifestView` of it; no entry is decoded.

    Raises:
        FormatError: naming the field and byte offset of the first inconsistency.
    """
    footer = decode_footer(raw, name=name)
    offsets = array("Q", (start for start, _end, _seq in _contiguous_spans(raw, footer, name)))
    offsets.append(len(raw) - FOOTER_SIZE)
    return ManifestView(raw, footer, offsets, name)
