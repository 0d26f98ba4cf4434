"""The ``millpond`` command line.

Subcommands live next to what they drive and are imported only when called, so the core never
imports the producer, consumer or collector at module level: each entry below names a module
with ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: 0 success, 1 a millpond error (one line on stderr), 2 bad usage (a bad option or
value, one line on stderr), 3 fenced.
"""

from __future__ import annotations

import argparse
import difflib
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
    "local": (
        "millpond.localstack.local",
        "start S3 (SeaweedFS) and PostgreSQL on 127.0.0.1 to try millpond on this machine",
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
  millpond local    # a local S3 and PostgreSQL, and the variables that point at them

exit codes: 0 success, 1 an error (one line on stderr), 2 bad usage, 3 fenced by a newer
consumer. `millpond COMMAND --help` describes each command."""


class _Parser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit code 2, never the usage block or a trace."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument COMMAND: invalid choice: "):
            typed = message.split("'")[1] if message.count("'") >= 2 else ""
            close = difflib.get_close_matches(typed, list(_COMMANDS), n=1)
            message = f"unknown command {typed!r}" + (
                f": did you mean {close[0]}?" if close else ""
            )
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


def command_parser(name: str) -> argparse.ArgumentParser:
    """The whole parser of one subcommand (its module imported), as ``millpond NAME`` reads
    its arguments; for ``--help`` texts and the generated reference.

    Raises:
        KeyError: no such command.
    """
    parser = build_parser([name])
    return _subcommands(parser)[name]


def command_summaries() -> dict[str, str]:
    """Each subcommand's name and one-line summary, in ``millpond --help``'s order."""
    return {name: summary for name, (_, summary) in _COMMANDS.items()}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _unrecognized(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]) -> str:
    """The usage error for options the chosen subcommand does not take: the closest option
    it does take, and its own ``--help`` (not ``millpond --help``, which lists no options).

    ``extras`` are what argparse left over; long options are found in ``argv`` first, so a
    misspelt ``--sink`` is named before the missing ``--sink`` would be."""
    chosen = next((arg for arg in argv if arg in _COMMANDS), "")
    prog = f"millpond {chosen}".rstrip()
    sub = _subcommands(parser).get(chosen, parser)
    known = [option for action in sub._actions for option in action.option_strings]
    for token in extras:
        name = token.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if name[:1] == "-" else []
        if close:
            return (
                f"{prog}: error: unrecognized argument {name}: did you mean {close[0]}? "
                f"(see {prog} --help)"
            )
    return f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)"


def _unknown_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The ``--long`` options after the subcommand that it does not take (nor abbreviates)."""
    chosen = next((i for i, arg in enumerate(argv) if arg in _COMMANDS), None)
    if chosen is None:
        return []
    sub = _subcommands(parser)[argv[chosen]]
    known = [option for action in sub._actions for option in action.option_strings]
    unknown: list[str] = []
    for token in argv[chosen + 1 :]:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if name.startswith("--") and not any(option.startswith(name) for option in known):
            unknown.append(name)
    return unknown


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The arguments, or the exit code of ``--help``, ``--version`` or bad usage (printed)."""
    unknown = _unknown_options(parser, argv)
    if unknown:
        print(_unrecognized(parser, argv, unknown), file=sys.stderr)
        return EXIT_USAGE
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as done:  # --help, --version, or bad usage (already printed)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    if extras:
        print(_unrecognized(parser, argv, extras), file=sys.stderr)
        return EXIT_USAGE
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = _parse(parser, args_list)
    if isinstance(args, int):
        return args
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
