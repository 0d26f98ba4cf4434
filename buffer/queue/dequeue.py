"""The RFC's queue consumer: reads and dequeues the manifest under epoch fencing."""

from __future__ import annotations

import logging

from millpond.common.clock import Clock
from millpond.common.metrics import Counters
from millpond.common.retry import RetryPolicy
from millpond.errors import (
    FencedError,
    InvalidInputError,
    MillpondError,
    NotFoundError,
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
from millpond.queue.fenced import Version, fenced_manifest
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
        self._manifest = fenced_manifest(self._cas, self._check_read)

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
        known, self._raw = self._raw, None

        def bump(data: bytes | None) -> bytes:
            base = data if data is not None else empty_manifest()
            found = decode_footer(base, name=self._cas.path).epoch
            if self._epoch is not None:
                self._check_epoch(found)  # lost the queue: never take it back
            return with_epoch(base, found + 1)

        # A lost race reads and bumps again at once: a coordinator appending back to back
        # leaves the manifest alone only for a moment now and then.
        done = self._manifest.update(bump, what="epoch bump", known=_version(known), at_once=True)
        assert done.version.value is not None
        epoch = decode_footer(done.version.value, name=self._cas.path).epoch
        self._epoch = epoch
        self._last_etag = None
        self._fence_etag = done.version.etag
        self._raw = RawManifest(done.version.value, done.version.etag)
        logger.info("consumer holds epoch %s of %s", epoch, self._cas.path)
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
        if got is not None:  # None: unchanged since this consumer last saw its epoch there
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
        if self._epoch is None:
            raise MillpondError("consumer is not initialized: call initialize() first")
        path = self._cas.path
        removed: list[int] = []  # per attempt: a write that failed may have landed

        def removal(data: bytes | None) -> bytes | None:
            if data is None:
                raise NotFoundError(f"{path}: manifest not found")
            if through >= decode_footer(data, name=path).next_sequence:
                removed.append(0)
                return None
            new, count = remove_through(data, through)
            removed.append(count)
            return new if count else None

        # The bytes this consumer last read or wrote, while nothing newer was seen: the write
        # is conditional on their ETag, so it lands only on that very manifest, which carries
        # this consumer's epoch; anything else fails it and the manifest is read.
        known = self._raw if self._raw is not None and self._raw.etag == self._fence_etag else None
        done = self._manifest.update(
            removal, what="dequeue", known=_version(known), prove=True, at_once=True
        )
        if done.wrote:
            assert done.version.value is not None
            self._fence_etag = done.version.etag
            self._raw = RawManifest(done.version.value, done.version.etag)
            self._confirmations += 1
            return removed[-1]
        assert done.version.value is not None
        next_sequence = decode_footer(done.version.value, name=path).next_sequence
        if through >= next_sequence:
            raise InvalidInputError(
                f"through: expected < next_sequence {next_sequence}, found {through}"
            )
        # Nothing left to remove: a write before that failed in doubt had landed.
        return max(removed[:-1], default=0)

    def _check_read(self, data: bytes) -> None:
        """The epoch check of a manifest read in an update (:class:`FencedObject`); before
        :meth:`initialize` there is nothing to check."""
        if self._epoch is None:
            return
        self._check_epoch(decode_footer(data, name=self._cas.path).epoch)
        self._confirmations += 1  # read in this call, and still this consumer's

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


def _version(raw: RawManifest | None) -> Version[bytes] | None:
    return None if raw is None else Version(raw.data, raw.etag)
