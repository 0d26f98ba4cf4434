"""``millpond coordinator`` over HTTP: the wire protocol and a small threaded server.

Requests (HTTP/1.1, keep-alive):

* ``POST /v1/append`` — body: the entries in the RFC manifest encoding
  (:func:`encode_entries`); headers ``X-Millpond-Queue`` (the
  queue's identity: a coordinator serves one queue and refuses any other),
  ``X-Millpond-Request`` (an id the client makes up; a second request with the same id gets
  the first one's outcome, never a second append), ``X-Millpond-Budget`` (seconds) and
  ``X-Millpond-From`` (the highest ``next_sequence`` the client has seen: should it append the
  entries itself after giving up on the reply, they land at or after it), and optionally
  ``X-Millpond-After`` (the id of the client's request still out that these entries must
  follow: they are appended behind it, or refused unwritten if it was not appended). The
  reply, once the round is over, is an :class:`Outcome` as JSON:
  200 for ``appended`` and ``unknown``, 503 for ``refused``; 400 for a request that cannot be
  served (refused too: nothing is written).
* ``POST /v1/outcome`` — header ``X-Millpond-Request``: the outcome of a request whose reply
  was lost (withdrawing it if its round has not started; an id never seen is remembered as
  refused, so that request is never appended should it still arrive).
* ``POST /v1/dequeue`` — headers ``X-Millpond-Queue``, ``X-Millpond-Epoch`` (the consumer's)
  and ``X-Millpond-Through``: a consumer's dequeue, written between two rounds
  (:mod:`millpond.queue.coordinator_dequeue`). The reply, as JSON: 200 ``dequeued``, 409
  ``fenced``, 503 ``refused``, 400 for a request that cannot be served.
* ``POST /v1/make-way`` — header ``X-Millpond-Queue``: a consumer about to take over asks the
  coordinator to leave the manifest alone for a moment (its epoch bump is a read, then a
  write). The reply comes once that moment has begun: 200 ``clear``; 503 ``refused`` when it
  did not begin in time.
* ``GET /v1/health`` — the queue served and counters, as JSON.

The server binds 127.0.0.1 unless told otherwise. It holds no state a restart would lose
except outcomes of requests already answered (see :mod:`millpond.queue.coordinator`).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import math
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from millpond.errors import ConfigError, FormatError, InvalidInputError
from millpond.formats.manifest import PendingEntry, append_entries, decode_manifest, empty_manifest

if TYPE_CHECKING:
    from millpond.queue.coordinator import AppendCoordinator

__all__ = [
    "AFTER_HEADER",
    "APPENDED",
    "APPEND_PATH",
    "BUDGET_HEADER",
    "CLEAR",
    "DEFAULT_BUDGET",
    "DEQUEUED",
    "DEQUEUE_PATH",
    "EPOCH_HEADER",
    "FENCED",
    "FROM_HEADER",
    "HEALTH_PATH",
    "MAKE_WAY_PATH",
    "NOT_AFTER_HEADER",
    "OUTCOME_PATH",
    "QUEUE_HEADER",
    "REFUSED",
    "REQUEST_HEADER",
    "THROUGH_HEADER",
    "TOKEN_ENV",
    "TOKEN_HEADER",
    "TOKEN_REFUSED",
    "UNKNOWN",
    "CoordinatorServer",
    "Outcome",
    "decode_entries",
    "encode_entries",
    "parse_coordinator_urls",
    "token_from_env",
]

logger = logging.getLogger(__name__)

APPEND_PATH = "/v1/append"
OUTCOME_PATH = "/v1/outcome"
HEALTH_PATH = "/v1/health"
QUEUE_HEADER = "X-Millpond-Queue"
DEQUEUE_PATH = "/v1/dequeue"
EPOCH_HEADER = "X-Millpond-Epoch"
"""A dequeue's consumer epoch."""
THROUGH_HEADER = "X-Millpond-Through"
"""A dequeue removes every entry with ``sequence <= through``."""
MAKE_WAY_PATH = "/v1/make-way"
REQUEST_HEADER = "X-Millpond-Request"
AFTER_HEADER = "X-Millpond-After"
"""The id of the client's earlier request, still out, that this one's entries must follow."""
BUDGET_HEADER = "X-Millpond-Budget"
FROM_HEADER = "X-Millpond-From"
NOT_AFTER_HEADER = "X-Millpond-Not-After"
"""The writer's own deadline as a wall-clock time (ms since the Unix epoch): no write containing
the request is sent after it, on the coordinator's clock, whenever the request arrives."""
TOKEN_HEADER = "X-Millpond-Token"
"""The secret a coordinator started with a token wants on every request: a producer-hosted one
(``millpond.producer._host_coordinator``, a random token), and ``millpond coordinator`` when
:data:`TOKEN_ENV` is set."""
TOKEN_ENV = "MILLPOND_COORDINATOR_TOKEN"
"""The environment variable holding ``millpond coordinator``'s token: the service requires it
on every request when set, and producers, the Spark driver and consumers send it to the
coordinators they are given. Whoever reaches a coordinator without one can append to the queue
and dequeue from it (a dequeue needs only the epoch, a small number), so a coordinator on any
address but loopback refuses to start without it."""
TOKEN_REFUSED = f"did not take our token ({TOKEN_ENV} must hold the one it was started with)"
"""What a client says of a coordinator that answered 403 to its request."""
_MAX_BODY = 64 << 20
_OUTCOME_WAIT = 10.0  # seconds an outcome query waits for a round under way
_IDLE_TIMEOUT = 120.0  # seconds a keep-alive connection may sit idle
_MAKE_WAY_WAIT = 5.0  # seconds a make-way waits for the round under way to end


APPENDED = "appended"
"""Every entry is in the queue; ``Outcome.sequences`` says where."""
UNKNOWN = "unknown"
"""Some entries may have landed: ``sequences`` holds what is known, ``maybe_landed_from`` where
the rest may be. No write containing them is sent after the reply."""
REFUSED = "refused"
"""Nothing of the request was written, and nothing of it will be."""
DEQUEUED = "dequeued"
"""(a dequeue) Every entry through ``through`` is out of the manifest (removed now or before)."""
FENCED = "fenced"
"""(a dequeue) The manifest's epoch is not the request's: nothing was written for it."""
CLEAR = "clear"
"""(a make-way) The coordinator leaves the manifest alone from now for a moment."""

DEFAULT_BUDGET = 2.0
"""Seconds after a request arrives during which the coordinator may send writes containing it."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one request."""

    status: str
    """:data:`APPENDED`, :data:`UNKNOWN` or :data:`REFUSED`."""
    sequences: tuple[int | None, ...] = ()
    """Per entry, its sequence when known to be in the queue."""
    next_sequence: int | None = None
    """The manifest's ``next_sequence`` after the round (a lower bound for later appends)."""
    maybe_landed_from: int | None = None
    """With :data:`UNKNOWN`: the lowest sequence an attempt could have landed at."""
    reason: str = ""

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Outcome:
        """Parse a reply.

        Raises:
            FormatError: not an outcome.
        """
        try:
            record = json.loads(data)
            status = _status(record["status"])
            sequences = tuple(None if s is None else int(s) for s in record.get("sequences", ()))
            return cls(
                status=status,
                sequences=sequences,
                next_sequence=_opt_int(record.get("next_sequence")),
                maybe_landed_from=_opt_int(record.get("maybe_landed_from")),
                reason=str(record.get("reason", "")),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise FormatError(f"coordinator reply: expected an outcome, found {err}") from err


def parse_coordinator_urls(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``http://host:port`` URLs from a string (comma-separated) or a sequence.

    Raises:
        ConfigError: a URL that is not ``http://host:port``.
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    urls: list[str] = []
    for item in items:
        url = str(item).strip().rstrip("/")
        if not url:
            continue
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None or parts.path:
            raise ConfigError(
                "coordinator", f"expected http://host:port (comma-separated), found {item!r}"
            )
        urls.append(url)
    return tuple(urls)


def token_from_env() -> str | None:
    """The token in :data:`TOKEN_ENV` (surrounding blanks dropped), or ``None`` when it is
    unset or blank.

    Raises:
        ConfigError: a token with a character that is not visible ASCII (it travels in an
            HTTP header).
    """
    token = os.environ.get(TOKEN_ENV, "").strip()
    if any(not "!" <= c <= "~" for c in token):
        raise ConfigError(TOKEN_ENV, "expected visible ASCII characters only (an HTTP header)")
    return token or None


def _status(value: Any) -> str:
    if value not in (APPENDED, UNKNOWN, REFUSED):
        raise ValueError(f"status {value!r}")
    return str(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def encode_entries(entries: Sequence[PendingEntry]) -> bytes:
    """A request body: the entries in the RFC manifest encoding (validated on both ends).

    Raises:
        InvalidInputError: an entry does not fit the wire format.
    """
    data, _ = append_entries(empty_manifest(), entries)
    return data


def decode_entries(data: bytes) -> list[PendingEntry]:
    """The entries of a request body.

    Raises:
        FormatError: not a manifest encoding.
    """
    manifest = decode_manifest(data, name="coordinator request")
    return [PendingEntry(e.location, e.metadata) for e in manifest.entries]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = _IDLE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _refused_unless_authorized(self) -> bool:
        """Whether the request was refused for want of the server's token (``403``; the
        connection is closed, since the body, if any, was not read)."""
        token = self.server.token
        sent = self.headers.get(TOKEN_HEADER, "")
        if token is None or hmac.compare_digest(sent.encode(), token.encode()):
            return False
        self.close_connection = True
        found = "another" if sent else "none"
        reason = f"expected the coordinator's token in {TOKEN_HEADER} ({TOKEN_ENV}), found {found}"
        self._reply(403, _refused(reason))
        return True

    def do_GET(self) -> None:
        if self._refused_unless_authorized():
            return
        if self.path != HEALTH_PATH:
            self._reply(404, {"status": REFUSED, "reason": f"no such path {self.path}"})
            return
        coordinator = self.server.coordinator
        self._reply(
            200,
            {
                "queue": coordinator.queue,
                "manifest_path": coordinator.manifest_path,
                "alive": coordinator.dead is None,
                **coordinator.stats(),
            },
        )

    def do_POST(self) -> None:
        if self._refused_unless_authorized():
            return
        declared = self.headers.get("Content-Length", "0") or "0"
        # isdigit() alone takes "²" (a latin-1 header byte), which int() refuses.
        length = int(declared) if declared.isascii() and declared.isdigit() else -1
        if not 0 <= length <= _MAX_BODY:
            # The body's end is unknown (or too far): nothing more is read from the connection.
            reason = f"expected a Content-Length from 0 to {_MAX_BODY} bytes, found {declared!r}"
            self._reply(400, _refused(reason))
            self.close_connection = True
            return
        body = self.rfile.read(length) if length else b""
        coordinator = self.server.coordinator
        if self.path == DEQUEUE_PATH:
            self._dequeue()
            return
        if self.path == MAKE_WAY_PATH:
            self._make_way()
            return
        request_id = self.headers.get(REQUEST_HEADER, "")
        if not request_id:
            self._reply(400, _refused(f"expected a {REQUEST_HEADER} header, found none"))
            return
        if self.path == OUTCOME_PATH:
            outcome = coordinator.outcome(request_id, _OUTCOME_WAIT)
            self._answer(outcome)
            return
        if self.path != APPEND_PATH:
            self._reply(404, _refused(f"no such path {self.path}"))
            return
        if self._other_queue():
            return
        try:
            budget = _budget(self.headers.get(BUDGET_HEADER))
            lower = int(self.headers.get(FROM_HEADER, "0"))
            not_after = self.headers.get(NOT_AFTER_HEADER)
            entries = decode_entries(body)
            ticket = coordinator.submit(
                request_id,
                entries,
                budget,
                lower,
                not_after_ms=int(not_after) if not_after is not None else None,
                after=self.headers.get(AFTER_HEADER),
            )
        except (ValueError, FormatError, InvalidInputError) as err:
            self._reply(400, _refused(str(err)))
            return
        while not ticket.done.wait(0.5):
            if coordinator.dead is not None:
                break
        if ticket.outcome is None:
            # The rounds died with this request in one: no reply, as from a crashed process.
            self.close_connection = True
            return
        self._answer(ticket.outcome)

    def _other_queue(self) -> bool:
        """Refuse a request naming another queue than the one served (then ``True``)."""
        coordinator = self.server.coordinator
        queue = self.headers.get(QUEUE_HEADER, "")
        if queue == coordinator.queue:
            return False
        self._reply(409, _refused(f"this coordinator serves {coordinator.queue!r}, not {queue!r}"))
        return True

    def _make_way(self) -> None:
        if self._other_queue():
            return
        if self.server.coordinator.make_way(_MAKE_WAY_WAIT):
            self._reply(200, {"status": CLEAR})
        else:
            self._reply(503, _refused(f"the round under way did not end in {_MAKE_WAY_WAIT:g} s"))

    def _dequeue(self) -> None:
        coordinator = self.server.coordinator
        if self._other_queue():
            return
        try:
            epoch = int(self.headers.get(EPOCH_HEADER, ""))
            through = int(self.headers.get(THROUGH_HEADER, ""))
        except ValueError:
            self._reply(400, _refused(f"expected integer {EPOCH_HEADER} and {THROUGH_HEADER}"))
            return
        ticket = coordinator.dequeue(epoch, through)
        while not ticket.done.wait(0.5):
            if coordinator.dead is not None:
                self._reply(503, _refused("the coordinator's rounds stopped"))
                return
        code = {DEQUEUED: 200, FENCED: 409}.get(ticket.status, 503)
        self._reply(code, {"status": ticket.status, "reason": ticket.reason})

    def _answer(self, outcome: Outcome | None) -> None:
        if outcome is None:
            self.close_connection = True  # still running after the wait: the client asks again
            return
        code = 503 if outcome.status == REFUSED else 200
        self._send(code, outcome.to_json())

    def _reply(self, code: int, record: dict[str, Any]) -> None:
        self._send(code, json.dumps(record, separators=(",", ":")).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _budget(value: str | None) -> float:
    """A request's budget header in seconds (``DEFAULT_BUDGET`` when absent).

    Raises:
        ValueError: not a number, or NaN: every comparison with NaN is false, so it would be
            a deadline that never comes.
    """
    if value is None:
        return DEFAULT_BUDGET
    try:
        budget = float(value)
    except ValueError:
        budget = math.nan
    if math.isnan(budget):
        raise ValueError(f"{BUDGET_HEADER}: expected a number of seconds, found {value!r}")
    return budget


def _refused(reason: str) -> dict[str, Any]:
    return {"status": REFUSED, "reason": reason}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Many producers connect at once (a Spark job's tasks starting, a fleet restarting) while
    # the accepting thread may be held up. The socketserver default of 5 drops the others'
    # handshakes, which are retried only after a second: by then each producer has called the
    # coordinator unreachable and appends directly for a while, contending with the rounds.
    request_queue_size = socket.SOMAXCONN
    coordinator: AppendCoordinator
    token: str | None = None


class _Server6(_Server):
    address_family = socket.AF_INET6


class CoordinatorServer:
    """An :class:`AppendCoordinator` served over HTTP on ``host:port`` (0: a free port);
    with a ``token``, every request without it in ``X-Millpond-Token`` is refused (``403``).
    ``host`` may be an IPv6 address (``::1``; the URL then brackets it)."""

    def __init__(
        self,
        coordinator: AppendCoordinator,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
    ):
        self.coordinator = coordinator
        server = _Server6 if ":" in host else _Server
        self._server = server((host, port), _Handler)
        self._server.coordinator = coordinator
        self._server.token = token
        self._thread: threading.Thread | None = None
        self._serving = False
        """Whether a serving loop was started: only one can answer a shutdown request, which
        otherwise waits for it for ever."""

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        text = host.decode() if isinstance(host, bytes) else str(host)
        if ":" in text:  # IPv6
            text = f"[{text}]"
        return f"http://{text}:{self.port}"

    def start(self) -> CoordinatorServer:
        """Start the rounds and serve requests on a daemon thread; returns ``self``."""
        self.coordinator.start()
        self._serving = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},  # close() and crash tests wait at most this
            name="millpond-coordinator-http",
            daemon=True,
        )
        self._thread.start()
        logger.info("coordinator of %s serving on %s", self.coordinator.queue, self.url)
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread until :meth:`close` (from another thread or a signal)."""
        self.coordinator.start()
        logger.info("coordinator of %s serving on %s", self.coordinator.queue, self.url)
        self._serving = True
        self._server.serve_forever(poll_interval=0.1)

    def close_listener(self) -> None:
        """Stop accepting connections at once (requests on open connections still get their
        outcomes); :meth:`close` stops the rounds too."""
        self._stop_serving(5.0)
        self._server.server_close()

    def close_inherited(self) -> None:
        """In a child forked from the serving process: close this process's copy of the
        listening socket (nothing serves here; the parent serves on), so that once the parent
        is gone its port refuses connections instead of queueing them for nobody."""
        self._server.socket.close()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop: refuse what has not started, finish the round under way, close the socket."""
        self.coordinator.stop(timeout)
        self._stop_serving(timeout)
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)

    def _stop_serving(self, timeout: float | None) -> None:
        if not self._serving:  # never served: nothing would answer the shutdown request
            return
        stopper = threading.Thread(target=self._server.shutdown, daemon=True)
        stopper.start()
        stopper.join(timeout)

    def __enter__(self) -> CoordinatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
