"""WAL staging throughput against raw ``write`` + ``fdatasync`` at the same group-commit cadence.

The ratio (target >= 0.8, DESIGN.md) is the staging path a caller sees: ``produce()`` calls
(4 x 64 KiB entries each — Arrow-batch-sized, ``wal_sync="always"``) until every
``wait_staged()`` returned — the
inbox, the WAL writer's encode + write, the syncer's group ``fdatasync``, the handles. Its
baseline is raw ``os.write`` + ``os.fdatasync`` of the same payload bytes in as many chunks as
the producer needed fdatasyncs in that round (the same group-commit cadence), on the same disk,
right next to it; the figure is the median of the per-pair ratios, because fdatasync times on
a shared machine swing by several times from one second to the next. The same measurement with
16 x 1 KiB entries per call is reported beside it: there per-call Python work bounds staging.

Alongside, ``wal_layer_shapes`` measures ``Wal.append_data`` + ``Wal.sync`` alone, single-
threaded and unpipelined, for several entry sizes, each against raw write + fdatasync with one
sync per group of the same bytes. Figures are payload MB/s (entry bytes only; framing is not
counted as useful work).
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import make_result, plot_spec
from millpond.wal import Wal

NAME = "wal"
USES_STORE = False  # a memory store: nothing for injected latency to act on
TARGET = 0.8
MB = 1_000_000

# produce() shapes for the staging ratio: (entry bytes, entries per call). "arrow" is the
# first-class path (produce_arrow: one IPC stream per record batch, tens of KiB and up) and
# gives the ratio; "small" (16 x 1 KiB per call) is reported beside it.
STAGING_SHAPES = {"arrow": (65536, 4), "small": (1024, 16)}
# (label, entry bytes, entries per produce() call, calls per fdatasync)
SHAPES = [
    ("main 1KiB x16 x64", 1024, 16, 64),
    ("small 128B x1 x256", 128, 1, 256),
    ("medium 16KiB x4 x16", 16384, 4, 16),
    ("large 256KiB x4 x4", 262144, 4, 4),
]


def _calls(entry_bytes: int, per_call: int, count: int) -> list[tuple[int, bytes, list[bytes]]]:
    base = os.urandom(entry_bytes)
    return [
        (1_700_000_000_000 + i, b"meta", [base[j:] + base[:j] for j in range(per_call)])
        for i in range(count)
    ]


def _wal_round(directory: Path, groups: list[list[tuple[int, bytes, list[bytes]]]]) -> float:
    with Wal.open(directory, rotate_bytes=64 << 20) as wal:
        started = time.perf_counter()
        for group in groups:
            wal.append_data(group)
            wal.sync()
        return time.perf_counter() - started


def _raw_round(path: Path, groups: list[bytes]) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        started = time.perf_counter()
        for buffer in groups:
            view = memoryview(buffer)
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
        return time.perf_counter() - started
    finally:
        os.close(fd)


def _shape(
    root: Path, entry_bytes: int, per_call: int, per_sync: int, total: int, pairs: int
) -> dict[str, Any]:
    """``pairs`` short rounds of each side, back to back, alternating which goes first.

    The disk is shared with whatever else runs on the machine, and fdatasync times swing by
    several times from one second to the next. Pairing each WAL round with a raw round taken
    right next to it, and taking the median of the per-pair ratios, cancels most of that.
    """
    call_bytes = entry_bytes * per_call
    groups_count = max(1, total // (call_bytes * per_sync))
    calls = _calls(entry_bytes, per_call, per_sync)
    wal_groups = [calls] * groups_count
    raw_groups = [b"".join(e for _, _, entries in calls for e in entries)] * groups_count
    payload = groups_count * per_sync * call_bytes
    wal_times: list[float] = []
    raw_times: list[float] = []
    for i in range(pairs):
        wal_dir = root / f"wal-{i}"
        raw_file = root / f"raw-{i}"
        for kind in ("wal", "raw") if i % 2 == 0 else ("raw", "wal"):
            if kind == "wal":
                wal_times.append(_wal_round(wal_dir, wal_groups))
                shutil.rmtree(wal_dir)
            else:
                raw_times.append(_raw_round(raw_file, raw_groups))
                raw_file.unlink()
    ratios = [raw / wal for wal, raw in zip(wal_times, raw_times, strict=True)]
    wal_mb_s = payload / statistics.median(wal_times) / MB
    raw_mb_s = payload / statistics.median(raw_times) / MB
    return {
        "entry_bytes": entry_bytes,
        "entries_per_call": per_call,
        "calls_per_sync": per_sync,
        "bytes_per_sync": per_sync * call_bytes,
        "payload_bytes_per_round": payload,
        "pairs": pairs,
        "wal_mb_s": round(wal_mb_s, 2),
        "raw_mb_s": round(raw_mb_s, 2),
        "ratio": round(statistics.median(ratios), 4),
        "pair_ratios": [round(r, 3) for r in ratios],
    }


def _producer_round(root: Path, calls: list[list[bytes]]) -> tuple[float, int, int]:
    """One producer staging round: ``(seconds, payload bytes, fdatasyncs)``.

    Batches are never sealed during the round (huge flush interval and size), so what is
    timed is staging alone: validation, the inbox, WAL encode + write, fdatasync, handles.
    """
    from millpond.producer import Producer, ProducerConfig

    config = ProducerConfig(
        store=f"memory://bench-wal-{uuid.uuid4().hex}",
        wal_dir=root,
        flush_interval=3600.0,
        flush_size_bytes=1 << 30,
    )
    producer = Producer(config)
    try:
        started = time.perf_counter()
        handles = [producer.produce(entries) for entries in calls]
        for handle in handles:
            handle.wait_staged()
        seconds = time.perf_counter() - started
        syncs = int(producer.metrics()["wal_syncs"])
    finally:
        producer.close(timeout=0)  # the data stays staged; nothing here is about uploads
    payload = sum(len(e) for entries in calls for e in entries)
    return seconds, payload, syncs


def _producer_staging(
    root: Path, total: int, pairs: int, entry_bytes: int, per_call: int
) -> dict[str, Any]:
    """produce() → wait_staged() against raw write + fdatasync at the producer's cadence."""
    base = os.urandom(entry_bytes)
    entries = [base[j:] + base[:j] for j in range(per_call)]
    calls = [entries] * max(1, total // (entry_bytes * per_call))
    payload_blob = b"".join(entries) * len(calls)
    producer_times: list[float] = []
    raw_times: list[float] = []
    syncs_per_round: list[int] = []
    for i in range(pairs):
        seconds, payload, syncs = _producer_round(root / f"p-{i}", calls)
        shutil.rmtree(root / f"p-{i}")
        # The same bytes, with the same number of fdatasyncs the producer needed.
        chunk = -(-payload // max(syncs, 1))
        groups = [payload_blob[at : at + chunk] for at in range(0, payload, chunk)]
        raw = _raw_round(root / f"r-{i}", groups)
        (root / f"r-{i}").unlink()
        producer_times.append(seconds)
        raw_times.append(raw)
        syncs_per_round.append(syncs)
    ratios = [raw / mine for mine, raw in zip(producer_times, raw_times, strict=True)]
    payload = len(payload_blob)
    return {
        "entry_bytes": entry_bytes,
        "entries_per_call": per_call,
        "calls_per_round": len(calls),
        "payload_bytes_per_round": payload,
        "pairs": pairs,
        "median_fdatasyncs_per_round": statistics.median(syncs_per_round),
        "median_bytes_per_fdatasync": int(payload / statistics.median(syncs_per_round)),
        "producer_mb_s": round(payload / statistics.median(producer_times) / MB, 2),
        "raw_mb_s": round(payload / statistics.median(raw_times) / MB, 2),
        "ratio": round(statistics.median(ratios), 4),
        "pair_ratios": [round(r, 3) for r in ratios],
    }


def run(quick: bool) -> dict[str, Any]:
    total = 8 << 20  # per round
    pairs = 9 if quick else 31
    root = Path(tempfile.mkdtemp(prefix="millpond-bench-wal-", dir=os.environ.get("TMPDIR")))
    logging.getLogger("millpond").setLevel(logging.ERROR)  # close(timeout=0) warns by design
    try:
        staging = _producer_staging(root, 4 * total, pairs, *STAGING_SHAPES["arrow"])
        small = _producer_staging(root, 4 * total, pairs, *STAGING_SHAPES["small"])
        shapes = {
            label: _shape(root, entry, per_call, per_sync, total, pairs)
            for label, entry, per_call, per_sync in SHAPES
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    labels = list(shapes)
    return make_result(
        NAME,
        ratio=staging["ratio"],
        target=TARGET,
        figures={
            "staging_mb_s": staging["producer_mb_s"],
            "producer_staging": staging,
            "producer_staging_small_entries": small,
            "wal_layer_shapes": shapes,
        },
        baseline={
            "raw_write_fdatasync_mb_s": staging["raw_mb_s"],
            "bytes_per_fdatasync": staging["median_bytes_per_fdatasync"],
        },
        series=[
            plot_spec(
                "Wal.append_data + sync vs raw write + fdatasync, by shape",
                "shape",
                "payload MB/s",
                list(range(len(labels))),
                {
                    "wal": [shapes[k]["wal_mb_s"] for k in labels],
                    "raw write+fdatasync": [shapes[k]["raw_mb_s"] for k in labels],
                },
            ),
            plot_spec(
                "produce() -> wait_staged() / raw, per pair",
                "pair",
                "ratio",
                list(range(len(staging["pair_ratios"]))),
                {"producer staging / raw": staging["pair_ratios"]},
                hline=("target", TARGET),
            ),
        ],
        headline=(
            f"staging {staging['producer_mb_s']} MB/s vs raw {staging['raw_mb_s']} MB/s "
            f"(~{staging['median_bytes_per_fdatasync'] >> 10} KiB per fdatasync)"
        ),
        notes=(
            "ratio: produce() of 4 x 64 KiB entries per call until every wait_staged() "
            "returned (wal_sync=always), over raw os.write + os.fdatasync of the same bytes "
            "with the same number of fdatasyncs, median of per-pair ratios. "
            "producer_staging_small_entries: the same with 16 x 1 KiB entries per call, where "
            "per-call Python work (validation, handle, encode) rather than the disk bounds it. "
            "wal_layer_shapes: Wal.append_data + Wal.sync alone, single-threaded (no "
            "pipelining), per shape in plot order: " + "; ".join(labels)
        ),
    )
