"""The ``millpond`` command line.

Subcommands live next to what they drive and are imported only when called, so the core never
imports the producer, consumer or collector at module level: each entry below names a module
with ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: 0 success, 1 a millpond error (one line on stderr), 2 bad usage (a bad option or
value, one line on stderr), 3 fenced.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

from millpond.errors import ConfigError, FencedError, MillpondError

__all__ = ["EXIT_ERROR", "EXIT_FENCED", "EXIT_USAGE", "main"]

logger = logging.getLogger(__name__)

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_FENCED = 3

_COMMANDS = {
    "inspect": ("millpond.cli.inspect", "show the queue manifest's footer and oldest entry"),
    "status": ("millpond.consumer.app.status", "queue length, oldest entry age, lag (--watch)"),
    "doctor": (
        "millpond.consumer.app.doctor",
        "check that a store (and a database) can hold a queue, with a fix for each problem",
    ),
    "consume": ("millpond.consumer.app.command", "run the consumer service into a database"),
    "gc": ("millpond.gc.command", "delete batch objects nothing references"),
    "quarantine": (
        "millpond.consumer.app.quarantine",
        "set aside the batch the consumer is stopped on (copied to a dead-letter prefix)",
    ),
    "replay": ("millpond.consumer.app.replay", "write a quarantined batch again, exactly once"),
    "coordinator": (
        "millpond.coordinator.command",
        "append many producers' batches in one compare-and-swap per round (optional service)",
    ),
}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_DESCRIPTION = """\
Millpond: a stateless ingest buffer on object storage. Producers stage records in a local
write-ahead log and publish them as batch objects listed in one queue manifest; one consumer
writes each batch into a database exactly once; a garbage collector removes what nothing
references. These commands look at a queue, check a store, and run the consumer and the
collector.

STORE_URL is s3://bucket[/root], az://container[/root], gs://bucket[/root] or file:///path.
Credentials and endpoints come from each backend's standard variables (AWS_*,
AZURE_STORAGE_*, GOOGLE_*) or --store-option KEY=VALUE."""

_EPILOG = """\
examples:
  millpond doctor s3://my-bucket/queue --sink postgresql://app@db/warehouse
  millpond status s3://my-bucket/queue --watch
  millpond inspect az://my-container/queue --output json
  millpond consume s3://my-bucket/queue --sink postgresql://app@db/warehouse --metrics-port 9464
  millpond gc gs://my-bucket/queue --interval 300 --metrics-port 9465
  millpond quarantine s3://my-bucket/queue --sequence 42 --reason 'bad dates' --sink ...
  millpond coordinator s3://my-bucket/queue --port 7411

exit codes: 0 success, 1 an error (one line on stderr), 2 bad usage, 3 fenced by a newer
consumer. `millpond COMMAND --help` describes each command."""


class _Parser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit code 2, never the usage block or a trace."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(_LOG_LEVELS[:-1])} or {_LOG_LEVELS[-1]}, found {text!r}"
        )
    return level


def _version() -> str:
    try:
        return version("millpond")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="millpond",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="WARNING",
        help="DEBUG, INFO, WARNING or ERROR (default WARNING)",
    )
    parser.add_argument("--version", action="version", version=f"millpond {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if arg in _COMMANDS), None)
    for name, (module, help_text) in _COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(sub)
        else:
            # Unused subcommands stay unimported; give them a catch-all so --help works.
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as done:  # --help, --version, or bad usage (already printed)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    module = importlib.import_module(_COMMANDS[args.command][0])
    try:
        code: int = module.run(args)
    except FencedError as err:
        if err.replaced:  # no newer consumer to leave the queue to: the operator must act
            print(f"millpond {args.command}: {err}", file=sys.stderr)
            return EXIT_ERROR
        print(f"millpond {args.command}: another consumer took over: {err}", file=sys.stderr)
        return EXIT_FENCED
    except ConfigError as err:
        # A bad option value: bad usage, like the ones argparse catches itself.
        print(f"millpond {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except MillpondError as err:
        print(f"millpond {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
