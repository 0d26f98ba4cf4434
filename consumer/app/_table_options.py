"""The table options of ``millpond consume`` and ``millpond replay``: which tables batches may
name, and how each table takes its rows (issue 46).

* ``--tables orders,audit_*``: more tables batches may name (names, or ``fnmatch`` patterns in
  the name part), appended;
* ``--config sink.toml``: ``[tables.NAME]`` sections with ``mode``, ``key`` and
  ``delete_column`` (:func:`millpond.consumer.sinks.load_tables`); every table named there may
  be written too;
* ``--mode upsert --key order_id[,...] [--delete-column deleted]``: the same for ``--table``,
  the single-table case.

A batch naming any other table is a bad batch: ``--on-bad-batch quarantine`` sets it aside,
otherwise the service stops on it, naming it.
"""

from __future__ import annotations

import argparse

from millpond.consumer.sinks import SinkTables, TableSettings, load_tables
from millpond.consumer.sinks._names import TableName
from millpond.errors import ConfigError

__all__ = ["add_table_arguments", "sink_tables"]


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tables``, ``--config``, ``--mode``, ``--key``, ``--delete-column``."""
    parser.add_argument(
        "--tables",
        action="append",
        default=[],
        metavar="NAMES",
        help="more tables batches may name (millpond.table in their metadata): names or "
        "patterns, comma-separated (orders,audit_*); appended unless --config says otherwise. "
        "A batch naming a table not allowed is a bad batch",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help='a file of [tables.NAME] sections (mode = "append" | "upsert", key = [...], '
        "delete_column = ...); each table named there may be written",
    )
    parser.add_argument(
        "--mode",
        choices=("append", "upsert"),
        default=None,
        help="how --table takes its rows (default append); upsert needs --key",
    )
    parser.add_argument(
        "--key",
        default=None,
        metavar="COLUMNS",
        help="--mode upsert: the key columns of --table, comma-separated; the last row of a "
        "key in queue order wins",
    )
    parser.add_argument(
        "--delete-column",
        default=None,
        metavar="COLUMN",
        help="--mode upsert: a boolean column whose true rows delete their key from --table",
    )


def sink_tables(args: argparse.Namespace) -> SinkTables:
    """The :class:`SinkTables` the options describe.

    Raises:
        ConfigError: a bad name or pattern, a file that cannot be read or is not valid,
            settings the sink refuses (``--key`` without ``--mode upsert``, ...), or
            ``--table``'s settings both in flags and in the file.
    """
    configured = load_tables(args.config) if args.config else SinkTables()
    names = [name.strip() for value in args.tables for name in value.split(",") if name.strip()]
    flags = args.mode is not None or args.key is not None or args.delete_column is not None
    default = TableSettings()
    if flags:
        key = tuple(column.strip() for column in (args.key or "").split(",") if column.strip())
        default = TableSettings(args.mode or "append", key, args.delete_column)
        own = str(TableName.parse("table", args.table))
        for name in configured.tables:
            if _same_spelling(name, own):
                raise ConfigError(
                    "mode",
                    f"--table {args.table} has settings in {args.config} ([tables.{name}]) and "
                    "in --mode/--key/--delete-column; give them in one place",
                )
    return configured.merged(SinkTables.allowing(names, default=default))


def _same_spelling(name: str, own: str) -> bool:
    try:
        return str(TableName.parse("table", name)) == own
    except ConfigError:  # a pattern
        return False
