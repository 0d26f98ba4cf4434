"""``millpond consume STORE_URL --sink URL``: the command line of the consumer service.

Parses the options, opens the sink and the consumer, and runs
:class:`~millpond.consumer.app.service.ConsumerService` until SIGTERM or SIGINT (or, with
``--exit-when-idle``, until the queue is drained). What the service does is described in
:mod:`millpond.consumer.app.service`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading

from millpond.cli.common import (
    add_store_arguments,
    count,
    parse_options,
    require_queue_unless_create,
    seconds,
    serving_metrics,
)
from millpond.common.signals import stop_on_signals
from millpond.consumer._config import ConsumerConfig
from millpond.consumer._consumer import Consumer
from millpond.consumer.app import _metrics
from millpond.consumer.app._report import ServiceReporter
from millpond.consumer.app._table_options import add_table_arguments, sink_tables
from millpond.consumer.app._written import WrittenPublisher
from millpond.consumer.app.quarantine import quarantine_command
from millpond.consumer.app.service import ConsumerService
from millpond.consumer.app.service import logger as service_logger
from millpond.consumer.sinks import open_sink

__all__ = ["EXIT_WHEN_IDLE_START_TIMEOUT", "add_arguments", "run", "start_timeout"]

EXIT_WHEN_IDLE_START_TIMEOUT = 120.0
"""``--start-timeout`` of a run with ``--exit-when-idle`` (a scheduled job): a database that
does not answer for two minutes ends the run, exit 1, rather than holding the scheduler for
ever."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``millpond consume``, in the order ``--help`` lists them."""
    add_store_arguments(parser, output=False)
    parser.add_argument(
        "--create",
        action="store_true",
        help="start an empty queue when there is none at STORE_URL (else refuse: a typo)",
    )
    _add_sink_arguments(parser)
    add_table_arguments(parser)
    _add_consumer_arguments(parser)
    _add_loop_arguments(parser)
    _add_gc_arguments(parser)
    _metrics.add_arguments(parser)
    _add_bad_batch_arguments(parser)
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="URL",
        help="http://host:port of a millpond coordinator serving the queue: dequeues are sent "
        "there (no race with its rounds), and made directly whenever it does not answer; its "
        "token, if it has one, is MILLPOND_COORDINATOR_TOKEN",
    )
    parser.add_argument(
        "--report-interval",
        type=seconds(allow_zero=True),
        default=5.0,
        help="seconds between reports for millpond status (default 5; 0: at start and stop)",
    )


def _add_sink_arguments(parser: argparse.ArgumentParser) -> None:
    """The database: where rows go, and how entries become rows."""
    parser.add_argument(
        "--sink", required=True, metavar="URL", help="sqlite:///path.db or postgresql://..."
    )
    parser.add_argument(
        "--table",
        default="millpond_rows",
        help="the table for rows whose batch names none, [schema.]name (default "
        "millpond_rows); the queue's progress is recorded under its name",
    )
    parser.add_argument(
        "--entry-format",
        choices=("auto", "arrow", "opaque"),
        default="auto",
        help="Arrow IPC entries become rows with their columns; opaque entries one row each",
    )
    parser.add_argument(
        "--sequence-column",
        default="_millpond_sequence",
        help="a column holding each Arrow row's batch sequence, added to every table the "
        "consumer writes (ALTER TABLE on one it did not create; default _millpond_sequence; "
        "'' for none)",
    )
    parser.add_argument("--progress-table", default="millpond_progress")


def _add_consumer_arguments(parser: argparse.ArgumentParser) -> None:
    """The consumer's dequeues, backlog index and read-ahead."""
    parser.add_argument(
        "--ack-batch-size",
        type=int,
        default=1000,
        help="fewest acks per dequeue (with a backlog, also 10%% of what is queued behind)",
    )
    defaults = {field.name: field.default for field in dataclasses.fields(ConsumerConfig)}
    parser.add_argument(
        "--backlog-index",
        action=argparse.BooleanOptionalAction,
        default=defaults["backlog_index"],
        help="move a long backlog out of the manifest into the consumer's own index, so "
        "appends stay cheap (default on); --no-backlog-index where an RFC peer's GC collects "
        "the data prefix (it would delete indexed batch objects) or its consumer may take over",
    )
    parser.add_argument(
        "--backlog-index-threshold",
        type=int,
        default=defaults["backlog_index_threshold"],
        help="manifest entries that trigger a move into the backlog index (default "
        f"{defaults['backlog_index_threshold']})",
    )
    parser.add_argument(
        "--read-ahead", type=int, default=4, help="batch objects fetched ahead at first (4)"
    )
    parser.add_argument(
        "--read-ahead-max",
        type=int,
        default=64,
        help="most batch objects fetched ahead while deliveries wait for a slow store (64)",
    )


def _add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The service's loop: groups, polls, progress lines, when to stop."""
    parser.add_argument(
        "--max-group",
        type=count,
        default=64,
        help="most batches written in one transaction when there is a backlog (default 64)",
    )
    parser.add_argument(
        "--poll-interval",
        type=seconds(allow_zero=False),
        default=1.0,
        help="longest pause between idle polls (s)",
    )
    parser.add_argument(
        "--progress-interval",
        type=seconds(allow_zero=False),
        default=10.0,
        help="seconds between progress lines",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--exit-when-idle",
        action="store_true",
        help="stop once the queue is drained (for a scheduled job) instead of polling",
    )
    parser.add_argument(
        "--start-timeout",
        type=seconds(allow_zero=False),
        default=None,
        help="give up (exit 1, naming the database or the store) when either does not answer "
        f"for this long at start (default {EXIT_WHEN_IDLE_START_TIMEOUT:g} s with "
        "--exit-when-idle; without it, wait as long as it takes)",
    )


def _add_gc_arguments(parser: argparse.ArgumentParser) -> None:
    """The garbage collector run in this process."""
    parser.add_argument(
        "--gc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the garbage collector in this process (default on)",
    )
    parser.add_argument(
        "--gc-interval", type=seconds(allow_zero=False), default=300.0, help="seconds (default 300)"
    )
    parser.add_argument(
        "--gc-grace-period",
        type=seconds(allow_zero=True),
        default=600.0,
        help="seconds (default 600)",
    )


def _add_bad_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """What a batch that cannot be written does: stop, or set it aside."""
    parser.add_argument(
        "--on-bad-batch",
        choices=("stop", "quarantine"),
        default="stop",
        help="a batch that cannot be decoded or that the database refuses for good: stop on "
        "it (default) or set it aside in the dead-letter prefix, counting each",
    )
    parser.add_argument(
        "--dead-letter-prefix",
        default=None,
        help="where set-aside batches are copied (default {data-prefix}-dead-letter)",
    )
    parser.add_argument(
        "--quarantine-limit",
        type=count,
        default=10,
        help="with --on-bad-batch quarantine, stop after this many in a row (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the service until SIGTERM or SIGINT.

    Raises:
        FencedError: another consumer took over (the CLI exits 3), or the manifest was
            replaced (exit 1).
        MillpondError: bad data, a bad configuration or a refusing database (exit 1).
    """
    if not args.quiet:
        # The service's progress lines are INFO.
        service_logger.setLevel(min(service_logger.getEffectiveLevel(), logging.INFO))
    config = _consumer_config(args)
    stop = threading.Event()
    with (
        stop_on_signals(stop, what="finishing the current batch"),
        open_sink(
            args.sink,
            table=args.table,
            entry_format=args.entry_format,
            sequence_column=args.sequence_column or None,
            progress_table=args.progress_table,
            tables=sink_tables(args),
        ) as sink,
    ):
        require_queue_unless_create(args)  # every option is checked first: a typo is usage
        consumer = Consumer(config)
        reporter = _reporter(args, consumer, sink_description=sink.description)
        timed = _metrics.TimedSink(sink)
        metrics = _metrics.ConsumerMetrics(consumer, timed, interval=args.metrics_interval)
        service = ConsumerService(
            consumer,
            timed,
            poll_max=args.poll_interval,
            max_group=args.max_group,
            progress_interval=args.progress_interval,
            on_bad_batch=args.on_bad_batch,
            dead_letter_prefix=args.dead_letter_prefix,
            quarantine_limit=args.quarantine_limit,
            reporter=reporter,
            ledger=sink,
            start_timeout=start_timeout(args),
        )
        with (
            serving_metrics(args, [metrics.collector()]) as server,
            metrics.sampling(enabled=server is not None),
        ):
            service.run(stop, until_idle=args.exit_when_idle)
    return 0


def start_timeout(args: argparse.Namespace) -> float | None:
    """``--start-timeout``, or its default: two minutes with ``--exit-when-idle``, none
    otherwise (a service waits a database out however long it is down)."""
    if args.start_timeout is not None:
        return float(args.start_timeout)
    return EXIT_WHEN_IDLE_START_TIMEOUT if args.exit_when_idle else None


def _consumer_config(args: argparse.Namespace) -> ConsumerConfig:
    return ConsumerConfig(
        store=args.store,
        store_options=parse_options(args.store_option),
        manifest_path=args.manifest_path,
        data_path_prefix=args.data_prefix,
        ack_batch_size=args.ack_batch_size,
        backlog_index=args.backlog_index,
        backlog_index_threshold=args.backlog_index_threshold,
        read_ahead=args.read_ahead,
        read_ahead_max=args.read_ahead_max,
        gc_enabled=args.gc,
        gc_interval=args.gc_interval,
        gc_grace_period=args.gc_grace_period,
        coordinator=args.coordinator,
    )


def _reporter(
    args: argparse.Namespace, consumer: Consumer, *, sink_description: str
) -> ServiceReporter:
    """The report ``millpond status`` reads, naming the ``millpond quarantine`` command line
    that sets aside the batch the service stopped on, with the written-through mark
    producers wait on."""

    def command(sequence: int) -> str:
        return quarantine_command(
            consumer.store.url,
            sequence,
            sink=sink_description,
            table=args.table,
            progress_table=args.progress_table,
            manifest_path=args.manifest_path,
            data_prefix=args.data_prefix,
            dead_letter_prefix=args.dead_letter_prefix,
        )

    prefix = consumer.config.data_path_prefix
    return ServiceReporter(
        consumer.store,
        data_path_prefix=prefix,
        queue=consumer.queue,
        interval=args.report_interval,
        quarantine_command=command,
        # What producers wait on (wait_written, await_sink), kept in step with the report.
        written=WrittenPublisher(
            consumer.store,
            data_path_prefix=prefix,
            queue=consumer.queue,
            interval=args.report_interval,
        ),
    )
