"""``millpond replay STORE_URL --sequence N --sink URL``: write a quarantined batch again.

Reads the dead-letter copy that ``millpond quarantine`` made and writes its rows into the
table in one transaction with the mark that it was replayed, so replaying twice writes once,
and a location that comes back in the queue is skipped before and after. ``--all`` replays
every batch of the table still set aside, in sequence order, and stops at the first one that
still fails. See :mod:`millpond.consumer.app.quarantine`.
"""

from __future__ import annotations

import argparse
from typing import Any

from millpond.cli.common import add_store_arguments, emit
from millpond.consumer.app._table_options import add_table_arguments, sink_tables
from millpond.consumer.app.quarantine import (
    add_sink_arguments,
    config_from_args,
    replay,
)
from millpond.consumer.sinks import open_sink
from millpond.errors import ConfigError
from millpond.queue import queue_identity
from millpond.storage import open_store

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--sequence", type=int, help="the quarantined batch to write")
    which.add_argument(
        "--all", action="store_true", help="every batch still set aside, in sequence order"
    )
    add_sink_arguments(parser)
    parser.add_argument(
        "--entry-format",
        choices=("auto", "arrow", "opaque"),
        default="auto",
        help="as given to millpond consume",
    )
    parser.add_argument(
        "--sequence-column",
        default="_millpond_sequence",
        help="as given to millpond consume ('' for none)",
    )
    add_table_arguments(parser)  # as given to millpond consume


def run(args: argparse.Namespace) -> int:
    """``millpond replay``.

    Raises:
        MillpondError: the batch is not quarantined, still cannot be written, or a bad option.
    """
    config = config_from_args(args)
    if args.sequence is not None and args.sequence < 0:
        raise ConfigError("sequence", f"expected a sequence >= 0, found {args.sequence}")
    with open_sink(
        args.sink,
        table=args.table,
        progress_table=args.progress_table,
        entry_format=args.entry_format,
        sequence_column=args.sequence_column or None,
        tables=sink_tables(args),
    ) as sink:
        if args.all:
            store = open_store(config.store, config.store_options)
            queue = queue_identity(store.url, config.manifest_path)
            sequences = [
                row.sequence for row in sink.quarantined(queue) if row.replayed_at_ms is None
            ]
        else:
            sequences = [args.sequence]
        outcomes = [
            replay(config, sink, sequence=sequence, dead_letter_prefix=args.dead_letter_prefix)
            for sequence in sequences
        ]
    record: dict[str, Any] = {
        "replayed": [
            {"sequence": o.sequence, "location": o.location, "rows": o.rows} for o in outcomes
        ]
    }
    text = [
        f"sequence {o.sequence} ({o.location}): "
        + ("already replayed; nothing written" if o.rows is None else f"{o.rows} rows written")
        for o in outcomes
    ] or ["nothing is set aside"]
    emit(args, record, text)
    return 0
