"""The ``millpond`` command line.

Subcommands live next to what they drive and are imported only when called, so the core never
imports the producer, consumer or collector at module level: each entry below names a module
with ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: 0 success, 1 a millpond error (one line on stderr), 2 bad usage, 3 fenced.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from millpond.errors import FencedError, MillpondError

__all__ = ["EXIT_ERROR", "EXIT_FENCED", "EXIT_USAGE", "main"]

logger = logging.getLogger(__name__)

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_FENCED = 3

_COMMANDS = {
    "inspect": ("millpond.cli.inspect", "show the queue manifest's footer and oldest entry"),
    "status": ("millpond.consumer.status", "queue length, bytes, oldest entry age, lag"),
    "consume": ("millpond.consumer.service", "run the consumer service into a database"),
    "gc": ("millpond.gc.command", "delete batch objects nothing references"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="millpond", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default WARNING)"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if arg in _COMMANDS), None)
    for name, (module, help_text) in _COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text)
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
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    module = importlib.import_module(_COMMANDS[args.command][0])
    try:
        code: int = module.run(args)
    except FencedError as err:
        print(f"millpond {args.command}: another consumer took over: {err}", file=sys.stderr)
        return EXIT_FENCED
    except MillpondError as err:
        print(f"millpond {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
