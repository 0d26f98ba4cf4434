"""Arguments and output shared by every ``millpond`` subcommand."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from millpond.errors import ConfigError, NotFoundError
from millpond.storage.checks import preflight
from millpond.storage.file_store import FileStore
from millpond.storage.store import ObjectStore, open_store

__all__ = [
    "add_store_arguments",
    "emit",
    "open_store_from_args",
    "parse_options",
    "require_queue",
    "require_queue_unless_create",
]


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


def require_queue(store: ObjectStore, manifest_path: str, *, create_hint: str = "") -> None:
    """Fail unless a queue is there; creates nothing.

    First the cheap store checks (credentials, bucket); then the manifest must exist.

    Raises:
        StoreAccessError: missing or rejected credentials, a missing bucket, no permission.
        NotFoundError: ``no queue at …``: the directory or the manifest does not exist.
    """
    preflight(store, write=False)
    if isinstance(store, FileStore) and not store.exists():
        raise NotFoundError(f"no queue at {store.url}: the directory does not exist{create_hint}")
    try:
        store.head(manifest_path)
    except NotFoundError as err:
        raise NotFoundError(
            f"no queue at {store.url}: no manifest at {manifest_path}{create_hint}"
        ) from err


def require_queue_unless_create(args: argparse.Namespace) -> None:
    """For ``consume``: a missing queue is a typo unless ``--create`` says otherwise.

    Raises:
        StoreAccessError: as :func:`require_queue`.
        NotFoundError: ``no queue at …``, naming ``--create``.
    """
    if not getattr(args, "create", False):
        require_queue(
            open_store_from_args(args),
            args.manifest_path,
            create_hint=" (pass --create to start an empty queue there)",
        )


def emit(args: argparse.Namespace, record: Mapping[str, Any], text: list[str]) -> None:
    """Print ``record`` as JSON or ``text`` as lines, per ``--output``."""
    if getattr(args, "output", "text") == "json":
        json.dump(record, sys.stdout, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n".join(text) + "\n")
    sys.stdout.flush()
