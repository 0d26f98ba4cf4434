"""Issue 44, case 9: a torn WAL header is a torn tail, not corruption.

A new WAL file's 28-byte header is written and fdatasynced before any record goes into it.
Power lost during that sync leaves a file that never held a record: shorter than the header
(the size never reached the disk), or of the header's size (or a file system block) with the
parts of it that never reached the disk read back as zeros. Recovery cuts such a newest file as
a torn tail and reports nothing lost. A header damaged in any other way, or one followed by
anything but zeros (a record, say), is still corruption: the file is quarantined and its
records salvaged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from millpond.formats.wal import FILE_HEADER_SIZE, FileHeader, encode_file_header
from millpond.wal import Wal


def _wal_with_records(directory: Path, count: int = 3) -> int:
    """A WAL directory holding ``count`` synced records; the number its next file gets."""
    with Wal.open(directory) as wal:
        wal.append_data([(1_700_000_000_000 + i, b"m", [f"e{i}".encode()]) for i in range(count)])
        wal.sync()
    return max(int(p.name.removesuffix(".wal")) for p in directory.glob("*.wal")) + 1


def _header(file_no: int) -> bytes:
    return encode_file_header(FileHeader(file_no=file_no))


def _zeroed(data: bytes, start: int, end: int) -> bytes:
    return data[:start] + b"\0" * (end - start) + data[end:]


# What power loss can leave of a new file's header: each byte as written or zero.
_TORN = {
    "zeros_in_the_middle": lambda h: _zeroed(h, 8, 20),
    "all_zeros": lambda h: b"\0" * FILE_HEADER_SIZE,
    "crc_not_written": lambda h: _zeroed(h, 24, 28),
    "magic_not_written": lambda h: _zeroed(h, 0, 12),
    "a_zero_filled_block": lambda h: _zeroed(h, 16, 28) + b"\0" * (4096 - FILE_HEADER_SIZE),
    "prefix_only": lambda h: h[:8],
    "prefix_then_zeros": lambda h: h[:20] + b"\0" * 4,
    "empty": lambda h: b"",
}


@pytest.mark.parametrize("tear", sorted(_TORN))
def test_case9_torn_wal_header_of_a_new_file_is_a_torn_tail(tmp_path: Path, tear: str) -> None:
    file_no = _wal_with_records(tmp_path)
    torn = _TORN[tear](_header(file_no))
    path = tmp_path / f"{file_no:020d}.wal"
    path.write_bytes(torn)  # the crash came while this file's header was being synced
    with Wal.open(tmp_path) as wal:
        report = wal.report
        assert [r.seq for r in wal.records] == [0, 1, 2]
        assert report.clean, report.summary()
        assert report.quarantined == ()
        assert report.lost_regions == ()
        assert report.torn_tail_bytes == len(torn)
        if torn:
            assert report.torn_tail_file == path.name
        assert not path.exists()
        wal.append_data([(1_700_000_000_100, b"m", [b"after"])])
        wal.sync()
    assert not (tmp_path / "quarantine").exists()
    with Wal.open(tmp_path) as wal:
        assert [r.seq for r in wal.records] == [0, 1, 2, 3]
        assert wal.report.clean


def test_case9_torn_wal_header_before_records_is_still_corruption(tmp_path: Path) -> None:
    """A header with zeros in the middle in a file that holds records after it cannot be a
    header the crash cut short (it was synced before the first record): the file is damaged.
    It is quarantined, and its records are salvaged."""
    _wal_with_records(tmp_path)
    (only,) = tmp_path.glob("*.wal")  # the newest file, as a torn one would be
    raw = only.read_bytes()
    assert len(raw) > FILE_HEADER_SIZE
    only.write_bytes(_zeroed(raw, 8, 20))
    with Wal.open(tmp_path) as wal:
        report = wal.report
        assert not report.clean
        assert len(report.quarantined) == 1
        assert report.torn_tail_bytes == 0
        assert [r.seq for r in wal.records] == [0, 1, 2]  # salvaged into the new file


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda h: h[:9] + b"X" + h[10:], id="a_byte_neither_written_nor_zero"),
        pytest.param(lambda h: _zeroed(h, 8, 20) + b"\0" * 100 + b"\x01", id="garbage_after"),
    ],
)
def test_case9_a_header_damaged_otherwise_is_still_corruption(
    tmp_path: Path, damage: object
) -> None:
    """No power loss leaves a header byte other than the one written or zero, nor anything
    but zeros after a header that never reached the disk: those stay corruption."""
    file_no = _wal_with_records(tmp_path)
    path = tmp_path / f"{file_no:020d}.wal"
    path.write_bytes(damage(_header(file_no)))  # type: ignore[operator]
    with Wal.open(tmp_path) as wal:
        assert [r.seq for r in wal.records] == [0, 1, 2]
        assert len(wal.report.quarantined) == 1
        assert not wal.report.clean
        assert not path.exists()
