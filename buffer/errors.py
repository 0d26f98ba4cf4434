"""The millpond error tree, grouped by what the caller should do.

- retry: ``ConflictError`` (a CAS was lost), ``StorageError`` (transient store failure),
  ``BackpressureError`` (the buffer stayed full past the timeout);
- stop: ``FencedError`` (another consumer took over), ``ClosedError``;
- fix the input or the data: ``FormatError``, ``InvalidInputError``, ``ConfigError``,
  ``NotFoundError``; of these, ``BadBatchError`` (``CorruptBatchError``,
  ``BatchNotFoundError``) is one batch of the queue that cannot be used, and nothing else:
  what a consumer may set aside, unlike an error of the manifest itself;
- fix the store's set-up: ``StoreAccessError`` (missing or rejected credentials, a missing
  bucket, no permission, conditional writes that do not work). Retrying cannot help, so
  nothing retries it: it reaches the caller within seconds;
- look at the consumer: ``SinkWaitError`` (what a producer waited for is not known to be in
  the consumer's database: set aside, or — ``SinkWaitTimeoutError`` — not written in time).

``CommitStateUnknownError`` separates "the write did not land" from "we cannot tell whether it
landed": only the first lets a caller throw away what it uploaded.
"""

from __future__ import annotations

__all__ = [
    "BackpressureError",
    "BadBatchError",
    "BatchNotFoundError",
    "ClosedError",
    "CommitStateUnknownError",
    "ConfigError",
    "ConflictError",
    "CorruptBatchError",
    "FencedError",
    "FormatError",
    "InvalidInputError",
    "MillpondError",
    "NotFoundError",
    "SinkWaitError",
    "SinkWaitTimeoutError",
    "StorageError",
    "StoreAccessError",
]


class MillpondError(Exception):
    """Root of every error millpond raises on purpose."""


class ConflictError(MillpondError):
    """A compare-and-swap lost against a concurrent writer; re-read and retry."""


class FencedError(MillpondError):
    """The manifest epoch moved past this consumer's: another consumer took over. Stop."""

    def __init__(self, message: str, *, expected_epoch: int, found_epoch: int) -> None:
        super().__init__(message)
        self.expected_epoch = expected_epoch
        self.found_epoch = found_epoch

    @property
    def replaced(self) -> bool:
        """The epoch went back instead: nobody took over, the manifest was replaced (deleted
        and created again, or restored from an older copy). Epochs only grow."""
        return self.found_epoch < self.expected_epoch


class FormatError(MillpondError):
    """Corrupt, truncated or unsupported bytes. Names the object, field and byte offset."""

    def __init__(
        self, message: str, *, field: str | None = None, offset: int | None = None
    ) -> None:
        super().__init__(message)
        self.field = field
        self.offset = offset


class StorageError(MillpondError):
    """A transient object-store failure (network, throttling, 5xx); safe to retry."""


class CommitStateUnknownError(StorageError):
    """A write failed in a way that leaves unknown whether it landed (for example a timeout).

    A queue append that gives up this way says what it does know: ``sequences`` has, per entry,
    the sequence of an entry known to be in the queue (``None`` where unknown), and
    ``maybe_landed_from`` is the lowest sequence an attempt could have landed at.
    """

    def __init__(
        self,
        message: str,
        *,
        sequences: tuple[int | None, ...] | None = None,
        maybe_landed_from: int | None = None,
    ) -> None:
        super().__init__(message)
        self.sequences = sequences
        self.maybe_landed_from = maybe_landed_from


class StoreAccessError(MillpondError):
    """The store refuses for good: fix its set-up. Retrying does not help.

    ``problem`` says which part: ``"credentials"`` (none found, or rejected),
    ``"bucket"`` (the bucket or container does not exist), ``"permission"`` (the credentials
    may not do this), ``"conditional_writes"`` (the store does not reject a stale
    conditional write). ``message`` says what is wrong and ``hint`` how to fix it (``str()`` of
    the error is both, joined by ``; ``: print one or the other beside it, never both). Neither
    ever holds a secret.
    """

    def __init__(self, message: str, *, problem: str, hint: str = "") -> None:
        super().__init__(f"{message}; {hint}" if hint else message)
        self.message = message
        self.problem = problem
        self.hint = hint


class NotFoundError(MillpondError, FileNotFoundError):
    """The object does not exist. Also a ``FileNotFoundError`` so plain ``except`` clauses work."""


class BadBatchError(MillpondError):
    """One batch of the queue cannot be used: its object is missing or corrupt, or its
    location is not a batch object's. ``sequence`` and ``location`` name it.

    Only that batch is at fault: the manifest was read and checked. An error of the manifest
    itself (missing, corrupt, answering 404 for a moment) is never one of these, so a consumer
    that sets bad batches aside never sets aside a good batch for it.
    """

    sequence: int
    location: str


class CorruptBatchError(FormatError, BadBatchError):
    """A batch object's bytes cannot be decoded, or its location is not
    ``{data_path_prefix}/{ULID}.batch``."""

    def __init__(
        self,
        message: str,
        *,
        sequence: int,
        location: str,
        field: str | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message, field=field, offset=offset)
        self.sequence = sequence
        self.location = location


class BatchNotFoundError(NotFoundError, BadBatchError):
    """A batch object the manifest names does not exist."""

    def __init__(self, message: str, *, sequence: int, location: str) -> None:
        super().__init__(message)
        self.sequence = sequence
        self.location = location


class BackpressureError(MillpondError):
    """The producer's buffer or WAL stayed full past the caller's timeout."""


class ClosedError(MillpondError):
    """The producer, consumer or collector was already closed."""


class InvalidInputError(MillpondError, ValueError):
    """An argument that can never succeed (empty entry list, out-of-order ack, ...)."""


class ProgressBehindError(InvalidInputError):
    """A consumer's ``last_acked_sequence`` is below the queue's first entry minus one: entries
    were dequeued that the sink has not recorded.

    Progress read before the takeover can trail an older consumer that was still writing and
    dequeuing; the takeover has fenced it, so read again the progress holds every entry it
    dequeued (``millpond.consumer.takeover.take_over`` does that). Read after the takeover, the
    entries were dequeued without this sink.
    """

    def __init__(self, message: str, *, found: int, first: int) -> None:
        super().__init__(message)
        self.found = found
        """The ``last_acked_sequence`` given."""
        self.first = first
        """The queue's first entry."""


class ConfigError(MillpondError, ValueError):
    """A bad configuration value. ``key`` names the offending setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class SinkWaitError(MillpondError):
    """Rows a producer waited for (``WriteHandle.wait_written``, the Spark ``await_sink``
    option) are not known to be in the consumer's database.

    Raised as is when the consumer moved past them without writing them (``reason``
    ``"set_aside"``: quarantined batches, named in ``set_aside``); as
    :class:`SinkWaitTimeoutError` when the time ran out. The entries are in the queue either
    way: enqueuing them again would double them.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        waiting_for: int | None,
        written_through: int | None = None,
        stopped_on: int | None = None,
        set_aside: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.reason = reason
        """``set_aside``; for a timeout ``not_durable`` (not in the queue yet), ``no_consumer``
        (none ever published what it wrote), ``not_running`` (stopped, or silent past its
        promise), ``stopped_on_batch`` (stopped on ``stopped_on``) or ``behind``."""
        self.waiting_for = waiting_for
        """The highest sequence waited for (``None``: not in the queue yet)."""
        self.written_through = written_through
        """The highest sequence the consumer said it had written (``None``: none)."""
        self.stopped_on = stopped_on
        """The sequence a consumer stopped on a batch is stopped on."""
        self.set_aside = set_aside
        """Sequences waited for that the consumer set aside instead of writing."""

    @property
    def behind(self) -> int | None:
        """Entries between what the consumer wrote and what was waited for."""
        if self.waiting_for is None:
            return None
        return self.waiting_for - (-1 if self.written_through is None else self.written_through)


class SinkWaitTimeoutError(SinkWaitError, TimeoutError):
    """The consumer had not written the rows waited for when the time ran out; the message
    names its state (not running, behind by N, stopped on sequence S and why). The entries
    stay in the queue and are written once the consumer gets to them."""
