"""The RFC's queue consumer: reads and dequeues the manifest under epoch fencing."""

from __future__ import annotations

import logging

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.errors import (
    CommitStateUnknownError,
    ConflictError,
    FencedError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
    StorageError,
)
from millpond.formats.manifest import (
    FOOTER_SIZE,
    ManifestView,
    decode_footer,
    decode_tail,
    empty_manifest,
    remove_through,
    view_manifest,
    with_epoch,
)
from millpond.queue.cas import CasLoop, ManifestSnapshot, RawManifest
from millpond.queue.epoch_mark import is_replaced
from millpond.storage.store import ObjectStore

__all__ = ["QueueConsumer"]

logger = logging.getLogger(__name__)


class QueueConsumer:
    """Reads and dequeues the manifest under epoch fencing (the RFC's queue consumer)."""

    def __init__(
        self,
        store: ObjectStore,
        manifest_path: str = "ingest/manifest",
        *,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
        counters: Counters | None = None,
    ) -> None:
        self._cas = CasLoop(store, manifest_path, retry=retry, clock=clock, counters=counters)
        self._epoch: int | None = None
        self._last_etag: str | None = None  # of the last read, for a conditional one
        # The ETag of the newest manifest state seen to carry this consumer's epoch: a
        # conditional request against it answers "still ours" with a 304.
        self._fence_etag: str | None = None
        # The manifest's bytes as this consumer last read or wrote them: a conditional write
        # can start from them instead of reading again (it fails if they are stale, and only
        # then is the manifest read). Only trusted while their ETag is the newest seen.
        self._raw: RawManifest | None = None
        self._confirmations = 0

    @property
    def epoch(self) -> int | None:
        """The epoch this consumer holds, or ``None`` before ``initialize()``."""
        return self._epoch

    @property
    def counters(self) -> Counters:
        return self._cas.counters

    @property
    def confirmations(self) -> int:
        """How many times a request found the manifest still this consumer's (a read that
        found its epoch, a 304, a conditional write that landed): a caller that sees it grow
        during a call knows the epoch was checked in that call, even if the call failed."""
        return self._confirmations

    def peek(self) -> tuple[int, int]:
        """The manifest's ``next_sequence`` and epoch (0 and 0 when there is none), without
        any epoch check.

        What it read is where the next :meth:`initialize` starts its compare-and-swap.

        Raises:
            FormatError: the manifest's footer is corrupt.
            StorageError: the store failed.
        """
        current = self._cas.read()
        self._raw = current
        if current is None:
            return 0, 0
        # Checked whole, one entry at a time: a corrupt manifest is refused before its epoch is
        # bumped, and a long one is never held decoded.
        manifest = view_manifest(current.data, name=self._cas.path)
        for _entry in manifest.entries_from(0):
            pass
        return manifest.next_sequence, manifest.epoch

    def initialize(self) -> int:
        """Increment the manifest epoch (creating an empty manifest if none exists).

        An ambiguous write is never taken as ours: another consumer may have written the same
        epoch. Bumping again is harmless, so the loop simply bumps past whatever it reads —
        unless this consumer held an epoch before: then it bumps only a manifest that still
        carries it (every write is conditional on what was read), and one that lost the queue
        raises ``FencedError`` instead of fencing the consumer that took it over.
        Right after :meth:`peek`, the first attempt writes over what it read
        (conditional on its ETag, so only if nothing changed since) instead of reading again.

        Returns:
            The new epoch, which this consumer now holds.

        Raises:
            FormatError: the stored manifest is corrupt.
            FencedError: this consumer held an epoch before, and the manifest carries
                another now.
            StorageError: the retry budget ran out.
        """
        cas = self._cas
        backoff = cas.retry.start(cas.clock)
        known, self._raw = self._raw, None
        while True:
            try:
                current = known if known is not None else cas.read()
                base = current.data if current is not None else empty_manifest()
                found = decode_footer(base, name=cas.path).epoch
                if self._epoch is not None:
                    self._check_epoch(found)  # lost the queue: never take it back
                epoch = found + 1
                data = with_epoch(base, epoch)
                etag = cas.write(current, data)
            except ConflictError as err:
                # Someone else's write landed: read and bump again at once. A coordinator
                # appending back to back leaves the manifest alone only for a moment now and
                # then; a consumer that slept after each lost race would rarely be reading then.
                cas.backoff(backoff, "epoch bump", err, at_once=True)
                known = None
                continue
            except StorageError as err:
                known = None
                cas.backoff(backoff, "epoch bump", err)
                continue
            self._epoch = epoch
            self._last_etag = None
            self._fence_etag = etag
            self._raw = RawManifest(data, etag)
            logger.info("consumer holds epoch %s of %s", epoch, cas.path)
            return epoch

    def check_fence(self) -> None:
        """Raise ``FencedError`` if another consumer has initialized since; one request.

        A conditional GET of the manifest's last 22 bytes (its footer): a 304 when nothing
        changed since this consumer last saw its own epoch there, else the footer alone.

        Raises:
            FencedError: another consumer initialized after this one.
            FormatError: the manifest's footer is corrupt.
            NotFoundError: the manifest is gone.
            StorageError: the store failed.
        """
        if self._epoch is None:
            raise MillpondError("consumer is not initialized: call initialize() first")
        got = self._cas.store.get_tail(self._cas.path, FOOTER_SIZE, self._fence_etag)
        self._cas.counters.add("fence_checks")
        if got is None:
            self._confirmations += 1
            return
        self._check_epoch(decode_tail(got.data, name=self._cas.path).epoch)
        self._fence_etag = got.etag
        self._confirmations += 1

    def read(self, *, reuse: bool = False) -> ManifestSnapshot:
        """Read and decode the manifest, checking the epoch (:meth:`read_view`, every entry
        decoded).

        Raises:
            FencedError, FormatError, NotFoundError, StorageError: as :meth:`read_view`.
        """
        return self._snapshot(self.read_view(reuse=reuse))

    def read_view(self, *, reuse: bool = False) -> ManifestView:
        """Read the manifest and check it and its epoch; its entries are decoded as they are
        taken (a long backlog is never held decoded).

        Args:
            reuse: use the bytes this consumer last read or wrote (its epoch bump, a
                dequeue) instead of reading, when nothing newer was seen since: a state of
                the manifest that carried this consumer's epoch, possibly missing appends
                made since (the next :meth:`read_if_changed` finds them). It proves nothing
                about the epoch now.

        Raises:
            FencedError: another consumer initialized after this one.
            FormatError: the manifest is corrupt.
            NotFoundError: the manifest is gone.
            StorageError: the store failed.
        """
        known = self._raw
        if reuse and known is not None and known.etag == self._fence_etag:
            return self._accept(known.data, known.etag)
        got = self._cas.store.get(self._cas.path)
        self._cas.counters.add("manifest_reads")
        return self._accept(got.data, got.etag)

    def read_if_changed(self) -> ManifestSnapshot | None:
        """Like :meth:`read`, but ``None`` when the manifest is unchanged since the last read.

        Raises:
            FencedError, FormatError, NotFoundError, StorageError: as :meth:`read`.
        """
        view = self.read_view_if_changed()
        return None if view is None else self._snapshot(view)

    def read_view_if_changed(self) -> ManifestView | None:
        """Like :meth:`read_view`, but ``None`` when the manifest is unchanged since the last
        read.

        An unchanged manifest carries the epoch that was checked when it was read, so the
        conditional GET keeps the fencing guarantee.

        Raises:
            FencedError, FormatError, NotFoundError, StorageError: as :meth:`read_view`.
        """
        got = self._cas.store.get_if_changed(self._cas.path, self._last_etag)
        self._cas.counters.add("manifest_reads")
        if got is None:
            return None
        return self._accept(got.data, got.etag)

    def dequeue(self, through: int) -> int:
        """Remove every entry with ``sequence <= through``; returns how many went.

        Writes nothing when nothing would be removed. Returning at all proves this consumer
        still held the epoch during the call: its last read found the epoch, or its write,
        conditional on bytes that carried the epoch, landed.

        Raises:
            InvalidInputError: ``through`` is not below ``next_sequence``.
            FencedError: another consumer initialized after this one.
            FormatError: the manifest is corrupt.
            StorageError: the retry budget ran out.
        """
        cas = self._cas
        backoff = cas.retry.start(cas.clock)
        removed_before = 0
        # The bytes this consumer last read or wrote, while nothing newer was seen: the write
        # below is conditional on their ETag, so it lands only on that very manifest, which
        # carries this consumer's epoch; anything else fails it and the manifest is read.
        known = self._raw if self._raw is not None and self._raw.etag == self._fence_etag else None
        while True:
            try:
                current = known if known is not None else cas.read()
            except StorageError as err:
                cas.backoff(backoff, "manifest read", err)
                continue
            if current is None:
                raise NotFoundError(f"{cas.path}: manifest not found")
            next_sequence, data, removed = self._removal(current, through, read=known is None)
            if known is not None and removed == 0:
                # Only a write proves the known bytes current (and the epoch this
                # consumer's): an answer without one comes from a read.
                known = None
                continue
            if through >= next_sequence:
                raise InvalidInputError(
                    f"through: expected < next_sequence {next_sequence}, found {through}"
                )
            if removed == 0:
                return removed_before
            known = None  # whatever becomes of the write, a next attempt reads
            try:
                self._write_removal(current, data)
            except (CommitStateUnknownError, ConflictError) as err:
                # Our write may have landed (a retried request can fail its precondition on
                # our own write); if so the re-read finds nothing left to remove.
                removed_before = max(removed_before, removed)
                # A conflict is most likely someone else's write: read and try again at once
                # (as in initialize, a sleeping consumer would miss a coordinator's pauses).
                cas.backoff(backoff, "dequeue", err, at_once=isinstance(err, ConflictError))
                continue
            except StorageError as err:
                cas.backoff(backoff, "dequeue", err)
                continue
            return removed

    def _removal(self, current: RawManifest, through: int, *, read: bool) -> tuple[int, bytes, int]:
        """The manifest ``current`` without its entries through ``through``, once its epoch is
        checked (``read``: read in this call, a confirmation of the epoch).

        Returns:
            Its ``next_sequence``, the new bytes and how many entries they lack (``b""`` and 0
            when nothing is removed, or ``through`` is not below ``next_sequence``).

        Raises:
            FencedError: another consumer initialized after this one.
            FormatError: the manifest is corrupt.
        """
        footer = decode_footer(current.data, name=self._cas.path)
        self._check_epoch(footer.epoch)
        if read:
            self._confirmations += 1  # read in this call
        data, removed = b"", 0
        if through < footer.next_sequence:
            data, removed = remove_through(current.data, through)
        return footer.next_sequence, data, removed

    def _write_removal(self, current: RawManifest, data: bytes) -> None:
        """Write ``data`` conditional on ``current``'s ETag; once it landed, it carries this
        consumer's epoch and is the newest state seen.

        Raises:
            ConflictError, CommitStateUnknownError, StorageError: as ``CasLoop.write``.
        """
        etag = self._cas.write(current, data)
        self._fence_etag = etag
        self._raw = RawManifest(data, etag)
        self._confirmations += 1

    def _accept(self, data: bytes, etag: str | None) -> ManifestView:
        view = view_manifest(data, name=self._cas.path)
        self._check_epoch(view.epoch)
        self._last_etag = etag
        self._fence_etag = etag
        self._raw = RawManifest(data, etag)
        self._confirmations += 1
        return view

    def _snapshot(self, view: ManifestView) -> ManifestSnapshot:
        return ManifestSnapshot(view.decode(), self._last_etag, len(view.raw))

    def _check_epoch(self, found: int) -> None:
        if self._epoch is None:
            raise MillpondError("consumer is not initialized: call initialize() first")
        if is_replaced(self._epoch, found):
            raise FencedError(
                f"{self._cas.path}: fenced: this consumer holds epoch {self._epoch}, the "
                f"manifest has epoch {found}: epochs only grow, so the manifest was replaced "
                "(deleted and created again, or restored from an older copy) and its "
                "sequences may no longer match what was written; stopping",
                expected_epoch=self._epoch,
                found_epoch=found,
            )
        if found != self._epoch:
            raise FencedError(
                f"{self._cas.path}: fenced: this consumer holds epoch {self._epoch}, the "
                f"manifest has epoch {found}; another consumer took over",
                expected_epoch=self._epoch,
                found_epoch=found,
            )
