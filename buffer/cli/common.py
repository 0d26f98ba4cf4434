"""Arguments and output shared by every ``millpond`` subcommand."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from millpond.errors import ConfigError
from millpond.storage.store import ObjectStore, open_store

__all__ = ["add_store_arguments", "emit", "open_store_from_args", "parse_options"]


def add_store_arguments(parser: argparse.ArgumentParser, *, output: bool = True) -> None:
    """STORE_URL, --manifest-path, --data-prefix, --store-option and (optionally) --output."""
    parser.add_argument(
        "store",
        metavar="STORE_URL",
        help="s3://bucket[/root], az://container[/root], gs://bucket[/root] or file:///path",
    )
    parser.add_argument(
        "--manifest-path", default="ingest/manifest", help="default ingest/manifest"
    )
    parser.add_argument(
        "--data-prefix", default="ingest", help="batch object prefix (default ingest)"
    )
    parser.add_argument(
        "--store-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="obstore store option, repeatable (aws_*, azure_*, google_* keys; the AWS_*, "
        "AZURE_STORAGE_* and GOOGLE_* variables are read too)",
    )
    if output:
        parser.add_argument("--output", choices=("text", "json"), default="text")


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` into a dict.

    Raises:
        ConfigError: an item without ``=``.
    """
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError("store-option", f"expected KEY=VALUE, found {pair!r}")
        options[key.strip()] = value
    return options


def open_store_from_args(args: argparse.Namespace) -> ObjectStore:
    """The store named on the command line."""
    return open_store(args.store, parse_options(args.store_option))


def emit(args: argparse.Namespace, record: Mapping[str, Any], text: list[str]) -> None:
    """Print ``record`` as JSON or ``text`` as lines, per ``--output``."""
    if getattr(args, "output", "text") == "json":
        json.dump(record, sys.stdout, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n".join(text) + "\n")
    sys.stdout.flush()
