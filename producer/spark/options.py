"""Options of the ``millpond`` Spark data source, checked once on the driver.

Every option is either a ``ProducerConfig`` key (checked by ``ProducerConfig.from_options``,
which names a bad key), an obstore store option (S3 ``aws_access_key_id``, ``aws_endpoint``,
...; Azure ``azure_storage_account_name``, ``azure_storage_account_key``, ...; GCS
``google_service_account``, ...; each backend's standard variables on each executor fill in
what is not given), or one of the few keys only the Spark integration has:

=================== ======================================================================
``commit``          ``job`` (default): one queue append per job or micro-batch, exactly once;
                    ``task``: every task appends as it flushes, at-least-once under retries
``path``            the store URL, as given to ``.save(path)``; same as ``store``
``query_id``        streaming only: a stable id for the query (default: the query id in the
                    checkpoint's ``metadata`` file, else a hash of ``checkpointLocation``)
``gc_grace_period`` seconds, default 600: the collector's grace period; a job whose uploads
                    are older than half of it checks they still exist before enqueuing them
``check_store``     ``true`` (default) or ``false``: read the manifest when the write starts,
                    so an unreachable store or a corrupt manifest fails the job before any task
``receipt_path``    a path in the store where the driver writes a JSON summary of each commit
``metadata``        a string added to every entry's metadata payload (as ``"tag"``)
``table``           the table ``millpond consume`` writes the rows into (``[schema.]name``,
                    one it is allowed to write; default: its ``--table``), named in every
                    entry's metadata (a ``millpond.table=`` line, ``millpond.formats.routing``)
``write_id``        batch jobs: a name for this write. A second job with the same write id
                    enqueues nothing if the first one's append landed (reruns are safe)
``coordinator``     (a ``ProducerConfig`` key) ``http://host:port`` of ``millpond
                    coordinator`` services: the driver's commit appends through them, and
                    appends directly when none answers (a token in the driver's
                    ``MILLPOND_COORDINATOR_TOKEN``)
``await_sink``      a duration (``600s``, ``10m``; ``0``: do not wait, the default): the job,
                    and each micro-batch, returns only once ``millpond consume`` says it has
                    written the rows into its database, and fails naming what the consumer
                    is doing when the time runs out (the rows stay enqueued)
=================== ======================================================================

Spark adds ``checkpointLocation`` and ``queryName`` to streaming writes; they are read, not
passed on. Spark lower-cases option keys, so every key here is lower case.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

from millpond.common.retry import RetryPolicy
from millpond.errors import ConfigError, NotFoundError, StorageError
from millpond.formats.batch import CompressionType
from millpond.formats.manifest import decode_footer
from millpond.formats.routing import with_table
from millpond.queue import QueueLocation, open_claim

if TYPE_CHECKING:
    from millpond.storage.store import ObjectStore

__all__ = ["EXECUTOR_WAL_DIR", "SPARK_ONLY_KEYS", "SparkWriteSettings"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_COMMIT_MODES = ("job", "task")
_DEFAULT_GRACE = 600.0

SPARK_ONLY_KEYS = frozenset(
    {
        "commit",
        "path",
        "query_id",
        "gc_grace_period",
        "check_store",
        "receipt_path",
        "metadata",
        "write_id",
        "table",
        "await_sink",
    }
)
"""Option keys the Spark integration reads itself instead of passing to ``ProducerConfig``."""
_SPARK_PROVIDED = frozenset({"checkpointlocation", "queryname"})
# obstore store options may be given bare, like the aws_* keys: these prefixes, and the
# client options (not backend config keys).
_STORE_PREFIXES = ("aws_", "azure_", "google_")
_CLIENT_OPTIONS = frozenset(
    {"connect_timeout", "timeout", "pool_idle_timeout", "pool_max_idle_per_host", "allow_http"}
)
EXECUTOR_WAL_DIR = "spark-local-dirs"
"""The ``wal_dir`` placeholder meaning "a slot under the executor's local directories"."""

_STORES: dict[tuple[object, ...], ObjectStore] = {}
_STORES_GUARD = threading.Lock()
_STORES_KEPT = 16
"""Stores kept per process (a process writing to more queues opens the others again)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SparkWriteSettings(QueueLocation):
    """The parsed options of one write. Plain values only, so Spark can pickle it to tasks."""

    producer_options: Mapping[str, str] = field(repr=False)
    """What ``ProducerConfig.from_options`` accepted: the store, the queue paths, flush size,
    compression, WAL settings and credentials (hence left out of ``repr``)."""
    flush_size_bytes: int
    """Largest batch object, in bytes."""
    compression: CompressionType
    """Compression of batch objects."""
    upload_concurrency: int
    """Uploads in flight per task."""
    retry: RetryPolicy
    """Backoff of one round of upload or manifest retries."""
    commit: str = "job"
    """``job`` or ``task``; see the module docstring."""
    query_id: str | None = None
    """Streaming: the stream id option, if given."""
    checkpoint_location: str | None = None
    """Streaming: the query's checkpoint location, as Spark passed it."""
    gc_grace_period: float = _DEFAULT_GRACE
    """Seconds; default 600."""
    check_store: bool = True
    """Whether the write starts by reading the manifest. Default true."""
    receipt_path: str | None = None
    """Where the driver writes a JSON summary of each commit; default none."""
    tag: str | None = None
    """The ``metadata`` option: added to every entry's metadata payload."""
    write_id: str | None = None
    """The ``write_id`` option: reruns of the same write enqueue nothing twice."""
    table: str | None = None
    """The ``table`` option: the consumer's table for these rows (``None``: its own)."""
    coordinator: tuple[str, ...] = ()
    """The ``coordinator`` option: coordinators the driver's commit appends through."""
    host_coordinator: bool | None = None
    """The ``host_coordinator`` option: whether the executors' producers (``commit=task``,
    ``partition_producer``) share one coordinator per machine; ``None`` (not given): as
    ``ProducerConfig`` decides, shared on S3, GCS and Azure."""
    await_sink: float = 0.0
    """The ``await_sink`` option, in seconds: how long the driver waits after each commit for
    the consumer to write the rows into its database (0: it does not wait)."""

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> SparkWriteSettings:
        """Parse and check every option.

        Raises:
            ConfigError: naming the first bad key and what it accepts.
        """
        from millpond.producer.config import ProducerConfig, parse_bool

        opts = {str(k).lower(): str(v) for k, v in options.items()}
        spark = {k: opts.pop(k) for k in list(opts) if k in SPARK_ONLY_KEYS}
        provided = {k: opts.pop(k) for k in list(opts) if k in _SPARK_PROVIDED}
        _take_store(opts, spark.get("path"))
        producer_options = _as_producer_options(opts)
        config = ProducerConfig.from_options(producer_options)
        commit = spark.get("commit", "job").lower()
        if commit not in _COMMIT_MODES:
            raise ConfigError("commit", f"expected 'job' or 'task', found {commit!r}")
        for key in ("query_id", "write_id"):
            if key in spark and not spark[key].strip():
                raise ConfigError(key, "expected a non-empty id, found ''")
        receipt_path = spark.get("receipt_path")
        if receipt_path is not None and not receipt_path.strip("/"):
            raise ConfigError(
                "receipt_path", f"expected a path in the store, found {receipt_path!r}"
            )
        return cls(
            producer_options=producer_options,
            store=str(config.store),
            store_options=dict(config.store_options),
            data_path_prefix=config.data_path_prefix,
            manifest_path=config.manifest_path,
            flush_size_bytes=config.flush_size_bytes,
            compression=config.compression,
            upload_concurrency=config.upload_concurrency,
            retry=config.retry,
            commit=commit,
            query_id=spark.get("query_id"),
            checkpoint_location=provided.get("checkpointlocation") or None,
            gc_grace_period=_parsed(spark, "gc_grace_period", _seconds, _DEFAULT_GRACE),
            check_store=_parsed(spark, "check_store", parse_bool, True),
            receipt_path=receipt_path.strip("/") if receipt_path else None,
            tag=spark.get("metadata"),
            write_id=spark.get("write_id"),
            table=_parsed(spark, "table", _table, None),
            coordinator=tuple(config.coordinator or ()),
            host_coordinator=config.host_coordinator,
            await_sink=_parsed(spark, "await_sink", _duration, 0.0),
        )

    @property
    def store_url(self) -> str:
        """The store URL (``s3://``, ``az://``, ``gs://``, ``file://``)."""
        return str(self.store)

    def open_store(self) -> ObjectStore:
        """The store these settings point at, one per process for one URL and its options;
        opening sends no request.

        Spark calls the writer again for every job and micro-batch, in processes that live on
        (its Python workers, the processes that make the writer and commit it), and an S3
        client costs milliseconds to build (its TLS set-up): six of them were a sixth of
        what Millpond added to a micro-batch of 100,000 rows (issue 49). A store is safe to
        share between threads; a forked child opens its own.

        Raises:
            ConfigError: a bad option.
        """
        key = (os.getpid(), self.store_url, tuple(sorted(self.store_options.items())))
        with _STORES_GUARD:
            store = _STORES.get(key)
            if store is None:
                store = QueueLocation.open_store(self)
                if len(_STORES) >= _STORES_KEPT:
                    _STORES.clear()
                _STORES[key] = store
            return store

    def probe(self) -> SparkWriteSettings:
        """Read the queue's claim and manifest footer, so a bad store or another queue's data
        prefix fails the job before any task runs.

        A missing manifest is fine (an empty queue).

        Returns:
            These settings, with ``gc_grace_period`` no longer than the queue's own (its claim
            says what its collectors keep), so old uploads are copied in time.

        Raises:
            ConfigError: the store URL or options are bad, or the data prefix belongs to
                another queue (naming both manifests).
            StorageError: the store cannot be reached, naming it.
            FormatError: the manifest or the claim is corrupt.
        """
        store = self.open_store()
        try:
            claim = open_claim(
                store, data_path_prefix=self.data_path_prefix, manifest_path=self.manifest_path
            )
            try:
                got = store.get(self.manifest_path)
            except NotFoundError:
                got = None
        except StorageError as err:
            raise StorageError(f"store {self.store_url} is unreachable: {err}") from err
        if got is not None:
            decode_footer(got.data, name=f"{self.store_url}/{self.manifest_path}")
        if claim is not None and claim.gc_grace_period < self.gc_grace_period:
            return dataclasses.replace(self, gc_grace_period=claim.gc_grace_period)
        return self

    def stream_id(self) -> str:
        """The id that names this streaming query across restarts.

        The ``query_id`` option if given; else the query id Spark keeps in the checkpoint's
        ``metadata`` file (readable when the checkpoint is on a local file system); else a hash
        of the checkpoint location. Only the first two change when a checkpoint is deleted and
        the query starts over.

        Raises:
            ConfigError: neither ``query_id`` nor a checkpoint location is known.
        """
        if self.query_id:
            return self.query_id
        if not self.checkpoint_location:
            raise ConfigError(
                "checkpointLocation",
                "a streaming write to millpond needs .option('checkpointLocation', ...) or "
                "option query_id, to recognise a micro-batch Spark runs again after a restart",
            )
        found = _checkpoint_query_id(self.checkpoint_location)
        if found:
            return found
        return "ckpt-" + sha256(self.checkpoint_location.encode()).hexdigest()[:32]

    def payload_fields(self) -> dict[str, object]:
        """Extra fields for every entry's metadata payload."""
        return {"tag": self.tag} if self.tag is not None else {}


def _take_store(opts: dict[str, str], path: str | None) -> None:
    """Set option ``store`` from ``.save(path)``; refuse none, two, or one in this process.

    Raises:
        ConfigError: naming ``path`` or ``store``.
    """
    if path:
        if opts.get("store", path) != path:
            raise ConfigError(
                "path",
                f"expected the same store as option store ({opts['store']!r}), found {path!r}",
            )
        opts["store"] = path
    if not opts.get("store"):
        raise ConfigError(
            "store", "expected a store URL (option store, or .save('s3://bucket')), found none"
        )
    if opts["store"].startswith("memory:"):
        raise ConfigError(
            "store",
            "expected a store every Spark process can reach (s3://, az://, gs://, file://), "
            "found memory://, which lives inside one process",
        )


def _as_producer_options(options: Mapping[str, str]) -> dict[str, str]:
    """Spark-style keys into ``ProducerConfig.from_options`` keys.

    obstore options may be given bare (``aws_access_key_id``, ``azure_storage_account_key``,
    ``google_service_account``) as well as in the config's own
    form (``store_options.aws_access_key_id``). A ``commit="job"`` write never opens a WAL, so
    ``wal_dir`` gets a placeholder when absent (the executor helper replaces it with a slot).
    """
    out: dict[str, str] = {}
    for key, value in options.items():
        if key.startswith(_STORE_PREFIXES) or key in _CLIENT_OPTIONS:
            out[f"store_options.{key}"] = value
        else:
            out[key] = value
    out.setdefault("wal_dir", EXECUTOR_WAL_DIR)
    return out


def _checkpoint_query_id(location: str) -> str | None:
    parts = urlsplit(location)
    if parts.scheme not in ("", "file"):
        return None
    metadata = Path(parts.path if parts.scheme else location) / "metadata"
    try:
        record = json.loads(metadata.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    value = record.get("id") if isinstance(record, dict) else None
    return str(value) if value else None


def _parsed(spark: Mapping[str, str], key: str, parse: Callable[[str], _T], default: _T) -> _T:
    """Option ``key`` of ``spark`` through ``parse``, whose ``ValueError`` says what is wrong;
    ``default`` when not given.

    Raises:
        ConfigError: naming ``key``.
    """
    value = spark.get(key)
    if value is None:
        return default
    try:
        return parse(value)
    except ValueError as err:
        # A message that names the key already (the table's) does not name it twice.
        raise ConfigError(key, str(err).removeprefix(f"{key}: ")) from None


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected seconds >= 0, found {text!r}")
    return seconds


def _duration(text: str) -> float:
    """Seconds from ``600``, ``600s``, ``10m``, ``1h``."""
    from millpond.producer.config import parse_duration

    seconds = parse_duration(text)
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, found {text!r}")
    return seconds


def _table(text: str) -> str:
    """The ``table`` option, checked as the metadata line that carries it checks it."""
    with_table(b"", text)
    return text
