"""``millpond gc STORE_URL [--once | --interval S] [--dry-run] [--grace-period S]``.

For a scheduler (cron, a Kubernetes CronJob): ``--once`` (the default) runs one pass and exits
0 even when some deletes failed (they are retried on the next run); ``--interval`` keeps
running passes until SIGTERM or SIGINT. Each pass prints its report (``--output json``: one JSON
object per line).
"""

from __future__ import annotations

import argparse
import threading
from functools import partial

from millpond.cli.common import (
    add_metrics_arguments,
    add_store_arguments,
    emit,
    parse_options,
    require_queue,
    seconds,
    serving_metrics,
)
from millpond.common.exposition import MetricsCollector, Sample
from millpond.common.signals import stop_on_signals
from millpond.gc._collector import GarbageCollector, GarbageCollectorConfig
from millpond.queue import GcReport

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="run one pass and exit (default)")
    mode.add_argument(
        "--interval",
        type=seconds(allow_zero=False),
        metavar="S",
        help="run a pass every S seconds until stopped",
    )
    parser.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    parser.add_argument(
        "--grace-period",
        type=seconds(allow_zero=True),
        default=600.0,
        metavar="S",
        help="minimum age in seconds of a deletable batch object (default 600)",
    )
    parser.add_argument(
        "--list-deleted", action="store_true", help="print every deleted path (text output)"
    )
    add_metrics_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = GarbageCollectorConfig(
        store=args.store,
        store_options=parse_options(args.store_option),
        manifest_path=args.manifest_path,
        data_path_prefix=args.data_prefix,
        gc_interval=args.interval if args.interval is not None else 300.0,
        gc_grace_period=args.grace_period,
        dry_run=args.dry_run,
    )
    collector = GarbageCollector(config)
    if args.interval is None:  # one pass (a dry run too) on a mistyped root: say so, create nothing
        require_queue(collector.store, args.manifest_path)
    report = partial(_print, args)
    with serving_metrics(args, [metrics_collector(collector)]):
        if args.interval is None:
            report(collector.run_once())
            return 0
        stop = threading.Event()
        try:
            with stop_on_signals(stop):
                collector.run_forever(stop, on_report=report)
        finally:
            collector.close()
    return 0


def _print(args: argparse.Namespace, report: GcReport) -> None:
    verb = "would delete" if report.dry_run else "deleted"
    kept = ", ".join(f"{count} {reason}" for reason, count in sorted(report.kept.items()))
    text = [
        f"listed {report.listed} objects; {verb} {len(report.deleted)}; kept: {kept or 'none'}",
    ]
    if args.list_deleted:
        text.extend(f"  {verb} {path}" for path in report.deleted)
    text.extend(f"  FAILED {f.path}: {f.reason}" for f in report.failures)
    emit(args, report.to_dict(), text)


GC_METRICS = (
    "millpond_gc_passes_total",
    "millpond_gc_deleted_total",
    "millpond_gc_failed_total",
    "millpond_gc_errors_total",
    "millpond_gc_duration_seconds",
)
"""What ``millpond gc --metrics-port`` exports."""


def metrics_collector(collector: GarbageCollector) -> MetricsCollector:
    """The collector's counters and pass times as Prometheus metrics."""

    def samples() -> list[Sample]:
        counters = collector.counters.snapshot()
        return [
            Sample("millpond_gc_passes_total", counters.get("passes", 0)),
            Sample("millpond_gc_deleted_total", counters.get("deleted", 0)),
            Sample("millpond_gc_failed_total", counters.get("failed_deletes", 0)),
            Sample("millpond_gc_errors_total", counters.get("errors", 0)),
            Sample("millpond_gc_duration_seconds", collector.latency.histogram()),
        ]

    return MetricsCollector(samples, GC_METRICS)
