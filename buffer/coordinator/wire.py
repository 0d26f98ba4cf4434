"""The append coordinator's HTTP wire format: paths, headers, outcomes and the entries'
encoding, shared by the server (:mod:`millpond.coordinator.server`) and its clients
(:mod:`millpond.coordinator.client`). No server, no client.

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
  (:mod:`millpond.coordinator.rounds`). The reply, as JSON: 200 ``dequeued``, 409
  ``fenced``, 503 ``refused``, 400 for a request that cannot be served.
* ``POST /v1/make-way`` — header ``X-Millpond-Queue``: a consumer about to take over asks the
  coordinator to leave the manifest alone for a moment (its epoch bump is a read, then a
  write). The reply comes once that moment has begun: 200 ``clear``; 503 ``refused`` when it
  did not begin in time.
* ``GET /v1/health`` — the queue served and counters, as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from millpond.errors import ConfigError, FormatError
from millpond.formats.manifest import PendingEntry, append_entries, decode_manifest, empty_manifest

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
    "Outcome",
    "decode_entries",
    "encode_entries",
    "parse_coordinator_urls",
    "token_from_env",
]

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
(:mod:`millpond.coordinator.hosted`, a random token), and ``millpond coordinator`` when
:data:`TOKEN_ENV` is set."""
TOKEN_ENV = "MILLPOND_COORDINATOR_TOKEN"
"""The environment variable holding ``millpond coordinator``'s token: the service requires it
on every request when set, and producers, the Spark driver and consumers send it to the
coordinators they are given. Whoever reaches a coordinator without one can append to the queue
and dequeue from it (a dequeue needs only the epoch, a small number), so a coordinator on any
address but loopback refuses to start without it."""
TOKEN_REFUSED = f"did not take our token ({TOKEN_ENV} must hold the one it was started with)"
"""What a client says of a coordinator that answered 403 to its request."""


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
            return cls(
                status=_status(record["status"]),
                sequences=tuple(_opt_int(s) for s in record.get("sequences", ())),
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
