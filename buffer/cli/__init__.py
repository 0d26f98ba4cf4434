"""The ``millpond`` command line: ``inspect``, ``status``, ``consume``, ``gc`` and ``demo``.

:mod:`millpond.cli.main` parses arguments and dispatches; each subcommand lives next to what it
drives and is imported only when called (see ``_COMMANDS`` there).
"""

from __future__ import annotations

from millpond.cli.main import EXIT_ERROR, EXIT_FENCED, EXIT_USAGE, main

__all__ = ["EXIT_ERROR", "EXIT_FENCED", "EXIT_USAGE", "main"]
