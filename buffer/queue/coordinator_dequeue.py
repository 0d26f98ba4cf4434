"""Dequeues a consumer sends through the append coordinator (``POST /v1/dequeue``), and the
pause it asks for before its takeover (``POST /v1/make-way``).

A coordinator appending back to back wins every race against a writer that must read first:
a consumer dequeuing on its own waits for one of the coordinator's pauses, and each of its
dequeues puts the coordinator into pausing every few rounds (:mod:`millpond.queue.coordinator`,
Fencing), which holds up every producer's requests. At 50 ms a request and 16 producers that
took the producers' ``wait()`` p99 from about 3.3x to about 3.9x a lone producer's p50. A
consumer that sends its dequeues to the coordinator instead has them written between two
rounds, on the manifest the coordinator last wrote: one write, no race, no pause.

Safe whatever happens to a request. A dequeue is idempotent (removing the entries through
``through`` a second time removes nothing), so a consumer whose request was lost, refused or
not answered in time simply dequeues directly. The epoch decides as it does for the consumer's
own write: entries are removed only from a manifest whose epoch is the requesting consumer's,
in a write conditional on those very bytes, so a consumer fenced meanwhile (a newer
``initialize()`` landed) gets ``fenced`` and nothing is written for it. So ``dequeued`` proves
what the consumer's own dequeue proves — that it held the epoch during the call: it is said
only after such a write landed, or after a read made for the request (never the cached bytes
alone) found the epoch and nothing left to remove.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from millpond.errors import MillpondError
from millpond.formats.manifest import decode_footer, remove_through
from millpond.queue.append import QueueProducer
from millpond.queue.coordinator_http import (
    CLEAR,
    DEQUEUE_PATH,
    DEQUEUED,
    EPOCH_HEADER,
    FENCED,
    MAKE_WAY_PATH,
    QUEUE_HEADER,
    REFUSED,
    THROUGH_HEADER,
    TOKEN_HEADER,
    TOKEN_REFUSED,
)

__all__ = [
    "CLEAR",
    "DEQUEUED",
    "FENCED",
    "FORBIDDEN",
    "LOST",
    "REFUSED",
    "DequeueTicket",
    "send_dequeue",
    "send_make_way",
    "write_dequeues",
]

LOST = "lost"
"""(client side) no usable reply: the coordinator could not be reached or did not answer."""
FORBIDDEN = "forbidden"
"""(client side) the coordinator wants a token this request did not carry (HTTP 403): a
setting to fix (:data:`~millpond.queue.coordinator_http.TOKEN_ENV`), not a moment to wait out."""


@dataclass(slots=True)
class DequeueTicket:
    """One dequeue request, from arrival to its answer."""

    epoch: int
    through: int
    done: threading.Event = field(default_factory=threading.Event)
    status: str = ""
    """:data:`DEQUEUED`, :data:`FENCED` or :data:`REFUSED` once ``done`` is set."""
    reason: str = ""

    def answer(self, status: str, reason: str = "") -> None:
        self.status, self.reason = status, reason
        self.done.set()


def write_dequeues(
    queue: QueueProducer,
    tickets: Sequence[DequeueTicket],
    *,
    deadline: float | None,
) -> None:
    """Remove what ``tickets`` ask for in at most one write, then answer each.

    Only the tickets holding the manifest's epoch count; the highest ``through`` among them is
    removed. Any failure of the store answers every ticket ``refused`` (their consumers
    dequeue directly; a write that landed anyway makes theirs a no-op).
    """
    seen: dict[str, int] = {}

    def change(data: bytes) -> bytes | None:
        footer = decode_footer(data, name=queue.path)
        seen["epoch"], seen["next"] = footer.epoch, footer.next_sequence
        through = max(
            (t.through for t in tickets if t.epoch == footer.epoch and t.through < seen["next"]),
            default=None,
        )
        if through is None:
            return None
        out, removed = remove_through(data, through)
        return out if removed else None

    try:
        queue.rewrite(change, deadline=deadline)
    except MillpondError as err:
        for ticket in tickets:
            ticket.answer(REFUSED, f"the dequeue was not written: {err}")
        return
    for ticket in tickets:
        if ticket.epoch != seen["epoch"]:
            ticket.answer(
                FENCED,
                f"{queue.path} has epoch {seen['epoch']}, the consumer holds {ticket.epoch}",
            )
        elif ticket.through >= seen["next"]:
            ticket.answer(
                REFUSED, f"through {ticket.through} is not below next_sequence {seen['next']}"
            )
        else:
            ticket.answer(DEQUEUED)


def send_dequeue(
    url: str, queue: str, epoch: int, through: int, *, timeout: float, token: str | None = None
) -> tuple[str, str]:
    """Ask the coordinator at ``url`` to dequeue through ``through`` for the consumer holding
    ``epoch`` of ``queue`` (its identity): ``(status, reason)``, the status one of
    :data:`DEQUEUED`, :data:`FENCED`, :data:`REFUSED`, :data:`FORBIDDEN` or :data:`LOST`. A
    fresh connection each
    time (a consumer dequeues about once a second at most); never raises. ``token``: the
    coordinator's (:data:`~millpond.queue.coordinator_http.TOKEN_ENV`), if it wants one."""
    headers = {EPOCH_HEADER: str(epoch), THROUGH_HEADER: str(through)}
    return _post(url, DEQUEUE_PATH, queue, headers, timeout, token)


def send_make_way(
    url: str, queue: str, *, timeout: float, token: str | None = None
) -> tuple[str, str]:
    """Ask the coordinator at ``url`` to leave the manifest of ``queue`` alone for a moment
    (a consumer's takeover comes next): ``(status, reason)``, the status :data:`CLEAR` once
    that moment has begun, else :data:`REFUSED`, :data:`FORBIDDEN` or :data:`LOST`. Never
    raises."""
    return _post(url, MAKE_WAY_PATH, queue, {}, timeout, token)


def _post(
    url: str, path: str, queue: str, headers: dict[str, str], timeout: float, token: str | None
) -> tuple[str, str]:
    """One bodiless request on a fresh connection: the reply's ``(status, reason)``."""
    if token is not None:
        headers = {**headers, TOKEN_HEADER: token}
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("POST", path, b"", {QUEUE_HEADER: queue, **headers, "Content-Length": "0"})
        response = conn.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException) as err:
        return LOST, f"no answer from {url}: {err}"
    finally:
        conn.close()
    if response.status == 403:
        return FORBIDDEN, TOKEN_REFUSED
    try:
        record = json.loads(data)
        return str(record["status"]), str(record.get("reason", ""))
    except (ValueError, KeyError, TypeError):
        return LOST, f"{url} answered HTTP {response.status}, not as a coordinator: {data[:200]!r}"
