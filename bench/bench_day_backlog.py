"""A day-long backlog on the defaults: the consumer service's memory and drain rate, and what
``millpond status``, a GC pass and a producer's append cost, against how much waits.

Issue 48: a database down for a day under a busy Spark stream leaves about a million
one-record batches waiting. Targets, each a ratio within this run: the service's peak memory
with 1,000,000 entries waiting <= 1.5x its peak with 20,000 waiting, and its drain rate >= 0.8x;
``millpond status`` and one ``millpond gc --once`` on the 1,000,000-entry queue <= 5 s and
<= 300 MB each (judged as a ratio to those limits); a producer's append with 1,000,000 waiting
<= 1.2x the same append on an empty queue; and (full run) the service's own GC slows the drain
by at most 10% (rows/s with GC over rows/s with ``--no-gc``, >= 0.9).

Setup, per size (1,000, 10,000, 20,000, 100,000, 1,000,000; ``--quick`` stops at 100,000), on a
``file://`` store in a fresh directory: N batch objects of one 60-byte record each (opaque
entries: one row each), named with ULIDs spread over the past day, and the queue the default
settings leave after a day of it: with the backlog index on (the default), the manifest holding
500 entries (its mean fill between two moves of ``backlog_index_threshold``, 1,000, into the
index) and the rest in index segments of 1,000 (written with the wire-format functions and the
file store, as the service would). The first 1,000 batch objects are files, every later one a
hard link to one of them: each is a name of its own in the directory, listed, opened and read
like a file, but this disk (ext4 mounted with ``discard``) unlinks a file in 1.9 ms and a link
in 0.01 ms, and 1,000,000 files took half an hour to remove and five minutes to write. Plus 100
older batch objects nothing references, last written a day ago, at every size: what a collector
deletes (the same number at every size, so the GC curve shows what the backlog costs a pass;
``delete_ms_per_object`` is what each object deleted adds, measured on 200 fresh files).

Then, each as a process of its own, ``millpond status``, ``millpond gc --once`` (wall time;
peak RSS from ``wait4`` in a small launcher), 30 cold producer appends in this process (a
fresh ``QueueProducer`` each: GET + conditional PUT), each paired with one on an empty queue
(the ratio's baseline), and ``millpond consume --sink sqlite:///...`` with no other flag: its
RSS sampled from ``/proc`` (peak: ``VmHWM``), its progress from the mark it publishes
(``{prefix}/_millpond/written.json``), until the queue is drained or ``WINDOW_S`` seconds of
draining have passed, whichever comes first. Drain rate: rows the sink committed after its
first commit over the time to its last, from the progress table's commit times once the
service has stopped (a reader of the live database holds back its WAL checkpoints, and
``max(sequence)`` scans a table that grows with the rows written: both slowed a longer drain
more than a short one, a cost of the benchmark, not of the backlog). Draining 1,000,000
entries takes longer than the whole ``make bench``; the window is where the service is at the
1 M backlog). The largest size also runs the service with ``--metrics-port 0`` (the queue
sampler's memory) and with ``--no-gc`` (the collector's share of the drain). The 20,000 size
runs again at the end; its service figures are the mean of both runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import make_result, plot_spec, stop_child
from millpond.errors import MillpondError

logger = logging.getLogger(__name__)

NAME = "day_backlog"
USES_STORE = False  # a file:// store of its own; the latency pass skips it
SIZES = (1_000, 10_000, 20_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000, 20_000, 100_000)
BASELINE = 20_000
THRESHOLD = 1_000  # ConsumerConfig.backlog_index_threshold's default
IN_MANIFEST = THRESHOLD // 2  # the manifest's mean fill between two moves into the index
GARBAGE = 100  # collectable objects, the same at every size (see the module docstring)
POOL = 1_000  # batch files; the other objects are hard links to them
WINDOW_S = 60.0
QUICK_WINDOW_S = 20.0
SIDE_WINDOW_S = 30.0
STATUS_LIMIT_S, STATUS_LIMIT_MB = 5.0, 300.0
MEMORY_TARGET, RATE_TARGET, APPEND_TARGET, GC_SHARE_TARGET = 1.5, 0.8, 1.2, 0.9
APPENDS = 30
DELETES = 200
DAY_MS = 86_400_000
PREFIX = "ingest"
MANIFEST = f"{PREFIX}/manifest"


# --- the queue a day of it leaves --------------------------------------------------------------


def _ulids(n: int, start_ms: int, span_ms: int) -> list[str]:
    """``n`` ULIDs spread evenly over ``span_ms`` from ``start_ms``, in order."""
    from ulid import ULID

    step = span_ms / max(1, n)
    return [
        str(ULID.from_int((int(start_ms + i * step) << 80) | int.from_bytes(os.urandom(10), "big")))
        for i in range(n)
    ]


def _write_batches(root: Path, names: list[str], first: int, *, mtime: float | None) -> None:
    """One-record batch objects, written as files (no fsync: a benchmark's set-up)."""
    from millpond.formats.batch import encode_batch

    folder = root / PREFIX
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        record = b'{"event": %d, "source": "spark-stream", "value": %d}' % (first + i, i % 997)
        path = folder / f"{name}.batch"
        path.write_bytes(encode_batch([record.ljust(60)]))
        if mtime is not None:
            os.utime(path, (mtime, mtime))


def _link_batches(root: Path, names: list[str]) -> None:
    """The first :data:`POOL` names as files, each later one a hard link to one of them: a
    directory of ``len(names)`` objects, each read and listed like a file of its own, that
    this disk (mounted with ``discard``: 1.9 ms per file unlinked, against 0.01 ms per link)
    builds and removes in seconds rather than in half an hour."""
    pool = names[:POOL]
    _write_batches(root, pool, 0, mtime=None)
    folder = root / PREFIX
    for i in range(len(pool), len(names)):
        os.link(folder / f"{pool[i % POOL]}.batch", folder / f"{names[i]}.batch")


def _entries(names: list[str], first: int, times: list[int]) -> list[Any]:
    from millpond.formats.manifest import ManifestEntry, Metadata

    return [
        ManifestEntry(first + i, f"{PREFIX}/{name}.batch", (Metadata(0, times[i], b"source=a1"),))
        for i, name in enumerate(names)
    ]


def _segments(store: Any, entries: list[Any]) -> list[Any]:
    """Index segments of ``entries``: an odd-sized one first, then one per
    :data:`THRESHOLD` (what the service's moves leave)."""
    from millpond.queue.index import Segment, _segment_path, encode_segment, oldest_batch_ms

    bounds = list(range(len(entries) % THRESHOLD, len(entries), THRESHOLD))
    segments = []
    for start, stop in zip([0, *bounds], [*bounds, len(entries)], strict=True):
        chunk = entries[start:stop]
        if not chunk:
            continue
        first, last = chunk[0].sequence, chunk[-1].sequence
        path = _segment_path(PREFIX, first, last, 1)
        store.put(path, encode_segment(chunk, 1))
        segments.append(Segment(path, first, last, oldest_batch_ms(e.location for e in chunk)))
    return segments


def build(root: Path, n: int, now_ms: int) -> dict[str, Any]:
    """The batch objects, index segments, index head and manifest of ``n`` waiting entries
    (:data:`IN_MANIFEST` of them in the manifest), and :data:`GARBAGE` collectable objects."""
    from millpond.formats.manifest import PendingEntry, append_entries, empty_manifest
    from millpond.queue.index import IndexHead, head_path
    from millpond.storage.file_store import FileStore

    started = time.perf_counter()
    store = FileStore(root)
    old = _ulids(GARBAGE, now_ms - 2 * DAY_MS, DAY_MS // 2)
    _write_batches(root, old, -GARBAGE, mtime=(now_ms - 2 * DAY_MS) / 1000)
    names = _ulids(n, now_ms - DAY_MS, DAY_MS - 60_000)
    _link_batches(root, names)
    times = [now_ms - DAY_MS + i * (DAY_MS - 60_000) // max(1, n) for i in range(n)]
    entries = _entries(names, 0, times)
    del names, times
    indexed = max(0, n - IN_MANIFEST)
    segments = _segments(store, entries[:indexed])
    if segments:
        store.put(head_path(PREFIX), IndexHead(1, -1, tuple(segments)).encode())
    raw = empty_manifest(epoch=1, next_sequence=indexed)
    raw, _ = append_entries(raw, [PendingEntry(e.location, e.metadata) for e in entries[indexed:]])
    store.put(MANIFEST, raw)
    return {
        "entries": n,
        "indexed": indexed,
        "segments": len(segments),
        "manifest_bytes": len(raw),
        "garbage": GARBAGE,
        "build_s": round(time.perf_counter() - started, 1),
    }


# --- processes: wall time and memory ----------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "millpond.cli", *args]


_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_pid, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""
"""Runs a command and writes its peak RSS (kB) to a file. Linux carries a process's peak over
``exec`` from the process it was forked from: a command started from this process would report
at least this process's own peak (the 1,000,000 names it built); started from this small one,
its own."""


def timed_command(command: list[str]) -> dict[str, Any]:
    """Run ``command`` to its end: wall seconds, peak RSS (MB, ``wait4`` in a small launcher),
    exit code."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r") as peak,
    ):
        started = time.perf_counter()
        code = subprocess.call(
            [sys.executable, "-c", _LAUNCHER, peak.name, *command], stdout=out, stderr=err
        )
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        output, errors = out.read(), err.read()
        peak_kb = int(peak.read() or 0)
    if code != 0:
        raise RuntimeError(f"{command[3:5]} exited {code}: {errors.decode()[-2000:]}")
    return {
        "seconds": round(seconds, 2),
        "peak_mb": round(peak_kb / 1024, 1),
        "output": output.decode()[-400:],
    }


def _proc_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _mark(root: Path) -> tuple[int | None, int | None]:
    """The service's published mark (``{prefix}/_millpond/written.json``): its epoch and the
    last sequence its sink has written through; ``(None, None)`` before any. Read from the
    store, not from the database: a reader of SQLite's WAL holds back its checkpoints, and
    ``max(sequence)`` of the progress table is a scan that grows with the rows written."""
    from millpond.queue.written import read_written

    try:
        mark = read_written(_file_store()(root), PREFIX)
    except MillpondError:
        return None, None
    return (None, None) if mark is None else (mark.epoch, mark.written_through)


# --- the consumer service ---------------------------------------------------------------------


@contextlib.contextmanager
def _service(root: Path, db: Path, log: Path, flags: tuple[str, ...]) -> Iterator[Any]:
    command = _cli("consume", root.as_uri(), "--sink", f"sqlite://{db}", *flags)
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield child
        finally:
            stop_child(child)


def drain(root: Path, n: int, window: float, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``millpond consume`` on the queue (``n`` entries waiting) until it is drained or
    ``window`` seconds of draining have passed; its rows/s, peak and steady RSS."""
    label = "-".join(flag.strip("-") for flag in flags) or "defaults"
    db = root.parent / f"{root.name}-{label}.sqlite"
    log = root.parent / f"{root.name}-{label}.log"
    before, _ = _mark(root)  # an earlier service's: this one's epoch is newer
    with _service(root, db, log, flags) as child:
        watched = _watch(child, root, before, (n, window), log)
        peak_kb = _proc_kb(child.pid, "VmHWM") or 0
    progress, rss, startup = watched
    rows, elapsed = _commits(db)
    return {
        "flags": list(flags),
        "rows": rows,
        "seconds": round(elapsed, 1),
        "rows_per_s": round(rows / elapsed, 1) if elapsed > 0 else None,
        "drained": progress[-1][1] >= n - 1,
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "steady_rss_mb": round(statistics.median(rss[-8:]) / 1024, 1) if rss else None,
        "startup_s": round(startup, 1),
    }


def _commits(db: Path) -> tuple[int, float]:
    """Rows the sink committed after its first commit, and the seconds from that commit to
    its last: from the progress table's commit times, read once the service has stopped (a
    reader of the live database would hold back its WAL checkpoints)."""
    with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
        first, last = conn.execute(
            "SELECT min(committed_at_ms), max(committed_at_ms) FROM millpond_progress"
        ).fetchone()
        (rows,) = conn.execute(
            "SELECT coalesce(sum(row_count), 0) FROM millpond_progress WHERE committed_at_ms > ?",
            (first,),
        ).fetchone()
    return int(rows), (last - first) / 1000


def _watch(
    child: Any, root: Path, before: int | None, until: tuple[int, float], log: Path
) -> tuple[list[tuple[float, int]], list[int], float]:
    """Sample the service every quarter second: (seconds, last sequence written) from its
    first row on, its RSS in kB, and the seconds before its first row; until ``n`` entries
    are written or ``window`` seconds of draining have passed (``until``)."""
    n, window = until
    started = time.monotonic()
    progress: list[tuple[float, int]] = []
    rss: list[int] = []
    while child.poll() is None:
        time.sleep(0.25)  # the sampling cadence, not a wait for a condition
        now = time.monotonic()
        kb = _proc_kb(child.pid, "VmRSS")
        if kb:
            rss.append(kb)
        epoch, last = _mark(root)
        if last is None or epoch is None or (before is not None and epoch <= before):
            if now - started > 600:
                raise RuntimeError(f"no row written in 600 s; see {log}")
            continue
        progress.append((now, last))
        if last >= n - 1 or now - progress[0][0] >= window:
            return progress, rss, progress[0][0] - started
    raise RuntimeError(f"consume exited {child.returncode} before draining; see {log}")


# --- a producer's append ----------------------------------------------------------------------


def appends(root: Path, now_ms: int, count: int = APPENDS) -> list[float]:
    """``count`` cold appends of one entry (a fresh producer each: GET + conditional PUT),
    each naming a batch object written first; seconds each."""
    from millpond.formats.manifest import Metadata, PendingEntry
    from millpond.queue import QueueProducer
    from millpond.storage.file_store import FileStore

    store = FileStore(root)
    took = []
    for name in _ulids(count, now_ms, count):
        _write_batches(root, [name], 10**9, mtime=None)
        entry = PendingEntry(f"{PREFIX}/{name}.batch", (Metadata(0, now_ms, b"source=a1"),))
        producer = QueueProducer(store, MANIFEST)
        started = time.perf_counter()
        producer.append([entry])
        took.append(time.perf_counter() - started)
    return took


def appends_on(base: Path, name: str, entries: int, now_ms: int) -> dict[str, list[float]]:
    """Appends on a queue whose manifest holds ``entries`` (and nothing else waits), paired
    with appends on an empty queue."""
    from millpond.formats.manifest import PendingEntry, append_entries, empty_manifest

    root = base / name
    names = _ulids(entries, now_ms - DAY_MS, DAY_MS)
    times = [now_ms] * entries
    raw, _ = append_entries(
        empty_manifest(epoch=1),
        [PendingEntry(e.location, e.metadata) for e in _entries(names, 0, times)],
    )
    _file_store()(root).put(MANIFEST, raw)
    try:
        on_queue, on_empty = paired_appends(base, root, now_ms)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"append_s": on_queue, "append_empty_s": on_empty}


# --- one size, and the run --------------------------------------------------------------------


def paired_appends(base: Path, root: Path, now_ms: int) -> tuple[list[float], list[float]]:
    """Cold appends on ``root``'s queue and on an empty queue, one each in turn (the machine is
    shared: what slows one slows its pair); seconds each, the queue's then the empty one's."""
    empty = base / f"empty-{root.name}"
    from millpond.formats.manifest import empty_manifest

    _file_store()(empty).put(MANIFEST, empty_manifest(epoch=1))
    on_queue: list[float] = []
    on_empty: list[float] = []
    try:
        for _ in range(APPENDS):
            on_queue += appends(root, now_ms, 1)
            on_empty += appends(empty, now_ms, 1)
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    return on_queue, on_empty


def _file_store() -> Any:
    from millpond.storage.file_store import FileStore

    return FileStore


def delete_cost(root: Path, now_ms: int, count: int = DELETES) -> float:
    """Milliseconds per object the file store takes to delete ``count`` fresh batch files
    from the queue's directory (what a GC pass pays per object it deletes)."""
    names = _ulids(count, now_ms - 2 * DAY_MS, DAY_MS // 2)
    _write_batches(root, names, -count, mtime=None)
    started = time.perf_counter()
    failures = _file_store()(root).delete_many([f"{PREFIX}/{name}.batch" for name in names])
    if failures:
        raise RuntimeError(f"deletes failed: {failures[:3]}")
    return round(1000 * (time.perf_counter() - started) / count, 2)


def one_size(base: Path, n: int, window: float, *, sides: bool) -> dict[str, Any]:
    """Build ``n`` waiting entries, then status, GC, appends and the service on them."""
    root = base / f"queue-{n}"
    now_ms = int(time.time() * 1000)
    row = build(root, n, now_ms)
    # The build's dirty pages (a million directory entries, the segments) would otherwise be
    # written back during the first drain, and slow its database's fsyncs: not the backlog.
    started = time.perf_counter()
    os.sync()
    row["sync_s"] = round(time.perf_counter() - started, 1)
    logger.info("built %s", row)
    url = root.as_uri()
    row["status"] = timed_command(_cli("status", url, "--output", "json"))
    row["gc"] = timed_command(_cli("gc", url, "--once", "--output", "json"))
    row["delete_ms_per_object"] = delete_cost(root, now_ms)
    on_queue, on_empty = paired_appends(base, root, now_ms)
    row["append_s"] = [round(s, 6) for s in on_queue]
    row["append_empty_s"] = [round(s, 6) for s in on_empty]
    row["service"] = drain(root, n + APPENDS, window)
    logger.info("%s entries: %s", n, {k: row[k] for k in ("status", "gc", "service")})
    if sides:
        # Right after the defaults' run: the GC share compares neighbours.
        row["service_no_gc"] = drain(root, n + APPENDS, window, ("--no-gc",))
        row["service_metrics_port"] = drain(
            root, n + APPENDS, SIDE_WINDOW_S, ("--metrics-port", "0")
        )
        logger.info("sides: %s", {k: row[k] for k in ("service_metrics_port", "service_no_gc")})
    for leftover in base.glob(f"{root.name}-*"):
        leftover.unlink()
    shutil.rmtree(root, ignore_errors=True)
    return row


def _baseline_twice(rows: list[dict[str, Any]], again: dict[str, Any]) -> None:
    """The baseline's service figures: the mean of its run before the other sizes and of one
    after them (the machine is shared: a load that came and went weighs on both ends)."""
    base = _baseline(rows)
    first, second = base["service"], again["service"]
    base["service_runs"] = [first, second]
    base["service"] = {
        **first,
        "rows_per_s": round((first["rows_per_s"] + second["rows_per_s"]) / 2, 1),
        "peak_rss_mb": round((first["peak_rss_mb"] + second["peak_rss_mb"]) / 2, 1),
    }


def run(quick: bool) -> dict[str, Any]:
    sizes = QUICK_SIZES if quick else SIZES
    if os.environ.get("MILLPOND_BENCH_SIZES"):
        sizes = tuple(int(v) for v in os.environ["MILLPOND_BENCH_SIZES"].split(","))
    window = QUICK_WINDOW_S if quick else WINDOW_S
    base = Path(tempfile.mkdtemp(prefix="millpond-day-backlog-"))
    rows: list[dict[str, Any]] = []
    try:
        now_ms = int(time.time() * 1000)
        # The manifest alone, nothing else waiting: what its fill costs an append, backlog or not.
        alone = {
            fill: appends_on(base, f"manifest-{fill}", fill, now_ms)
            for fill in (IN_MANIFEST, THRESHOLD - 1)
        }
        rows.extend(one_size(base, n, window, sides=not quick and n == sizes[-1]) for n in sizes)
        baseline = _baseline(rows)["entries"]
        _baseline_twice(rows, one_size(base, baseline, window, sides=False))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _result(rows, sizes, alone, window)


def _baseline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The 20,000-entry row (the issue's baseline), else the one nearest to it."""
    return min(rows, key=lambda row: abs(row["entries"] - BASELINE))


def _side(name: str, ratio: float, target: float, op: str, headline: str) -> dict[str, Any]:
    return {
        "name": name,
        "ratio": round(ratio, 3),
        "target": target,
        "target_op": op,
        "headline": headline,
    }


def _paired_ratio(appends: dict[str, list[float]]) -> float:
    return statistics.median(appends["append_s"]) / statistics.median(appends["append_empty_s"])


def _sides(rows: list[dict[str, Any]], alone: dict[int, dict[str, list[float]]]) -> list[Any]:
    base, top = _baseline(rows), rows[-1]
    n = f"{top['entries']:,}"
    rate = top["service"]["rows_per_s"] / base["service"]["rows_per_s"]
    empty_s = statistics.median(top["append_empty_s"])
    append_s = statistics.median(top["append_s"])
    same, full = _paired_ratio(alone[IN_MANIFEST]), _paired_ratio(alone[THRESHOLD - 1])
    sides = [
        _side(
            "drain_rate",
            rate,
            RATE_TARGET,
            ">=",
            f"{top['service']['rows_per_s']:.0f} rows/s at {n} waiting vs "
            f"{base['service']['rows_per_s']:.0f} at {base['entries']:,}",
        ),
        _side(
            "append",
            append_s / empty_s,
            APPEND_TARGET,
            "<=",
            f"cold append {1000 * append_s:.1f} ms at {n} waiting ({IN_MANIFEST} in the "
            f"manifest) vs {1000 * empty_s:.1f} ms on an empty queue (paired); "
            f"{IN_MANIFEST} in the manifest and nothing else waiting: {same:.2f}x; "
            f"{THRESHOLD - 1}: {full:.2f}x",
        ),
    ]
    for what in ("status", "gc"):
        cost = top[what]
        ratio = max(cost["seconds"] / STATUS_LIMIT_S, cost["peak_mb"] / STATUS_LIMIT_MB)
        sides.append(
            _side(
                what,
                ratio,
                1.0,
                "<=",
                f"{cost['seconds']:.2f} s and {cost['peak_mb']:.0f} MB on {n} entries "
                f"(limits {STATUS_LIMIT_S:g} s, {STATUS_LIMIT_MB:g} MB)",
            )
        )
    no_gc = top.get("service_no_gc")
    if no_gc and no_gc.get("rows_per_s"):
        share = top["service"]["rows_per_s"] / no_gc["rows_per_s"]
        sides.append(
            _side(
                "gc_share",
                share,
                GC_SHARE_TARGET,
                ">=",
                f"{top['service']['rows_per_s']:.0f} rows/s with the service's GC vs "
                f"{no_gc['rows_per_s']:.0f} without",
            )
        )
    return sides


def _series(rows: list[dict[str, Any]], window: float) -> list[Any]:
    xs = [row["entries"] for row in rows]
    return [
        plot_spec(
            "consumer service memory",
            "entries waiting",
            "MB",
            xs,
            {
                "peak RSS (VmHWM)": [r["service"]["peak_rss_mb"] for r in rows],
                "steady RSS": [r["service"]["steady_rss_mb"] for r in rows],
            },
            log_x=True,
            hline=(
                f"{MEMORY_TARGET}x baseline",
                MEMORY_TARGET * _baseline(rows)["service"]["peak_rss_mb"],
            ),
        ),
        plot_spec(
            f"drain rate (whole drain or {window:g} s window)",
            "entries waiting",
            "rows/s",
            xs,
            {"rows/s": [r["service"]["rows_per_s"] for r in rows]},
            log_x=True,
            hline=(
                f"{RATE_TARGET}x baseline",
                RATE_TARGET * _baseline(rows)["service"]["rows_per_s"],
            ),
        ),
        *(
            plot_spec(
                f"status and one GC pass: {what}",
                "entries waiting",
                unit,
                xs,
                {
                    "millpond status": [r["status"][key] for r in rows],
                    "millpond gc --once": [r["gc"][key] for r in rows],
                },
                log_x=True,
                hline=("limit", limit),
            )
            for what, unit, key, limit in (
                ("seconds", "s", "seconds", STATUS_LIMIT_S),
                ("peak RSS", "MB", "peak_mb", STATUS_LIMIT_MB),
            )
        ),
        plot_spec(
            "cold producer append (median)",
            "entries waiting",
            "ms",
            xs,
            {
                "on the queue": [1000 * statistics.median(r["append_s"]) for r in rows],
                "on an empty queue (paired)": [
                    1000 * statistics.median(r["append_empty_s"]) for r in rows
                ],
            },
            log_x=True,
        ),
    ]


def _result(
    rows: list[dict[str, Any]],
    sizes: tuple[int, ...],
    alone: dict[int, dict[str, list[float]]],
    window: float,
) -> dict[str, Any]:
    base, top = _baseline(rows), rows[-1]
    memory = top["service"]["peak_rss_mb"] / base["service"]["peak_rss_mb"]
    for row in rows:
        service = row["service"]
        row["peak_rss_over_baseline"] = round(
            service["peak_rss_mb"] / base["service"]["peak_rss_mb"], 2
        )
        row["rows_per_s_over_baseline"] = round(
            service["rows_per_s"] / base["service"]["rows_per_s"], 2
        )
        row["hours_per_million"] = round(1e6 / service["rows_per_s"] / 3600, 2)
    return make_result(
        NAME,
        ratio=memory,
        target=MEMORY_TARGET,
        target_op="<=",
        figures={"by_size": rows, "sizes": list(sizes), "window_s": window},
        baseline={
            "entries": base["entries"],
            "peak_rss_mb": base["service"]["peak_rss_mb"],
            "rows_per_s": base["service"]["rows_per_s"],
            "append_manifest_alone_s": {
                fill: {key: [round(s, 6) for s in values] for key, values in paired.items()}
                for fill, paired in alone.items()
            },
        },
        series=_series(rows, window),
        side_rows=_sides(rows, alone),
        headline=(
            f"millpond consume on the defaults: peak {top['service']['peak_rss_mb']:.0f} MB "
            f"with {top['entries']:,} waiting vs {base['service']['peak_rss_mb']:.0f} MB with "
            f"{base['entries']:,}; {top['service']['rows_per_s']:.0f} vs "
            f"{base['service']['rows_per_s']:.0f} rows/s"
        ),
        notes=(
            "ratio = the service's peak RSS with the most entries waiting / with 20,000 waiting "
            "(the baseline's service figures: the mean of a run before the other sizes and one "
            "after); side rows: drain rate (same sizes), a cold producer append on the largest "
            f"queue ({IN_MANIFEST} entries in its manifest) / on an empty queue, paired; status "
            "and GC (each the worse of seconds / 5 s and MB / 300 MB), and the service's GC "
            "share (rows/s with it / with --no-gc); delete_ms_per_object: what a GC pass pays "
            "per object it deletes on this disk; append_manifest_alone_s: the same paired "
            "appends on a queue whose manifest holds 500 or 999 entries and nothing else waits"
        ),
    )
