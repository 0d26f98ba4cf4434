"""WAL replay on restart against a raw sequential read of the same files.

DESIGN.md "Performance": WAL replay on restart; baseline a raw sequential read of the same
files; target >= 0.5.

Setup, per shape: a real ``Producer`` (``wal_sync="always"``, ``flush_size_bytes`` 16 MiB)
whose store is unreachable (an S3 endpoint on a closed loopback port) stages ``total`` bytes of
``produce()`` calls, then is closed with a short timeout: nothing was ever published, so its
WAL keeps every DATA record (plus the BIND records of the batches it sealed but could not
upload), in 64 MiB files, exactly as a producer that lost its store and then its process
leaves it.

* **replay** — what a restarted producer does before anything else: ``Wal.open`` (take the
  lock, read the sidecar, read every file and verify every record's CRC32C, index the
  unreleased records, start a fresh file) and ``fold_records`` (group DATA records under their
  BIND records), then close. Every staged record must come back.
* **raw** — ``open`` + ``readinto`` of an 8 MiB buffer until EOF, file by file, in the same
  order: the bytes replay has to read, with nothing done to them.

Rounds alternate the order (replay first, then raw first, ...). Two cache states:

* **warm** (the ratio): both sides read from the page cache (one untimed read first). Replay
  is then CPU-bound and its overhead over reading is fully visible.
* **cold**: before every timed side, ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each WAL file
  (only these files: the machine's page cache is otherwise left alone), so both read from the
  disk. Reported beside the ratio; on a shared disk it is noisier.

The figure is MB/s of WAL bytes on disk (framing included); the ratio is the median of the
per-round ratios replay/raw, for the main shape (4 x 64 KiB entries per call: Arrow-batch
sized, as ``bench_wal``). 16 x 1 KiB entries per call (per-record Python work dominates) is
reported beside it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import make_result, plot_spec

logger = logging.getLogger(__name__)

NAME = "wal_replay"
USES_STORE = False  # the store is unreachable on purpose
TARGET = 0.5
MB = 1_000_000
MiB = 1 << 20
CHUNK = 8 * MiB
ROTATE = 64 * MiB
# label -> (entry bytes, entries per produce() call)
SHAPES = {"main": (64 << 10, 4), "small": (1 << 10, 16)}


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stage(wal_dir: Path, entry_bytes: int, per_call: int, total: int) -> dict[str, Any]:
    """Stage ``total`` payload bytes with a producer that can never reach its store."""
    from millpond.producer import Producer, ProducerConfig

    port = _closed_port()
    config = ProducerConfig(
        store="s3://unreachable/wal-replay",
        store_options={
            "aws_endpoint": f"http://127.0.0.1:{port}",
            "aws_access_key_id": "bench",
            "aws_secret_access_key": "bench",
            "aws_region": "us-east-1",
            "aws_allow_http": "true",
        },
        wal_dir=wal_dir,
        wal_sync="always",
        flush_size_bytes=16 * MiB,
        wal_rotate_bytes=ROTATE,
    )
    base = os.urandom(entry_bytes)
    entries = [base[i:] + base[:i] for i in range(1, per_call + 1)]
    calls = total // (entry_bytes * per_call)
    started = time.perf_counter()
    producer = Producer(config)
    handles = [producer.produce(entries) for _ in range(calls)]
    for handle in handles:
        handle.wait_staged()
    staged_seconds = time.perf_counter() - started
    close_started = time.perf_counter()
    report = producer.close(timeout=0.2)
    close_seconds = time.perf_counter() - close_started
    if report.staged_records != calls:
        raise RuntimeError(f"expected {calls} calls left staged, found {report.staged_records}")
    return {
        "calls": calls,
        "staged_seconds": round(staged_seconds, 2),
        "close_seconds": round(close_seconds, 2),
    }


def _wal_files(wal_dir: Path) -> list[Path]:
    return sorted(wal_dir.glob("*.wal"))


def _drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(files: list[Path]) -> tuple[float, int]:
    buffer = bytearray(CHUNK)
    total = 0
    started = time.perf_counter()
    for path in files:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - started, total


def _replay(wal_dir: Path, expected_calls: int) -> tuple[float, dict[str, Any]]:
    from millpond.formats.wal import RecordType
    from millpond.producer._recovery import fold_records
    from millpond.wal import Wal

    started = time.perf_counter()
    wal = Wal.open(wal_dir, rotate_bytes=ROTATE)
    folded = fold_records(wal.records)
    wal.close()
    seconds = time.perf_counter() - started
    data = sum(1 for r in wal.records if r.type is RecordType.DATA)
    if data != expected_calls or not wal.report.clean or wal.report.torn_tail_bytes:
        raise RuntimeError(
            f"replay found {data} DATA records, expected {expected_calls}: {wal.report.summary()}"
        )
    return seconds, {
        "records": len(wal.records),
        "data_records": data,
        "bound_batches": len(folded.batches),
        "unbound_records": len(folded.unbound),
        "files_scanned": wal.report.files_scanned,
    }


def _measure(wal_dir: Path, calls: int, rounds: int, *, cold: bool) -> dict[str, Any]:
    files = _wal_files(wal_dir)
    if not cold:
        _raw_read(files)  # warm the page cache
    replay_times: list[float] = []
    raw_times: list[float] = []
    nbytes = 0
    details: dict[str, Any] = {}
    for i in range(rounds):
        for side in ("replay", "raw") if i % 2 == 0 else ("raw", "replay"):
            files = _wal_files(wal_dir)  # replay replaces the (empty) newest file
            if cold:
                _drop_cache(files)
            if side == "raw":
                seconds, nbytes = _raw_read(files)
                raw_times.append(seconds)
            else:
                seconds, details = _replay(wal_dir, calls)
                replay_times.append(seconds)
    ratios = [raw / replay for replay, raw in zip(replay_times, raw_times, strict=True)]
    return {
        "ratio": statistics.median(ratios),
        "pair_ratios": [round(r, 3) for r in ratios],
        "replay_mb_s": [round(nbytes / t / MB, 1) for t in replay_times],
        "raw_mb_s": [round(nbytes / t / MB, 1) for t in raw_times],
        "replay_median_mb_s": round(nbytes / statistics.median(replay_times) / MB, 1),
        "raw_median_mb_s": round(nbytes / statistics.median(raw_times) / MB, 1),
        "replay_seconds": [round(t, 4) for t in replay_times],
        "raw_seconds": [round(t, 4) for t in raw_times],
        "wal_bytes": nbytes,
        "wal_files": len(_wal_files(wal_dir)),
        **details,
    }


def run(quick: bool) -> dict[str, Any]:
    sizes = (
        {"main": 128 * MiB, "small": 32 * MiB} if quick else {"main": 512 * MiB, "small": 128 * MiB}
    )
    rounds = 3 if quick else 7
    root = Path(tempfile.mkdtemp(prefix="millpond-bench-wal-replay-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        for label, (entry_bytes, per_call) in SHAPES.items():
            wal_dir = root / label
            staging = _stage(wal_dir, entry_bytes, per_call, sizes[label])
            calls = staging["calls"]
            results[label] = {
                "entry_bytes": entry_bytes,
                "entries_per_call": per_call,
                "payload_bytes": calls * entry_bytes * per_call,
                "staging": staging,
                "warm": _measure(wal_dir, calls, rounds, cold=False),
                "cold": _measure(wal_dir, calls, rounds, cold=True),
            }
            logger.info(
                "%s: warm replay %.0f MB/s vs raw %.0f MB/s; cold %.0f vs %.0f MB/s",
                label,
                results[label]["warm"]["replay_median_mb_s"],
                results[label]["warm"]["raw_median_mb_s"],
                results[label]["cold"]["replay_median_mb_s"],
                results[label]["cold"]["raw_median_mb_s"],
            )
            shutil.rmtree(wal_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    main = results["main"]
    ratio = main["warm"]["ratio"]
    xs = list(range(1, rounds + 1))
    return make_result(
        NAME,
        ratio=ratio,
        target=TARGET,
        figures={
            "replay_mb_s": main["warm"]["replay_median_mb_s"],
            "cold_ratio": round(main["cold"]["ratio"], 3),
            "cold_replay_mb_s": main["cold"]["replay_median_mb_s"],
            "small_ratio": round(results["small"]["warm"]["ratio"], 3),
            "small_cold_ratio": round(results["small"]["cold"]["ratio"], 3),
            "shapes": results,
        },
        baseline={
            "raw_read_mb_s": main["warm"]["raw_median_mb_s"],
            "cold_raw_read_mb_s": main["cold"]["raw_median_mb_s"],
            "chunk_bytes": CHUNK,
        },
        series=[
            *(
                plot_spec(
                    f"page cache {state}: replay vs raw read",
                    "round",
                    "MB/s (WAL bytes)",
                    xs,
                    {f"{label} replay": results[label][cache]["replay_mb_s"] for label in results}
                    | {f"{label} raw read": results[label][cache]["raw_mb_s"] for label in results},
                )
                for cache, state in (("warm", "warm"), ("cold", "dropped (fadvise)"))
            ),
            plot_spec(
                "replay / raw read per round",
                "round",
                "ratio",
                xs,
                {
                    f"{label} {cache}": results[label][cache]["pair_ratios"]
                    for label in results
                    for cache in ("warm", "cold")
                },
                hline=("target 0.5", TARGET),
            ),
        ],
        headline=(
            f"replay {main['warm']['replay_median_mb_s']:.0f} MB/s vs raw read "
            f"{main['warm']['raw_median_mb_s']:.0f} MB/s (page cache); cold "
            f"{main['cold']['ratio']:.2f}; 1 KiB entries {results['small']['warm']['ratio']:.2f}"
        ),
        notes=(
            "ratio: Wal.open + fold_records vs open+readinto(8 MiB) of the same files, page "
            "cache warm, 4 x 64 KiB entries per call; cold (fadvise DONTNEED) and 16 x 1 KiB "
            "entries per call reported beside it"
        ),
    )
