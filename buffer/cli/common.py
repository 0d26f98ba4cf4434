"""Arguments and output shared by every ``millpond`` subcommand."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from millpond.common.durations import check_duration
from millpond.common.exposition import MetricsServer
from millpond.errors import ConfigError, NotFoundError
from millpond.storage import ObjectStore, open_store
from millpond.storage.checks import preflight
from millpond.storage.file_store import FileStore

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = [
    "add_metrics_arguments",
    "add_store_arguments",
    "emit",
    "open_store_from_args",
    "parse_options",
    "require_queue",
    "require_queue_unless_create",
    "serving_metrics",
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


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-address, for the long-running commands."""
    parser.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on http://ADDRESS:PORT/metrics (0: any free port, "
        "printed at start); off by default",
    )
    parser.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address the metrics server binds (default 127.0.0.1; 0.0.0.0 for every interface)",
    )


def seconds(*, allow_zero: bool, unit: str = "seconds") -> Callable[[str], float]:
    """An argparse ``type`` for a duration: a finite number above 0 (or 0 when allowed), so
    ``nan``, ``inf`` and negative values are usage errors, not waits that never end."""

    def parse(text: str) -> float:
        try:
            value = float(text)
            check_duration("value", value, allow_zero=allow_zero, unit=unit)
        except ValueError:  # a ConfigError is one too
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"expected a finite number of {unit} {bound}, found {text!r}"
            ) from None
        return value

    return parse


def count(text: str) -> int:
    """An argparse ``type`` for how many of something: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {text!r}")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, found {text!r}")
    return port


@contextmanager
def serving_metrics(
    args: argparse.Namespace, collectors: Iterable[Collector]
) -> Iterator[MetricsServer | None]:
    """Serve ``collectors`` on ``/metrics`` while the block runs, when ``--metrics-port`` is
    given; says where on stderr (one line, so a supervisor or a test can find the port).

    Raises:
        ConfigError: the address and port cannot be bound (exit 2).
    """
    if args.metrics_port is None:
        yield None
        return
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    with MetricsServer(registry, port=args.metrics_port, address=args.metrics_address) as server:
        print(f"millpond {args.command}: serving metrics on {server.url}", file=sys.stderr)
        sys.stderr.flush()
        yield server
