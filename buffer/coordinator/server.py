"""``millpond coordinator`` over HTTP: a small threaded server for an
:class:`~millpond.coordinator.rounds.AppendCoordinator`, speaking :mod:`millpond.coordinator.wire`.

The server binds 127.0.0.1 unless told otherwise. It holds no state a restart would lose
except outcomes of requests already answered (see :mod:`millpond.coordinator.rounds`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from millpond.common.tasks import BackgroundTask
from millpond.coordinator.rounds import AppendCoordinator
from millpond.coordinator.wire import (
    AFTER_HEADER,
    APPEND_PATH,
    BUDGET_HEADER,
    CLEAR,
    DEFAULT_BUDGET,
    DEQUEUE_PATH,
    DEQUEUED,
    EPOCH_HEADER,
    FENCED,
    FROM_HEADER,
    HEALTH_PATH,
    MAKE_WAY_PATH,
    NOT_AFTER_HEADER,
    OUTCOME_PATH,
    QUEUE_HEADER,
    REFUSED,
    REQUEST_HEADER,
    THROUGH_HEADER,
    TOKEN_ENV,
    TOKEN_HEADER,
    Outcome,
    decode_entries,
)
from millpond.errors import FormatError, InvalidInputError

__all__ = ["CoordinatorServer"]

logger = logging.getLogger(__name__)

_MAX_BODY = 64 << 20
_OUTCOME_WAIT = 10.0  # seconds an outcome query waits for a round under way
_IDLE_TIMEOUT = 120.0  # seconds a keep-alive connection may sit idle
_MAKE_WAY_WAIT = 5.0  # seconds a make-way waits for the round under way to end


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
            self._reply(404, _refused(f"no such path {self.path}"))
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
            self._answer(coordinator.outcome(request_id, _OUTCOME_WAIT))
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
        # None when the rounds died with this request in one: no reply, as from a crashed process.
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
    with contextlib.suppress(ValueError):
        budget = float(value)
        if not math.isnan(budget):
            return budget
    raise ValueError(f"{BUDGET_HEADER}: expected a number of seconds, found {value!r}")


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
        self._task = BackgroundTask(  # close() and crash tests wait at most its poll_interval
            "millpond-coordinator-http", lambda: self._server.serve_forever(poll_interval=0.02)
        )
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
        self._task.start()
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
        self._task.join(timeout)

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
