"""``millpond coordinator STORE_URL``: append many producers' batches in one CAS per round.

Runs :class:`~millpond.coordinator.rounds.AppendCoordinator` over HTTP
(:mod:`millpond.coordinator.server`) until SIGTERM or SIGINT, then refuses what has not
started, finishes the round under way and exits 0. Producers name it with
``ProducerConfig(coordinator="http://host:port")`` (Spark: ``.option("coordinator", ...)``)
and append directly whenever it does not answer, so it is never a single point of failure:
run one or several, restart them at will.

Prints one line, ``millpond coordinator: serving QUEUE on http://HOST:PORT``, once it accepts
requests (``--port 0`` picks a free port; the line names it).

With ``MILLPOND_COORDINATOR_TOKEN`` set, every request must carry that token (producers, the
Spark driver and consumers send it when the variable is set for them too); without it,
whoever reaches the port can append to the queue and dequeue from it, so the service then
listens on a loopback address only and refuses any other ``--bind`` (exit 2).
"""

from __future__ import annotations

import argparse
import inspect
import ipaddress
import signal
import threading
from types import FrameType

from millpond.cli.common import (
    add_store_arguments,
    count,
    open_store_from_args,
    require_queue,
    seconds,
)
from millpond.common.retry import STRATEGIES, RetryPolicy
from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.server import CoordinatorServer
from millpond.coordinator.wire import DEFAULT_BUDGET, TOKEN_ENV, token_from_env
from millpond.errors import ConfigError
from millpond.queue.claim import queue_identity

__all__ = ["add_arguments", "run"]

# The pacing defaults are the coordinator's own, not spelled again here.
_PACING = inspect.signature(AppendCoordinator).parameters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser, output=False)
    parser.add_argument(
        "--bind",
        default="127.0.0.1",
        help=f"address to listen on (default 127.0.0.1); any but a loopback address needs "
        f"{TOKEN_ENV}",
    )
    parser.add_argument("--port", type=int, default=7411, help="default 7411; 0: a free port")
    parser.add_argument(
        "--yield-every",
        type=count,
        default=_PACING["yield_every"].default,
        metavar="ROUNDS",
        help="while another writer (the consumer, a producer appending directly) has written "
        "lately: back-to-back rounds after which the coordinator leaves the manifest alone for a "
        "moment, so its writes get in (default %(default)s)",
    )
    parser.add_argument(
        "--quiet-yield-interval",
        type=seconds(allow_zero=True),
        default=_PACING["quiet_yield_interval"].default,
        metavar="SECONDS",
        help="while nobody else has written lately: seconds of back-to-back rounds between two "
        "such moments, so a consumer arriving gets in (default %(default)s)",
    )
    parser.add_argument(
        "--consumer-yield-interval",
        type=seconds(allow_zero=True),
        default=_PACING["consumer_yield_interval"].default,
        metavar="SECONDS",
        help="the same while a consumer sends its dequeues here (it asks for a moment before its "
        "takeover; the rest is for writers that do not know the coordinator) (default %(default)s)",
    )
    parser.add_argument(
        "--busy-seconds",
        type=seconds(allow_zero=True),
        default=_PACING["busy_seconds"].default,
        metavar="SECONDS",
        help="how long after another writer's write the coordinator counts as shared "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--yield-slots",
        type=seconds(allow_zero=True, unit="store requests"),
        default=_PACING["yield_slots"].default,
        metavar="REQUESTS",
        help="how long that moment is, in store requests' time (default %(default)s)",
    )
    parser.add_argument(
        "--create",
        action="store_true",
        help="serve a queue that does not exist yet (its first round creates the manifest)",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="exponential",
        help="how a round that lost its compare-and-swap retries (default exponential)",
    )


def run(args: argparse.Namespace) -> int:
    token = token_from_env()
    if token is None and not _loopback(args.bind):
        raise ConfigError(
            "--bind",
            f"a coordinator on {args.bind!r} without a token would take appends and dequeues "
            f"from anyone who reaches it: set {TOKEN_ENV} (and the same for its producers and "
            "consumer), or bind a loopback address",
        )
    store = open_store_from_args(args)
    if not args.create:
        require_queue(
            store, args.manifest_path, create_hint=" (pass --create to serve a new queue)"
        )
    identity = queue_identity(store.url, args.manifest_path)
    coordinator = AppendCoordinator(
        store,
        args.manifest_path,
        data_path_prefix=args.data_prefix,
        queue=identity,
        retry=RetryPolicy(max_attempts=1000, max_elapsed=DEFAULT_BUDGET, strategy=args.strategy),
        yield_every=args.yield_every,
        yield_slots=args.yield_slots,
        quiet_yield_interval=args.quiet_yield_interval,
        busy_seconds=args.busy_seconds,
        consumer_yield_interval=args.consumer_yield_interval,
    )
    try:
        server = CoordinatorServer(coordinator, args.bind, args.port, token=token)
    except OSError as err:
        raise ConfigError(
            "--bind", f"cannot listen on {args.bind} port {args.port}: {err.strerror or err}"
        ) from err
    stopped = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        if not stopped.is_set():
            stopped.set()
            threading.Thread(target=server.close, name="millpond-coordinator-stop").start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"millpond coordinator: serving {identity} on {server.url}", flush=True)
    server.serve_forever()
    return 0


def _loopback(address: str) -> bool:
    """Whether ``address`` is a loopback one (``localhost`` or an IP address such as
    127.0.0.1 or ::1); a name is not resolved, so any other is taken as reachable."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
