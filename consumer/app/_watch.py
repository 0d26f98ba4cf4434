"""``millpond status --watch``: the status, refreshed in place, with rates and the last error.

Each refresh is one :func:`~millpond.consumer.app.status.queue_status` (one manifest GET; a listing
too with ``--bytes``). Between two refreshes it derives how many entries were appended and
dequeued per second, from the manifest's sequences alone, and with ``--sink`` the rows per
second the consumer wrote (from the sink's progress table). A refresh that fails (the store is
down, the manifest unreadable) keeps the last good figures on screen, marks them stale and
shows the error with its time, and the loop goes on: the watch itself never stops on a store
error. On a terminal the screen is redrawn in place; otherwise (a pipe, a log) each refresh is
printed as a block, or with ``--output json`` as one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from millpond.errors import MillpondError

__all__ = ["Rates", "rates_between", "watch"]

logger = logging.getLogger(__name__)

_CLEAR = "\x1b[H\x1b[J"  # cursor home, clear to the end of the screen


@dataclass(frozen=True, slots=True)
class Rates:
    """Entries (and, with a sink, rows) per second between two looks."""

    appended_per_second: float
    dequeued_per_second: float
    rows_per_second: float | None = None


def rates_between(
    before: Mapping[str, Any], after: Mapping[str, Any], seconds: float
) -> Rates | None:
    """Append and dequeue rates from two status records ``seconds`` apart (``None`` for no
    time or a manifest that was recreated in between)."""
    appended = after["next_sequence"] - before["next_sequence"]
    if seconds <= 0 or appended < 0:
        return None
    dequeued = before["queue_length"] + appended - after["queue_length"]
    rows = None
    if before.get("sink") is not None and after.get("sink") is not None:
        rows = max(0, after["sink"]["rows"] - before["sink"]["rows"]) / seconds
    return Rates(appended / seconds, max(0, dequeued) / seconds, rows)


def watch(
    args: argparse.Namespace,
    look: Callable[[], Mapping[str, Any]],
    render: Callable[[Mapping[str, Any]], list[str]],
    *,
    out: TextIO | None = None,
    refreshes: int | None = None,
) -> int:
    """Refresh every ``args.watch`` seconds until interrupted (or ``refreshes`` times).

    Args:
        args: the parsed command line (``watch``: seconds, ``output``: text or json).
        look: one status record (raises ``MillpondError`` when the store fails).
        render: the text lines of a record.
        out: where to write; default stdout.
        refreshes: stop after this many (tests); default until Ctrl-C.

    Returns:
        0 when interrupted with Ctrl-C.
    """
    out = out or sys.stdout
    tty = out.isatty() and args.output != "json"
    previous: tuple[float, Mapping[str, Any]] | None = None
    shown: Mapping[str, Any] | None = None
    last_error: dict[str, Any] | None = None
    rates: Rates | None = None
    count = 0
    try:
        while refreshes is None or count < refreshes:
            count += 1
            now = time.monotonic()
            stale = False
            try:
                record = look()
            except MillpondError as err:
                last_error = {"at": time.strftime("%H:%M:%S"), "error": str(err)}
                logger.debug("status refresh failed: %s", err)
                stale = True
            else:
                if previous is not None:
                    rates = rates_between(previous[1], record, now - previous[0]) or rates
                previous = (now, record)
                shown = record
            full = {
                **(shown or {}),
                "appended_per_second": None if rates is None else rates.appended_per_second,
                "dequeued_per_second": None if rates is None else rates.dequeued_per_second,
                "rows_per_second": None if rates is None else rates.rows_per_second,
                "stale": stale,
                "last_error": last_error,
            }
            _show(out, args, full, render, tty=tty, has_data=shown is not None)
            if refreshes is None or count < refreshes:
                time.sleep(args.watch)
    except KeyboardInterrupt:
        out.write("\n" if tty else "")
        out.flush()
    return 0


def _show(
    out: TextIO,
    args: argparse.Namespace,
    record: Mapping[str, Any],
    render: Callable[[Mapping[str, Any]], list[str]],
    *,
    tty: bool,
    has_data: bool,
) -> None:
    if args.output == "json":
        out.write(json.dumps(record, default=str) + "\n")
        out.flush()
        return
    lines = render(record) if has_data else ["(no successful look at the queue yet)"]
    appended, dequeued = record["appended_per_second"], record["dequeued_per_second"]
    rows = record["rows_per_second"]
    lines.append(
        "rates            "
        + (
            "- (after the second refresh)"
            if appended is None
            else f"{appended:.1f} entries/s appended, {dequeued:.1f} entries/s dequeued"
            + ("" if rows is None else f", {rows:,.0f} rows/s written")
        )
    )
    error = record["last_error"]
    lines.append(
        "last error       " + ("-" if error is None else f"{error['at']} {error['error']}")
    )
    if record["stale"]:
        lines.append("                 (the figures above are from the last good refresh)")
    stamp = f"every {args.watch:g} s, {time.strftime('%H:%M:%S')}; Ctrl-C to stop"
    if tty:
        out.write(_CLEAR + f"millpond status  {stamp}\n" + "\n".join(lines) + "\n")
    else:
        out.write(f"-- {stamp}\n" + "\n".join(lines) + "\n\n")
    out.flush()
