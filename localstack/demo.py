"""``python -m millpond.localstack.demo``: the main job, end to end, on real services.

1. starts an S3 server in this process (moto, on 127.0.0.1) unless ``--store`` names a real one;
2. runs a Spark job (``local[2]``) that writes generated rows through ``format("millpond")``:
   the tasks upload batch objects, the driver appends them all to the queue in one CAS;
3. runs the consumer into SQLite (or ``--sink postgresql://...``) until the queue is drained;
4. runs the garbage collector;
5. checks the database holds every row exactly once and prints a report: rows written, rows in
   the database, batches, requests by kind, elapsed time, rows/s.

Progress goes to stderr while it runs (Spark's tasks as Spark's status tracker reports them);
the report to stdout (``--output json`` for JSON). Exits 1 on any mismatch or error. Every
service it starts binds 127.0.0.1 and is stopped at the end.

What it writes on disk — the default SQLite database, Spark's scratch and temporary files, and
the JVM's own output (start-up lines and logs, kept out of the console) — lives in one
temporary directory that is removed at the end, unless ``--keep`` (then its path is printed).

It is an application, not part of the core: it uses every role (producer, consumer, collector,
Spark) and lives here, next to the local services it starts. The core never imports it.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import json
import logging
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from millpond.cli.common import parse_options
from millpond.common.metrics import Counters
from millpond.errors import MillpondError
from millpond.storage import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
    open_store,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["CountingStore", "DemoReport", "main", "run"]

logger = logging.getLogger(__name__)

_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")
_EMBEDDED_BUCKET = "millpond"


class CountingStore(ForwardingStore):
    """An :class:`ObjectStore` that counts the requests made through it, by kind."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.counters = Counters("put", "get", "head", "list", "delete")

    def get(self, path: str) -> GetResult:
        self.counters.add("get")
        return self.inner.get(path)

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        self.counters.add("get")
        return self.inner.get_if_changed(path, etag)

    def head(self, path: str) -> ObjectInfo:
        self.counters.add("head")
        return self.inner.head(path)

    def put(self, path: str, data: bytes) -> str | None:
        self.counters.add("put")
        return self.inner.put(path, data)

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self.counters.add("put")
        return self.inner.put_if_absent(path, data)

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        self.counters.add("put")
        return self.inner.put_if_match(path, data, etag)

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        self.counters.add("list")
        return self.inner.list(prefix, recursive=recursive)

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        chunk = builtins.list(paths)
        # One DeleteObjects request per 1000 keys.
        self.counters.add("delete", max(1, -(-len(chunk) // 1000)) if chunk else 0)
        return self.inner.delete_many(chunk)


@dataclass(slots=True)
class DemoReport:
    """What one run did; ``ok`` is false on any mismatch."""

    rows_requested: int
    store: str
    sink: str
    table: str
    run_id: str
    rows_written: int = 0
    rows_in_database: int = 0
    distinct_ids: int = 0
    batches_enqueued: int = 0
    batches_consumed: int = 0
    bytes_enqueued: int = 0
    gc_deleted: int = 0
    objects_left: int = 0
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        pipeline = self.seconds.get("spark_write", 0.0) + self.seconds.get("consume", 0.0)
        first = ("ok", "problems", "run_id", "store", "sink", "table")
        # Every field: these first, then the others in the order they are declared.
        names = [*first, *(f.name for f in fields(self) if f.name not in first)]
        record = {name: getattr(self, name) for name in names}
        record["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        record["rows_per_second"] = round(self.rows_in_database / pipeline) if pipeline else None
        return record

    def text(self) -> str:
        record = self.to_json()
        secs = self.seconds
        lines = [
            "",
            f"millpond demo {'OK' if self.ok else 'FAILED'}  (run {self.run_id})",
            f"  store            {self.store}",
            f"  sink             {self.sink} table {self.table}",
            f"  rows written     {self.rows_written:,} by Spark "
            f"({self.batches_enqueued} batch objects, {self.bytes_enqueued / 2**20:.1f} MiB, "
            "one queue append)",
            f"  rows in database {self.rows_in_database:,} ({self.distinct_ids:,} distinct ids, "
            f"{self.batches_consumed} batches consumed)",
            f"  garbage          {self.gc_deleted} batch objects deleted by GC, "
            f"{self.objects_left} left under the data prefix",
            "  requests         "
            + "  ".join(
                f"{who}: " + ", ".join(f"{n} {kind.upper()}" for kind, n in counts.items() if n)
                for who, counts in self.requests.items()
            ),
            f"  totals           {self._total('put')} PUT, {self._total('get')} GET",
            f"  elapsed          {secs.get('total', 0):.1f} s (spark start "
            f"{secs.get('spark_start', 0):.1f} s, write {secs.get('spark_write', 0):.1f} s, "
            f"consume {secs.get('consume', 0):.1f} s, gc {secs.get('gc', 0):.1f} s)",
            f"  throughput       {record['rows_per_second'] or 0:,} rows/s from Spark job start "
            "to the last row committed in the database",
        ]
        lines.extend(f"  PROBLEM: {problem}" for problem in self.problems)
        return "\n".join(lines)

    def _total(self, kind: str) -> int:
        return sum(counts.get(kind, 0) for counts in self.requests.values())


class Progress:
    """One status line, redrawn in place on a terminal, printed every few seconds otherwise."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._tty = out.isatty()
        self._last = 0.0
        self._lock = threading.Lock()

    def update(self, text: str, *, changed: bool = False) -> None:
        """Show ``text``; off a terminal at most every 2 s, unless it reports a ``changed``
        state (a task finished) that must not be skipped."""
        with self._lock:
            now = time.monotonic()
            if self._tty:
                self._out.write("\r" + text.ljust(78)[:120])
                self._out.flush()
            elif changed or now - self._last >= 2.0:
                self._out.write(text + "\n")
                self._out.flush()
                self._last = now

    def done(self, text: str) -> None:
        with self._lock:
            self._out.write(("\r" if self._tty else "") + text.ljust(78) + "\n")
            self._out.flush()
            self._last = 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m millpond.localstack.demo",
        description="Spark -> millpond on S3 -> consumer -> database, then GC and a report.",
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows to generate")
    parser.add_argument("--partitions", type=int, default=8, help="Spark partitions (tasks)")
    parser.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    parser.add_argument(
        "--flush-size", default="8MiB", help="largest batch object (flush_size_bytes)"
    )
    parser.add_argument(
        "--store",
        help="s3://bucket[/root] of a real S3 or MinIO (endpoint and keys from the AWS_* "
        "variables or --store-option); default: a moto server started here",
    )
    parser.add_argument(
        "--store-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="obstore S3 option, repeatable (aws_endpoint=..., aws_allow_http=true, ...)",
    )
    parser.add_argument(
        "--sink", help="sqlite:///abs/path.db or postgresql://...; default a new SQLite file"
    )
    parser.add_argument("--table", default="millpond_demo", help="database table")
    parser.add_argument(
        "--gc-grace",
        type=float,
        help="GC grace period in seconds (default 0 on the embedded server, else 600)",
    )
    parser.add_argument("--output", choices=("text", "json"), default="text")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the working directory (the default database, Spark's log and scratch files)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit code (0 only when every check passed)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        report = run(args, Progress(sys.stderr))
    except (MillpondError, ValueError) as err:
        print(f"millpond demo: {err}", file=sys.stderr)
        return 1
    if args.output == "json":
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report.text())
    return 0 if report.ok else 1


@dataclass(frozen=True, slots=True)
class _Target:
    url: str
    options: Mapping[str, str]
    description: str
    embedded: bool


def run(args: argparse.Namespace, progress: Progress) -> DemoReport:
    """The demo's four phases; see the module docstring.

    Raises:
        MillpondError: a store, queue or database failure.
        ValueError: a bad argument.
    """
    if args.rows < 1 or args.partitions < 1:
        raise ValueError("--rows and --partitions: expected at least 1")
    if not _TABLE_NAME.match(args.table):
        raise ValueError(f"--table: expected name or schema.name, found {args.table!r}")
    from millpond.consumer.sinks.postgres import redact

    run_id = uuid.uuid4().hex[:12]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = _work_dir(args, progress, stack)
        target = _open_target(args, run_id, stack)
        sink_url = args.sink or f"sqlite:///{work / 'millpond-demo.db'}"
        report = DemoReport(
            rows_requested=args.rows,
            store=target.description,
            sink=redact(sink_url),
            table=args.table,
            run_id=run_id,
        )
        progress.done(f"millpond demo: {args.rows:,} rows -> {target.description} -> {report.sink}")
        if not args.keep and not args.sink:
            progress.done(f"  that database is in {work}, deleted at the end (--keep keeps it)")
        _spark_phase(args, target, run_id, report, progress, work)
        _consume_phase(args, target, sink_url, report, progress)
        _gc_phase(args, target, report, progress)
        _verify(args, sink_url, report)
    report.seconds["total"] = time.monotonic() - started
    return report


def _open_target(args: argparse.Namespace, run_id: str, stack: contextlib.ExitStack) -> _Target:
    root = f"demo-{run_id}"
    if args.store:
        options = parse_options(args.store_option)
        return _Target(args.store, options, args.store, embedded=False)
    from millpond.localstack import start_moto

    server = stack.enter_context(start_moto(_EMBEDDED_BUCKET))
    endpoint = server.endpoint
    return _Target(
        endpoint.url_for(root),
        endpoint.store_options(),
        f"{endpoint.url_for(root)} (moto S3 on {endpoint.endpoint})",
        embedded=True,
    )


def _work_dir(args: argparse.Namespace, progress: Progress, stack: contextlib.ExitStack) -> Path:
    """The run's directory on disk, removed when the run ends unless ``--keep``."""
    work = Path(tempfile.mkdtemp(prefix="millpond-demo-"))
    if args.keep:
        stack.callback(progress.done, f"kept {work} (the database, Spark's log: spark.log)")
        return work

    def remove() -> None:
        if sys.exc_info()[0] is not None:
            _show_spark_log(work / "spark.log", progress)
        shutil.rmtree(work, ignore_errors=True)
        what = "Spark's log" if args.sink else "the database, Spark's log"
        progress.done(f"deleted {work} ({what}); run with --keep to keep it")

    stack.callback(remove)
    return work


def _show_spark_log(path: Path, progress: Progress, lines: int = 20) -> None:
    """On a failure, the end of the JVM's output (it is about to be removed)."""
    with contextlib.suppress(OSError):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            progress.done("the end of Spark's log:\n" + "\n".join(tail))


def _spark_phase(
    args: argparse.Namespace,
    target: _Target,
    run_id: str,
    report: DemoReport,
    progress: Progress,
    work: Path,
) -> None:
    from millpond.producer.spark import local_spark_session

    progress.update(f"[1/4] starting Spark {args.master} ...")
    begin = time.monotonic()
    # The JVM's start-up lines and logs (and its Python workers' output) go to spark.log,
    # not between the demo's own lines.
    spark = local_spark_session(
        args.master, app_name="millpond-demo", jvm_output=work / "spark.log", work_dir=work
    )
    try:
        report.seconds["spark_start"] = time.monotonic() - begin
        progress.done(f"[1/4] Spark {args.master} started in {report.seconds['spark_start']:.1f} s")
        receipt_path = f"_demo/receipts/{run_id}.json"
        frame = spark.range(args.rows, numPartitions=args.partitions).selectExpr(
            "id",
            "concat('user-', id % 5000) AS user_id",
            "element_at(array('view', 'click', 'cart', 'purchase'), CAST(id % 4 AS INT) + 1)"
            " AS kind",
            "CAST(id % 10000 AS DOUBLE) / 100 AS amount",
            "1767225600000 + id * 7 AS event_ms",
            f"'{run_id}' AS run_id",
        )
        options = {
            "store": target.url,
            **target.options,
            "flush_size_bytes": args.flush_size,
            "receipt_path": receipt_path,
            "metadata": f"demo {run_id}",
        }
        begin = time.monotonic()
        with _spark_progress(spark, progress, begin):
            frame.write.format("millpond").options(**options).mode("append").save()
        report.seconds["spark_write"] = time.monotonic() - begin
        store = open_store(target.url, target.options)
        receipt = json.loads(store.get(receipt_path).data)
    finally:
        spark.stop()
    report.rows_written = int(receipt["rows"])
    report.batches_enqueued = int(receipt["batches"])
    report.bytes_enqueued = int(receipt["bytes"])
    report.requests["spark"] = {kind: int(receipt["requests"][kind]) for kind in ("put", "get")}
    progress.done(
        f"[2/4] Spark wrote {report.rows_written:,} rows as {report.batches_enqueued} batch "
        f"objects ({report.bytes_enqueued / 2**20:.1f} MiB), enqueued in one append at "
        f"sequences {receipt['first_sequence']}..{receipt['last_sequence']} "
        f"({receipt['manifest'].get('cas_conflicts', 0)} CAS conflicts), "
        f"in {report.seconds['spark_write']:.1f} s"
    )
    if report.rows_written != args.rows:
        report.problems.append(f"Spark wrote {report.rows_written} rows, expected {args.rows}")


@contextlib.contextmanager
def _spark_progress(spark: SparkSession, progress: Progress, begin: float) -> Iterator[None]:
    tracker = spark.sparkContext.statusTracker()
    stop = threading.Event()

    def watch() -> None:
        shown: tuple[int, int, int] | None = None
        while not stop.wait(0.2):
            done = running = total = 0
            for stage_id in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    running += info.numActiveTasks
                    total += info.numTasks
            if total:
                state = (done, running, total)
                progress.update(
                    f"[2/4] Spark job writing format('millpond'): {done}/{total} tasks done, "
                    f"{running} running, {time.monotonic() - begin:.1f} s",
                    changed=state != shown,
                )
                shown = state

    thread = threading.Thread(target=watch, name="millpond-demo-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _consume_phase(
    args: argparse.Namespace,
    target: _Target,
    sink_url: str,
    report: DemoReport,
    progress: Progress,
) -> None:
    from millpond.consumer import Consumer, ConsumerConfig
    from millpond.consumer.sinks import open_sink

    store = CountingStore(open_store(target.url, target.options))
    config = ConsumerConfig(store=store, gc_enabled=False)
    begin = time.monotonic()
    rows = batches = 0
    with open_sink(sink_url, table=args.table) as sink, Consumer(config) as consumer:
        consumer.initialize(last_acked_sequence=sink.last_sequence(consumer.queue))
        while (batch := consumer.next_batch()) is not None:
            sink.write(batch)
            consumer.ack(batch.sequence)
            batches += 1
            rows = sink.rows_written
            elapsed = time.monotonic() - begin
            progress.update(
                f"[3/4] consumer -> {report.sink}: {rows:,}/{report.rows_written:,} rows, "
                f"{batches} batches, {rows / max(elapsed, 1e-9):,.0f} rows/s"
            )
        consumer.flush()
    report.seconds["consume"] = time.monotonic() - begin
    report.batches_consumed = batches
    report.requests["consumer"] = store.counters.snapshot()
    progress.done(
        f"[3/4] consumer wrote {rows:,} rows from {batches} batches in "
        f"{report.seconds['consume']:.1f} s; the queue is drained"
    )


def _gc_phase(
    args: argparse.Namespace, target: _Target, report: DemoReport, progress: Progress
) -> None:
    from millpond.gc import GarbageCollector, GarbageCollectorConfig

    grace = args.gc_grace if args.gc_grace is not None else (0.0 if target.embedded else 600.0)
    store = CountingStore(open_store(target.url, target.options))
    begin = time.monotonic()
    result = GarbageCollector(GarbageCollectorConfig(store=store, gc_grace_period=grace)).run_once()
    report.seconds["gc"] = time.monotonic() - begin
    report.gc_deleted = len(result.deleted)
    report.objects_left = sum(
        1 for info in store.inner.list("ingest", recursive=False) if info.path.endswith(".batch")
    )
    report.requests["gc"] = store.counters.snapshot()
    progress.done(
        f"[4/4] GC (grace {grace:.0f} s) deleted {report.gc_deleted} batch objects, "
        f"{report.objects_left} left"
    )
    if result.failures:
        report.problems.append(f"GC could not delete {len(result.failures)} objects")


def _verify(args: argparse.Namespace, sink_url: str, report: DemoReport) -> None:
    count, distinct, low, high = _count_rows(sink_url, args.table, report.run_id)
    report.rows_in_database = count
    report.distinct_ids = distinct
    if count != args.rows:
        report.problems.append(f"the database holds {count} rows of this run, expected {args.rows}")
    if distinct != count:
        report.problems.append(f"{count - distinct} rows are duplicates")
    if count and (low, high) != (0, args.rows - 1):
        report.problems.append(f"ids run from {low} to {high}, expected 0 to {args.rows - 1}")
    if report.batches_consumed < report.batches_enqueued:
        report.problems.append(
            f"consumed {report.batches_consumed} batches, {report.batches_enqueued} were enqueued"
        )


def _count_rows(sink_url: str, table: str, run_id: str) -> tuple[int, int, int, int]:
    quoted = ".".join(f'"{part}"' for part in table.split("."))
    # run_id is hex we minted, so it is safe to inline.
    sql = (
        f"SELECT COUNT(*), COUNT(DISTINCT id), COALESCE(MIN(id), -1), COALESCE(MAX(id), -1) "
        f"FROM {quoted} WHERE run_id = '{run_id}'"
    )
    if sink_url.startswith("sqlite:"):
        import sqlite3

        path = sink_url.removeprefix("sqlite://")
        with contextlib.closing(sqlite3.connect(path)) as conn:
            row = conn.execute(sql).fetchone()
    else:
        import adbc_driver_postgresql.dbapi as pg_dbapi

        with pg_dbapi.connect(sink_url) as conn, conn.cursor() as cur:
            cur.execute(sql)
            row = cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


if __name__ == "__main__":
    sys.exit(main())
