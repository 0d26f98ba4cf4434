"""What makes a queue one queue: its identity, and the claim it holds on its data prefix.

**The claim.** ``{data_path_prefix}/_millpond/queue.json`` names the manifest whose batches live
under that prefix, and the queue's timing contract. It is written once, create-if-absent, by
the first millpond role that opens the queue (a producer, the consumer or the collector), and
read by every other one at start:

* two queues on one data prefix would each see the other's batch objects as unreferenced and
  delete them: a role whose manifest is not the one the claim names is refused, with a
  message naming both manifests;
* ``gc_grace_period`` is the least time any collector keeps an unreferenced batch object
  (counted from its ULID *and* from its last-modified time in the store). A collector
  configured with less is refused; producers re-upload a batch that waited for its append
  longer than half of it (``reupload_after``), so GC can never take a batch about to be
  appended;
* ``gc_delete_window`` bounds how late a collector's delete may land after the pass listed the
  objects. A producer that writes an object again under the same name (to refresh its
  last-modified time) waits this long before appending it: a pass that listed the old copy
  has finished deleting by then.

The claim sits in a nested prefix, which the RFC's collectors never list, so RFC peers neither
see nor need it; a peer that does not read it is not protected by it (docs/guarantees.md).

**The identity** (:func:`queue_identity`) is the store URL, without credentials, joined with
the manifest path: the key a sink records its progress under.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from millpond.errors import ConfigError, ConflictError, FormatError
from millpond.storage.store import ObjectStore, get_or_none

__all__ = [
    "CLAIM_NAME",
    "CLOCK_PROBE",
    "DEFAULT_GC_GRACE_PERIOD",
    "MAX_CLOCK_SKEW",
    "QueueClaim",
    "claim_path",
    "default_delete_window",
    "internal_path",
    "open_claim",
    "queue_identity",
    "same_queue",
]

logger = logging.getLogger(__name__)

CLAIM_NAME = "queue.json"
CLOCK_PROBE = "clock"
"""Name of the store-clock probe object under ``{prefix}/_millpond/`` (see
:mod:`millpond.storage.store_time`)."""
_INTERNAL_DIR = "_millpond"
_VERSION = 1
DEFAULT_GC_GRACE_PERIOD = 600.0
"""Seconds: the RFC's default grace period, and the claim's when its creator sets none."""
_MAX_DELETE_WINDOW = 30.0
MAX_CLOCK_SKEW = 60.0
"""Seconds: producers refuse to start when their clock and the store's differ by more."""


def internal_path(data_path_prefix: str, name: str) -> str:
    """``{prefix}/_millpond/{name}``: where millpond keeps its own objects next to a queue."""
    prefix = data_path_prefix.strip("/")
    return f"{prefix}/{_INTERNAL_DIR}/{name}" if prefix else f"{_INTERNAL_DIR}/{name}"


def claim_path(data_path_prefix: str) -> str:
    """The claim object of the queue whose batches live under ``data_path_prefix``."""
    return internal_path(data_path_prefix, CLAIM_NAME)


def default_delete_window(gc_grace_period: float) -> float:
    """A quarter of the grace period, at most 30 s."""
    return min(_MAX_DELETE_WINDOW, gc_grace_period / 4)


def queue_identity(store_url: str, manifest_path: str) -> str:
    """``scheme://bucket/root/manifest_path``: one string per queue, without credentials.

    Spelled as the store resolves the URL, so two spellings of one queue give one identity:
    ``s3a://`` is ``s3://``, empty and ``.`` segments go, ``..`` takes the segment before it
    away, and percent escapes are decoded (``s3://b/x/../r%6Fot`` is ``s3://b/root``).
    """
    parts = urlsplit(store_url)
    scheme = "s3" if parts.scheme == "s3a" else parts.scheme
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    root = _resolved_path(parts.path)
    path = "/".join(p for p in manifest_path.split("/") if p)
    base = f"{scheme}://{host}" if scheme else store_url.rstrip("/")
    return "/".join(p for p in (base, root, path) if p)


def same_queue(recorded: str, identity: str) -> bool:
    """Whether ``recorded``, a :func:`queue_identity` stored earlier, names the queue
    ``identity`` names: identities recorded before 6a5c8ca kept a URL's ``..``, ``.`` and
    percent escapes (``s3://b/x/../root/...``)."""
    if recorded == identity:
        return True
    old, new = urlsplit(recorded), urlsplit(identity)
    return (old.scheme, old.netloc, _resolved_path(old.path)) == (
        new.scheme,
        new.netloc,
        _resolved_path(new.path),
    )


def _resolved_path(path: str) -> str:
    """``path`` as a store resolves it: no empty or ``.`` segments, ``..`` removing the one
    before it, percent escapes decoded."""
    segments: list[str] = []
    for segment in (unquote(raw) for raw in path.split("/")):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    return "/".join(segments)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueClaim:
    """The claim a queue holds on its data prefix."""

    manifest_path: str
    """The manifest of the queue whose batch objects live under the prefix."""
    gc_grace_period: float = DEFAULT_GC_GRACE_PERIOD
    """Seconds every collector of this queue keeps an unreferenced batch object, at least."""
    gc_delete_window: float | None = None
    """Seconds after its listing by which every delete of a collection pass has landed.
    Default: a quarter of the grace period, at most 30 s."""
    created_ms: int = 0
    """Wall-clock milliseconds when the claim was written."""

    def __post_init__(self) -> None:
        if not self.gc_grace_period >= 0:
            raise ConfigError(
                "gc_grace_period", f"expected >= 0 seconds, found {self.gc_grace_period}"
            )
        if self.gc_delete_window is None:
            object.__setattr__(
                self, "gc_delete_window", default_delete_window(self.gc_grace_period)
            )
        window = self.delete_window
        if not 0 <= window <= max(self.gc_grace_period / 2, 0):
            raise ConfigError(
                "gc_delete_window",
                f"expected 0..{self.gc_grace_period / 2} seconds (half the grace period), "
                f"found {window}",
            )

    @property
    def delete_window(self) -> float:
        """``gc_delete_window`` with its default resolved."""
        assert self.gc_delete_window is not None
        return self.gc_delete_window

    def encode(self) -> bytes:
        record = {
            "version": _VERSION,
            "manifest_path": self.manifest_path,
            "gc_grace_period_s": self.gc_grace_period,
            "gc_delete_window_s": self.delete_window,
            "created_ms": self.created_ms,
        }
        return json.dumps(record, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, *, name: str) -> QueueClaim:
        """Parse a claim object.

        Raises:
            FormatError: not a claim, or an unknown version.
        """
        try:
            record = json.loads(data)
            if not isinstance(record, dict) or record.get("version") != _VERSION:
                found = record.get("version") if isinstance(record, dict) else None
                raise FormatError(
                    f"{name}: version: expected {_VERSION}, found {found!r}", field="version"
                )
            return cls(
                manifest_path=str(record["manifest_path"]),
                gc_grace_period=float(record["gc_grace_period_s"]),
                gc_delete_window=float(record["gc_delete_window_s"]),
                created_ms=int(record.get("created_ms", 0)),
            )
        except (ValueError, KeyError, TypeError, ConfigError) as err:
            raise FormatError(f"{name}: not a millpond queue claim: {err}") from err

    def check_manifest(self, manifest_path: str, *, store_url: str, data_path_prefix: str) -> None:
        """Refuse a role whose manifest is not the one this claim names.

        Raises:
            ConfigError: naming both manifests.
        """
        if _clean(manifest_path) != _clean(self.manifest_path):
            raise ConfigError(
                "data_path_prefix",
                f"{store_url}: the data prefix {data_path_prefix.strip('/')!r} holds the batch "
                f"objects of the queue whose manifest is {self.manifest_path!r}; this queue's "
                f"manifest is {manifest_path!r}. Two queues on one data prefix delete each "
                "other's batches: give each queue its own data_path_prefix",
            )

    def check_gc_grace(self, gc_grace_period: float, *, store_url: str) -> None:
        """Refuse a collector whose grace period is shorter than the queue's.

        Raises:
            ConfigError: naming both periods.
        """
        if gc_grace_period < self.gc_grace_period:
            raise ConfigError(
                "gc_grace_period",
                f"expected at least the queue's {self.gc_grace_period:g} s "
                f"({store_url}, {self.manifest_path}), found {gc_grace_period:g} s: producers "
                "of this queue count on batch objects surviving that long",
            )

    def reupload_limit(self) -> float:
        """The longest a producer may wait between uploading a batch and appending it."""
        return self.gc_grace_period / 2


def open_claim(
    store: ObjectStore,
    *,
    data_path_prefix: str,
    manifest_path: str,
    create: QueueClaim | None = None,
) -> QueueClaim | None:
    """Read the queue's claim, creating it from ``create`` when there is none.

    Returns:
        The claim; ``None`` when there is none and ``create`` is ``None``.

    Raises:
        ConfigError: the claim names another manifest (two queues on one data prefix).
        FormatError: the claim object is corrupt.
        StorageError: the store failed.
    """
    path = claim_path(data_path_prefix)
    claim = _read(store, path)
    if claim is None and create is not None:
        try:
            store.put_if_absent(path, create.encode())
        except ConflictError:
            # Another role claimed it first (or our own earlier attempt landed): read it.
            claim = _read(store, path) or create
        else:
            # Created, so ours is the claim: no need to read it back.
            logger.info(
                "claimed %s for %s (GC grace period %s s)",
                path,
                create.manifest_path,
                create.gc_grace_period,
            )
            claim = create
    if claim is not None:
        claim.check_manifest(manifest_path, store_url=store.url, data_path_prefix=data_path_prefix)
    return claim


def _read(store: ObjectStore, path: str) -> QueueClaim | None:
    got = get_or_none(store, path)
    return None if got is None else QueueClaim.decode(got.data, name=f"{store.url}/{path}")


def _clean(path: str) -> str:
    return "/".join(p for p in path.split("/") if p)
