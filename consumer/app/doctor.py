"""``millpond doctor STORE_URL [--sink URL] [--output text|json]``: is this store (and sink)
ready to hold a queue?

One line per check, pass, fail or skip, each failure with a fix: credentials found (and from
where, never their values), bucket or container exists, put/get/list/delete allowed under the
root, conditional create (``If-None-Match: *``) and conditional update (``If-Match``) really
reject a stale write, clock skew against the store, the manifest readable, and with
``--sink`` the database reachable and writable. Exits 1 when a check fails.

The store checks live in the core (:mod:`millpond.storage.checks`); the sink check is here
because it needs the consumer's sinks. The store checks write only under
``_millpond_check/`` and delete what they wrote; the sink check writes a scratch table in a
transaction it rolls back.
"""

from __future__ import annotations

import argparse
from typing import Any

from millpond.cli.common import add_store_arguments, emit, open_store_from_args, seconds
from millpond.cli.main import EXIT_ERROR
from millpond.common.clock import Clock
from millpond.consumer.sinks import SinkError, open_sink, redact
from millpond.errors import ConfigError
from millpond.storage.checks import MAX_CLOCK_SKEW, CheckResult, run_store_checks
from millpond.storage.store import ObjectStore

__all__ = ["add_arguments", "check_sink", "doctor", "run"]

_WIDTH = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument(
        "--sink", metavar="URL", help="also check this database: sqlite:///x.db or postgresql://…"
    )
    parser.add_argument("--table", default="millpond_rows", help="target table [schema.]name")
    parser.add_argument("--progress-table", default="millpond_progress")
    parser.add_argument(
        "--max-clock-skew",
        type=seconds(allow_zero=True),
        default=MAX_CLOCK_SKEW,
        metavar="S",
        help=f"seconds of clock skew against the store that still pass (default "
        f"{MAX_CLOCK_SKEW:.0f})",
    )


def check_sink(url: str, *, table: str, progress_table: str) -> CheckResult:
    """Whether the database answers and lets these credentials create a table and insert."""
    shown = redact(url)
    hint = (
        "check the URL, that the database is up, and that its user may CREATE TABLE and "
        "INSERT where the target table lives"
    )
    try:
        with open_sink(url, table=table, progress_table=progress_table) as sink:
            sink.probe_write()
    except ConfigError as err:
        return CheckResult(name="sink", status="fail", detail=str(err), hint=hint)
    except SinkError as err:
        return CheckResult(name="sink", status="fail", detail=f"{shown}: {err}", hint=hint)
    return CheckResult(
        name="sink",
        status="pass",
        detail=f"{shown}: reachable; a scratch table was created and written (rolled back)",
    )


def doctor(
    store: ObjectStore,
    *,
    manifest_path: str = "ingest/manifest",
    sink: str | None = None,
    table: str = "millpond_rows",
    progress_table: str = "millpond_progress",
    clock: Clock | None = None,
    max_skew: float = MAX_CLOCK_SKEW,
) -> list[CheckResult]:
    """Every check ``millpond doctor`` runs, in order; none raises for what it finds."""
    results = run_store_checks(store, manifest_path=manifest_path, clock=clock, max_skew=max_skew)
    if sink is None:
        results.append(CheckResult(name="sink", status="skip", detail="skipped: no --sink given"))
    else:
        results.append(check_sink(sink, table=table, progress_table=progress_table))
    return results


def run(args: argparse.Namespace) -> int:
    """Run the checks; exit 0 when none failed, 1 otherwise."""
    store = open_store_from_args(args)
    results = doctor(
        store,
        manifest_path=args.manifest_path,
        sink=args.sink,
        table=args.table,
        progress_table=args.progress_table,
        max_skew=args.max_clock_skew,
    )
    failed = [r for r in results if r.status == "fail"]
    record: dict[str, Any] = {
        "store": store.url,
        "ok": not failed,
        "checks": [r.to_dict() for r in results],
    }
    text = [f"millpond doctor {store.url}"]
    for result in results:
        text.append(f"{result.status.upper():<5} {result.name:<{_WIDTH}} {result.detail}")
        if result.hint:
            text.append(f"{'':<5} {'':<{_WIDTH}} fix: {result.hint}")
    text.append(f"{len(failed)} of {len(results)} checks failed" if failed else "all checks passed")
    emit(args, record, text)
    return EXIT_ERROR if failed else 0
