"""The transaction both ADBC sinks share: claim the batch, evolve the table, bulk-ingest.

One write is one transaction::

    INSERT INTO progress (target_table, sequence, location, ...) ON CONFLICT DO NOTHING
    -- no row inserted: the sequence, or the location, is already recorded -> skip
    [CREATE TABLE | ALTER TABLE ... ADD COLUMN | ALTER COLUMN ... TYPE]   -- schema drift
    bulk ingest of the rows (ADBC ``adbc_ingest``: COPY on PostgreSQL)
    COMMIT

The progress table has the primary key ``(target_table, sequence)`` and a unique index on
``(target_table, location)`` over written batches. Claiming first means two consumers that
race on one batch (a fenced one that has not noticed yet, and its successor) serialize on the
progress row: the second blocks until the first commits, then finds the row and skips. A
skipped batch still gets a ``duplicate`` row, so :meth:`last_sequence` covers it and a resumed
consumer does not look for entries that were dequeued after being skipped.

Progress is keyed by the queue. Sequences and locations only mean something within one queue,
so each target table belongs to exactly one: ``millpond_owners``, next to the target table (in
its schema, whatever progress table a consumer is configured with), records per target table
the identity of the queue whose rows it holds (store URL and manifest path). A consumer
of another queue pointed at that table is refused by :meth:`last_sequence` — before its
consumer takes over or dequeues anything — and by every write, naming both queues. Several
queues write into one database side by side, each into its own table.

Progress and ownership are keyed by the table the database resolves, not by the name as typed
(:mod:`millpond.consumer.sinks._names`): ``public.kill3`` and ``kill3`` on PostgreSQL,
``EVENTS`` and ``events`` on SQLite, share one progress and one owner. Versions before kept
the name as typed; the first transaction that claims the table on a connection moves rows
recorded under another spelling of it to the resolved name (:meth:`AdbcSink._merge_spellings`)
and refuses a table two spellings gave to two queues.

Many tables, one progress (issue 46). Batches may name the table their rows go to
(:mod:`millpond.formats.routing`); the sink writes only the tables it is allowed to
(:class:`~millpond.consumer.sinks._tables.SinkTables`, resolved by
:class:`~millpond.consumer.sinks._targets.Router`) and refuses a batch naming any other, for
good. Whichever tables a batch's rows go to, its progress row is recorded under the sink's own
table, in the same transaction as the rows: a queue has one sequence across its tables. Every
table it writes is recorded as the queue's in ``millpond_owners`` next to that table, so no
other queue's consumer writes into it (nor this one into another queue's). A table is appended
to or upserted by key (:mod:`millpond.consumer.sinks._table_writer`).

Nothing is set up before it is needed: the progress, quarantine and owners tables are created in
the first transaction on a connection, together with its work, so a start refused there (another
queue's table) or a probe rolled back (``millpond doctor``) leaves nothing behind.

The progress rows are kept for good: they are how a batch appended again (a producer recovering
after its first append was consumed) is recognised however late it comes back. Deleting old
rows by hand shortens that horizon to what is left.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pyarrow as pa

from millpond.common.metrics import Counters
from millpond.consumer._batch import ConsumedBatch
from millpond.consumer.sinks._dead_letter import QUARANTINE_SUFFIX, QuarantineLedger
from millpond.consumer.sinks._names import TableName, quote, same_table, spellings_sql
from millpond.consumer.sinks._rows import RoutedRows, batch_parts
from millpond.consumer.sinks._table_writer import TableWriter
from millpond.consumer.sinks._tables import SinkTables
from millpond.consumer.sinks._targets import Router, Target
from millpond.consumer.sinks.base import EntryFormat, SinkError
from millpond.consumer.sinks.errors import ErrorClass
from millpond.errors import ConfigError
from millpond.queue import same_queue

__all__ = ["LOCATION_INDEX_SUFFIX", "AdbcSink", "TableName", "quote"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_QUICK_RETRIES = 3
_OWNERS = "millpond_owners"
LOCATION_INDEX_SUFFIX = "_location"
"""The progress table's unique index on locations is named after it with this."""
_SECRET_ANYWHERE = 4  # characters; a secret this long is hidden wherever a message has it


class AdbcSink(QuarantineLedger, TableWriter):
    """A sink over an ADBC DB-API connection; subclasses supply the dialect.

    Quarantined batches (set aside, replayed) are recorded by :class:`QuarantineLedger`;
    rows go into each table through :class:`TableWriter`.
    """

    def __init__(
        self,
        *,
        description: str,
        table: str,
        entry_format: EntryFormat | str,
        sequence_column: str | None,
        progress_table: str,
        secrets: Sequence[str] = (),
        tables: SinkTables | None = None,
    ) -> None:
        if tables is not None and not isinstance(tables, SinkTables):
            raise ConfigError("tables", f"expected SinkTables, found {type(tables).__name__}")
        self._tables = tables or SinkTables()
        self._description = description
        # Credentials the driver may quote in its messages (a URL it could not parse).
        self._secrets = tuple(secrets)
        self._given = TableName.parse("table", table)
        # The target table as given until a transaction resolves it (_identify): from then on
        # as the database resolves it, which is what progress and ownership are keyed by.
        self._table = self._given
        self._progress = TableName.parse("progress_table", progress_table)
        self._quarantine = self._progress.sibling(QUARANTINE_SUFFIX)
        # Next to the target table and whatever the progress table is called: a consumer of
        # another queue configured with another progress table still meets the owner record.
        self._owners = TableName(name=_OWNERS, schema=self._table.schema)
        # Per connection: the sink's own table (resolved), which tables batches may name,
        # every table written (by resolved name) and the spellings batches named them by;
        # whether the set-up DDL has committed on it.
        self._home: Target | None = None
        self._router: Router | None = None
        self._targets: dict[TableName, Target] = {}
        self._routes: dict[str, Target] = {}
        self._set_up = False
        self._writing: TableName | None = None  # the table being written, for messages
        # Run once the current transaction commits; dropped when it fails.
        self._after_commit: list[Callable[[], None]] = []
        self._entry_format = EntryFormat.parse(entry_format)
        if sequence_column is not None and not sequence_column:
            raise ConfigError("sequence_column", "expected a column name or None, found ''")
        self._sequence_column = sequence_column
        self._conn: Any = None
        self.counters = Counters("batches_written", "batches_skipped", "rows_written")

    # -- Sink ------------------------------------------------------------------------------

    @property
    def rows_written(self) -> int:
        return self.counters.get("rows_written")

    @property
    def table(self) -> str:
        """The target table, ``[schema.]name``: as given until the sink has connected, then as
        the database resolves it (what progress and ownership are keyed by)."""
        return str(self._table)

    def last_sequence(self, queue: str) -> int | None:
        """The highest sequence of ``queue`` recorded for this table, or ``None``.

        Writes nothing: a consumer reads it before its start checks have passed (the store's,
        the takeover), and a start that fails leaves nothing behind. The table becomes
        ``queue``'s with the first batch written (or :meth:`claim`); the checks a claim makes
        run here too — in a transaction rolled back — so a table of another queue is refused
        before anything is taken over or dequeued. So is every table the sink may write that
        is named exactly (:class:`SinkTables`): one of another queue, or an upsert's table
        that exists without a unique index on its key.

        Args:
            queue: the consumer's queue identity (``Consumer.queue``).

        Raises:
            SinkError: the table, or a table the sink may write, belongs to another queue
                (permanent, naming both); an upsert's table has no unique index on its key
                (permanent, naming the index to create); or the database failed.
        """

        def work(cur: Any) -> int | None:
            self._own(cur, queue)
            self._check_tables(cur, queue)
            rows = self._fetch(
                cur,
                f"SELECT max(sequence) FROM {self._progress.sql} WHERE target_table = "
                f"{self._param(1)}",
                (str(self._table),),
            )
            value = rows[0][0] if rows else None
            raise _Undone(int(value) if value is not None else None)

        try:
            self._transaction(work)
        except _Undone as undone:
            return undone.value
        raise AssertionError("unreachable: the work always ends in _Undone")

    def claim(self, queue: str) -> None:
        """Make the table ``queue``'s now (the first write does it otherwise).

        Raises:
            SinkError: the table belongs to another queue (permanent, naming both), or the
                database failed.
        """
        self._transaction(lambda cur: self._own(cur, queue))

    def write(self, batch: ConsumedBatch) -> bool:
        """Write the batch's rows, sequence and location in one transaction.

        Returns:
            ``False`` when the sequence or the location was already recorded (skipped).

        Raises:
            FormatError: the entries cannot be read as rows (nothing written).
            SinkError: the database failed (nothing of this batch committed).
        """
        return self.write_many([batch])[0]

    def write_many(self, batches: Sequence[ConsumedBatch]) -> list[bool]:
        """Write several batches, in sequence order, in one transaction (all or nothing).

        Each batch's rows, sequence and location still commit together; sharing the
        transaction only saves commits when the consumer has a backlog.

        Returns:
            Per batch, ``True`` when written, ``False`` when skipped as already recorded.

        Raises:
            FormatError: a batch's entries cannot be read as rows, or the batches' schemas
                clash (nothing written; write them one by one to get the good ones in).
            SinkError: the database failed (nothing committed).
        """
        if not batches:
            return []
        parts = [
            batch_parts(batch, self._entry_format, sequence_column=self._sequence_column)
            for batch in batches
        ]
        try:
            written = self._transaction(lambda cur: self._write(cur, batches, parts))
        except SinkError as err:
            if err.transient:
                raise
            # Permanent: the service stops here, so the message names the batch to look at.
            raise SinkError(f"{_describe(batches)}: {err}", transient=False) from err
        for batch, routed, ok in zip(batches, parts, written, strict=True):
            if ok:
                self.counters.add("batches_written")
                self.counters.add("rows_written", sum(part.rows.num_rows for part in routed))
            else:
                self.counters.add("batches_skipped")
                logger.info(
                    "sequence %s (%s) is already recorded in %s; skipped",
                    batch.sequence,
                    batch.location,
                    self._table,
                )
        return written

    def probe_write(self) -> None:
        """Connect, then create a scratch table and write a row into it, and roll back.

        For ``millpond doctor``: proves the database is reachable and the credentials may
        create tables and insert where the target table lives, and leaves nothing behind
        (the progress table, which connecting sets up, aside).

        Raises:
            SinkError: the database failed or refused.
        """
        scratch = TableName(f"millpond_doctor_{uuid.uuid4().hex[:12]}", self._table.schema)

        def work(cur: Any) -> None:
            cur.execute(f"CREATE TABLE {scratch.sql} (probe BIGINT NOT NULL)")
            cur.execute(f"INSERT INTO {scratch.sql} (probe) VALUES (1)")
            raise _Undone(None)

        with contextlib.suppress(_Undone):
            self._transaction_once(work)

    def close(self) -> None:
        self._drop_connection()

    def __enter__(self) -> AdbcSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._description!r}, table={str(self._table)!r})"

    # -- dialect ---------------------------------------------------------------------------

    @abstractmethod
    def _open(self) -> Any:
        """A new DB-API connection, configured."""

    @abstractmethod
    def _begin(self, cur: Any) -> None:
        """Start a write transaction (the connection is in autocommit mode: the sink says
        ``COMMIT`` and ``ROLLBACK`` itself)."""

    @abstractmethod
    def _param(self, index: int) -> str:
        """The placeholder of the 1-based parameter ``index``."""

    @abstractmethod
    def _resolve(self, cur: Any, table: TableName) -> TableName:
        """``table`` as the database resolves it: one spelling per table (see
        :mod:`millpond.consumer.sinks._names`)."""

    def _name_problem(self, table: TableName) -> str | None:
        """Why the database would not keep ``table`` as named, or ``None``."""
        return None

    @abstractmethod
    def _exists(self, cur: Any, table: TableName) -> bool:
        """Whether ``table`` exists."""

    def _lock_setup(self, cur: Any) -> None:
        """Serialize the creation of the progress, owners and quarantine tables with other
        sinks setting up, until the transaction ends (none needed where the transaction
        itself already does)."""

    @abstractmethod
    def _classify(self, err: Exception) -> ErrorClass:
        """A driver error's class: transient (retry) or permanent (stop)."""

    def _driver_errors(self) -> tuple[type[Exception], ...]:
        """The driver's exception classes, translated into :class:`SinkError`."""
        import adbc_driver_manager

        return (adbc_driver_manager.Error,)

    # -- the transaction -------------------------------------------------------------------

    def _own(self, cur: Any, queue: str, target: Target | None = None) -> None:
        """Make ``target`` (default: the sink's own table) ``queue``'s if it is nobody's;
        refuse it if it is another's.

        Keyed by the table as the database resolves it; rows an earlier version recorded
        under another spelling of it are moved to that key first, in this transaction.
        """
        target = target or self._own_target()
        owned = target.owned_by
        if target is not self._home and owned is not None and same_queue(owned, queue):
            return  # found or made its owner on this connection (Target.owned_by)
        now_ms = time.time_ns() // 1_000_000
        table = str(target.table)
        self._owners_table(cur, target)
        if not target.merged:
            self._merge_spellings(cur, now_ms, target)
            self._after_commit.append(lambda: setattr(target, "merged", True))
        p = self._param
        claimed = self._fetch(
            cur,
            f"INSERT INTO {target.owners.sql} (target_table, queue, claimed_at_ms) "
            f"VALUES ({p(1)}, {p(2)}, {p(3)}) ON CONFLICT DO NOTHING RETURNING queue",
            (table, queue, now_ms),
        )
        if claimed:
            # Progress rows older than any owner record would be of an unknown queue.
            legacy = self._fetch(
                cur,
                f"SELECT count(*) FROM {self._progress.sql} WHERE target_table = {p(1)}",
                (table,),
            )
            if legacy and int(legacy[0][0]):
                raise SinkError(
                    f"{self._description}: table {table} has {int(legacy[0][0])} progress rows "
                    f"in {self._progress} but no record of the queue they belong to; this "
                    f"consumer reads {queue}. If they are that queue's, record it: INSERT INTO "
                    f"{target.owners} VALUES ('{table}', '{queue}', 0)",
                    transient=False,
                )
        else:
            owner = self._fetch(
                cur, f"SELECT queue FROM {target.owners.sql} WHERE target_table = {p(1)}", (table,)
            )
            found = str(owner[0][0]) if owner else None
            if found is None or not same_queue(found, queue):
                raise SinkError(
                    f"{self._description}: table {table} holds the rows and progress of queue "
                    f"{found}; this consumer reads queue {queue}. Sequences of one queue mean "
                    "nothing to another: give this queue its own table (--table); queues share "
                    "a database side by side, never a table",
                    transient=False,
                )
        self._after_commit.append(lambda: setattr(target, "owned_by", queue))

    def _own_target(self) -> Target:
        assert self._home is not None, "resolved by _identify in every transaction"
        return self._home

    def _owners_table(self, cur: Any, target: Target) -> None:
        """Create the owners table next to ``target`` where it is missing (the sink's own
        table's is made with the progress table)."""
        if target.owners_ready or target.owners == self._owners:
            return
        if not self._exists(cur, target.owners):
            self._lock_setup(cur)
            self._create_owners(cur, target.owners)
        self._after_commit.append(lambda: setattr(target, "owners_ready", True))

    @staticmethod
    def _create_owners(cur: Any, owners: TableName) -> None:
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {owners.sql} ("
            "target_table TEXT NOT NULL PRIMARY KEY, queue TEXT NOT NULL, "
            "claimed_at_ms BIGINT NOT NULL)"
        )

    def _identify(self, cur: Any) -> None:
        """Resolve the sink's own table, the owners table next to it and the tables it may
        write, once per connection."""
        if self._home is None:
            table = self._resolve(cur, self._given)
            owners = self._resolve(cur, TableName(_OWNERS, table.schema))
            router = Router(
                self._tables,
                home=table,
                resolve=lambda spelled: self._resolve(cur, spelled),
                name_key=self._name_key,
                reserved=[
                    self._name_key(name)
                    for name in (self._progress.name, self._quarantine.name, _OWNERS)
                ],
            )
            settings = router.settings(table, lambda spelled: self._resolve(cur, spelled))
            assert settings is not None  # the sink's own table is always allowed
            self._home = Target(table, owners, settings, owners_ready=True)
            self._router, self._targets, self._routes = router, {table: self._home}, {}
        assert self._home is not None
        self._table, self._owners = self._home.table, self._home.owners

    def _target(self, cur: Any, table: TableName) -> Target | None:
        """The target for ``table`` (resolved), or ``None`` when no batch may write it."""
        known = self._targets.get(table)
        if known is not None:
            return known
        assert self._router is not None
        settings = self._router.settings(table, lambda spelled: self._resolve(cur, spelled))
        if settings is None:
            return None
        owners = self._resolve(cur, TableName(_OWNERS, table.schema))
        target = self._targets[table] = Target(table, owners, settings)
        return target

    def _route(self, cur: Any, spelled: str | None) -> Target:
        """The table a batch part names (``None``: the sink's own).

        Raises:
            SinkError: it names a table this sink may not write (permanent).
        """
        if spelled is None:
            return self._own_target()
        target = self._routes.get(spelled)
        if target is not None:
            return target
        try:
            parsed = TableName.parse("table", spelled)
        except ConfigError as err:
            raise SinkError(f"the batch names table {spelled!r}: {err}", transient=False) from err
        problem = self._name_problem(parsed)
        if problem is not None:
            raise SinkError(f"the batch names table {spelled}: {problem}", transient=False)
        table = self._resolve(cur, parsed)
        found = self._target(cur, table)
        if found is None:
            assert self._router is not None
            raise SinkError(
                f"the batch names table {spelled} ({table}), which this consumer may not write; "
                f"it writes {self._router.describe()}. Allow the table with --tables or a "
                "[tables.NAME] section of --config, or set the batch aside",
                transient=False,
            )
        self._routes[spelled] = found
        return found

    def _check_tables(self, cur: Any, queue: str) -> None:
        """Check every table named exactly that the sink may write: nobody's or ``queue``'s,
        and for an upsert, a unique index on its key where it exists.

        Raises:
            SinkError: as :meth:`_own` and :meth:`TableWriter._check_key`.
        """
        assert self._router is not None
        for table in self._router.exact():
            target = self._target(cur, table)
            assert target is not None
            if target is not self._home:
                self._own(cur, queue, target)
            if target.settings.upsert and self._reflect(cur, table) is not None:
                self._check_key(cur, target)

    def _spellings(self, cur: Any, owner_tables: Sequence[TableName], target: Target) -> list[str]:
        """The other spellings of ``target`` that progress, quarantine or owner rows are
        recorded under (by versions that kept the name as typed)."""
        queries = [spellings_sql(kept) for kept in (self._progress, self._quarantine)]
        queries += [f"SELECT target_table FROM {owners.sql}" for owners in owner_tables]
        return same_table(
            [row[0] for sql in queries for row in self._fetch(cur, sql, ())],
            target.table,
            resolve=lambda spelled: self._resolve(cur, spelled),
            name_key=self._name_key,
        )

    def _owner_tables(self, cur: Any, target: Target) -> list[TableName]:
        """Where owner records of ``target`` can be: next to it, and where an unqualified
        ``millpond_owners`` resolves (an unqualified name was kept there)."""
        found = [target.owners]
        unqualified = self._resolve(cur, TableName(_OWNERS))
        if unqualified != target.owners and self._exists(cur, unqualified):
            found.append(unqualified)
        return found

    def _merge_spellings(self, cur: Any, now_ms: int, target: Target) -> None:
        """Move what is recorded under other spellings of ``target`` to its resolved name, in
        the caller's transaction.

        A sequence recorded under two spellings (a consumer restarted under another one wrote
        it again) keeps the resolved name's row; a location written under both becomes a
        duplicate. Owner records move too; two spellings owned by two queues are refused.

        Raises:
            SinkError: two spellings of the table belong to two queues (permanent).
        """
        owner_tables = self._owner_tables(cur, target)
        if not self._spellings(cur, owner_tables, target):
            return
        # Two sinks merging at once take turns; the second finds nothing left to move.
        self._lock_schema(cur, target.table)
        spellings = self._spellings(cur, owner_tables, target)
        if not spellings:
            return
        table = str(target.table)
        queues = self._spelled_owners(cur, owner_tables, [table, *spellings], target)
        for spelled in spellings:
            self._move_spelling(cur, spelled, owner_tables, target)
        if queues:
            p = self._param
            cur.execute(
                f"INSERT INTO {target.owners.sql} (target_table, queue, claimed_at_ms) "
                f"VALUES ({p(1)}, {p(2)}, {p(3)}) ON CONFLICT DO NOTHING",
                (table, queues[0][1], now_ms),
            )
        logger.warning(
            "table %s: progress recorded under %s (an earlier version kept the name as typed) "
            "is now recorded under %s",
            table,
            ", ".join(spellings),
            table,
        )

    def _spelled_owners(
        self, cur: Any, owner_tables: Sequence[TableName], keys: Sequence[str], target: Target
    ) -> list[tuple[str, str]]:
        """The owner records of ``target`` under the spellings ``keys`` (its resolved name
        first): ``(spelling, queue)`` pairs, every one of the same queue.

        Raises:
            SinkError: two spellings of the table belong to two queues (permanent).
        """
        table = str(target.table)
        marks = ", ".join(self._param(i + 1) for i in range(len(keys)))
        queues = [
            (str(spelled), str(queue))
            for owners in owner_tables
            for spelled, queue in self._fetch(
                cur,
                f"SELECT target_table, queue FROM {owners.sql} WHERE target_table IN ({marks})",
                tuple(keys),
            )
        ]
        for spelled, queue in queues[1:]:
            if not same_queue(queue, queues[0][1]):
                raise SinkError(
                    f"{self._description}: table {table} is one table under two names, and "
                    f"each is recorded for another queue: {queues[0][0]} for queue "
                    f"{queues[0][1]}, {spelled} for queue {queue}. Its rows are of both; move "
                    "one queue's rows to a table of its own and delete that queue's rows from "
                    f"{self._progress} and {_OWNERS}",
                    transient=False,
                )
        return queues

    def _move_spelling(
        self, cur: Any, spelled: str, owner_tables: Sequence[TableName], target: Target
    ) -> None:
        """Move the progress and quarantine rows recorded under ``spelled`` to ``target``'s
        resolved name, and drop its owner records (the caller records the owner)."""
        table = str(target.table)
        p = self._param
        for kept in (self._progress.sql, self._quarantine.sql):
            # A sequence recorded under both: the resolved name's row stands.
            cur.execute(
                f"DELETE FROM {kept} WHERE target_table = {p(1)} AND sequence IN "
                f"(SELECT sequence FROM {kept} WHERE target_table = {p(2)})",
                (spelled, table),
            )
            if kept == self._progress.sql:
                # A location written under both: its rows are in the table twice already;
                # the second record becomes a duplicate of the first, as the unique index
                # requires.
                cur.execute(
                    f"UPDATE {kept} SET duplicate = TRUE WHERE target_table = {p(1)} AND NOT "
                    f"duplicate AND location IN (SELECT location FROM {kept} WHERE "
                    f"target_table = {p(2)} AND NOT duplicate)",
                    (spelled, table),
                )
            cur.execute(
                f"UPDATE {kept} SET target_table = {p(1)} WHERE target_table = {p(2)}",
                (table, spelled),
            )
        for owners in owner_tables:
            cur.execute(f"DELETE FROM {owners.sql} WHERE target_table = {p(1)}", (spelled,))

    def _write(
        self,
        cur: Any,
        batches: Sequence[ConsumedBatch],
        parts: Sequence[Sequence[RoutedRows]],
    ) -> list[bool]:
        now_ms = time.time_ns() // 1_000_000
        queues = sorted({batch.queue for batch in batches})
        for queue in queues:
            self._own(cur, queue)
        # A location repeated inside the group is a duplicate of its first occurrence.
        progress = [
            (batch.sequence, batch.location, sum(part.rows.num_rows for part in routed))
            for batch, routed in zip(batches, parts, strict=True)
        ]
        first: dict[str, tuple[int, str, int]] = {}
        for row in progress:
            first.setdefault(row[1], row)
        inserted = self._insert_progress(cur, list(first.values()), now_ms, duplicate=False)
        claimed = {int(row[0]) for row in inserted}
        skipped = [row for row in progress if row[0] not in claimed]
        if skipped:
            # Record skips under their own sequence too (unless the sequence itself is what
            # is recorded), so last_sequence() moves past them.
            self._insert_progress(cur, skipped, now_ms, duplicate=True)
        written = [
            part
            for batch, routed in zip(batches, parts, strict=True)
            if batch.sequence in claimed
            for part in routed
        ]
        self._write_parts(cur, queues, written)
        return [batch.sequence in claimed for batch in batches]

    def _write_parts(self, cur: Any, queues: Sequence[str], parts: Sequence[RoutedRows]) -> None:
        """Write ``parts`` (in queue order) into the tables they name, each table's rows in
        queue order; every table written becomes ``queues``' (the sink's own already is).

        Raises:
            SinkError: a part names a table this sink may not write, or one of another queue
                (permanent); as :meth:`TableWriter._write_targets`.
        """
        routed: dict[Target, list[pa.Table]] = {}
        for part in parts:
            target = self._route(cur, part.table)
            rows = routed.setdefault(target, [])
            if part.rows.num_rows:
                rows.append(part.rows)
        for target in routed:
            self._writing = target.table  # what a driver error names
            if target is not self._home:
                for queue in queues:
                    self._own(cur, queue, target)
        self._write_targets(cur, [(target, tables) for target, tables in routed.items() if tables])

    def _insert_progress(
        self, cur: Any, rows: Sequence[tuple[int, str, int]], now_ms: int, *, duplicate: bool
    ) -> list[tuple[Any, ...]]:
        """One multi-row INSERT of progress rows ``(sequence, location, row_count)``; returns
        the sequences actually inserted.

        Rows go in sequence order, so two consumers racing on overlapping groups take the
        row locks in the same order and cannot deadlock.
        """
        flag = "TRUE" if duplicate else "FALSE"
        groups: list[str] = []
        params: list[Any] = []
        p = self._param
        for sequence, location, count in rows:
            n = len(params)
            groups.append(f"({p(n + 1)}, {p(n + 2)}, {p(n + 3)}, {p(n + 4)}, {flag}, {p(n + 5)})")
            params.extend((str(self._table), sequence, location, count, now_ms))
        return self._fetch(
            cur,
            f"INSERT INTO {self._progress.sql} (target_table, sequence, location, row_count, "
            f"duplicate, committed_at_ms) VALUES {', '.join(groups)} "
            "ON CONFLICT DO NOTHING RETURNING sequence",
            tuple(params),
        )

    def _transaction(self, work: Callable[[Any], _T]) -> _T:
        # A few quick retries absorb the races of two consumers creating the same table and
        # a connection that dropped between writes; a database that stays down is the
        # caller's to wait out (the service backs off for as long as it takes).
        for attempt in range(_QUICK_RETRIES):
            try:
                return self._transaction_once(work)
            except SinkError as err:
                if not err.transient or attempt == _QUICK_RETRIES - 1:
                    raise
                # INFO: recovered at once, or the caller says it, once, as it backs off.
                logger.info("%s; retrying at once", err)
                time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def _transaction_once(self, work: Callable[[Any], _T]) -> _T:
        try:
            if self._conn is None:
                self._conn = self._open()
            cur = self._conn.cursor()
        except self._driver_errors() as err:
            self._drop_connection()
            raise self._translate(err) from err
        try:
            self._begin(cur)
            self._after_commit = []
            self._writing = None
            if not self._set_up:
                # In this transaction: work refused here (another queue's table) or rolled
                # back (a probe) takes the set-up with it, leaving nothing behind.
                self._setup(cur)
                self._after_commit.append(lambda: setattr(self, "_set_up", True))
            self._identify(cur)
            result = work(cur)
            cur.execute("COMMIT")
            for done in self._after_commit:
                done()
            return result
        except BaseException as err:
            for target in self._targets.values():
                target.columns = None  # DDL that rolled back must not stay cached
            self._after_commit = []
            try:
                cur.execute("ROLLBACK")
            except Exception:  # the connection is unusable; reopen next time
                self._drop_connection()
            if isinstance(err, self._driver_errors()):
                translated = self._translate(err)
                if translated.transient:
                    self._drop_connection()
                raise translated from err
            raise
        finally:
            _close_quietly(cur, "cursor")

    def _translate(self, err: Exception) -> SinkError:
        error_class = self._classify(err)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        for secret in self._secrets:
            # The driver quotes what it cannot parse; a short secret is hidden only there, or
            # a one-letter password would take every such letter out of the message.
            first = first.replace(f'"{secret}"', '"***"')
            if len(secret) >= _SECRET_ANYWHERE:
                first = first.replace(secret, "***")
        return SinkError(
            f"{self._description} table {self._writing or self._table}: "
            f"{type(err).__name__}: {first} "
            f"[{error_class}]",
            transient=error_class.transient,
        )

    def _setup(self, cur: Any) -> None:
        """Create the progress, quarantine and owners tables where missing, in the caller's
        transaction."""
        self._identify(cur)
        index = self._progress.sibling(LOCATION_INDEX_SUFFIX)
        if all(
            self._exists(cur, table)
            for table in (self._progress, index, self._quarantine, self._owners)
        ):
            # Nothing to create: no DDL, whose locks (PostgreSQL's CREATE INDEX takes a share
            # lock on the progress table) would last as long as the work of this transaction.
            return
        self._lock_setup(cur)
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {self._progress.sql} ("
            "target_table TEXT NOT NULL, sequence BIGINT NOT NULL, location TEXT NOT NULL, "
            "row_count BIGINT NOT NULL, duplicate BOOLEAN NOT NULL, "
            "committed_at_ms BIGINT NOT NULL, PRIMARY KEY (target_table, sequence))"
        )
        cur.execute(
            f"CREATE UNIQUE INDEX IF NOT EXISTS {quote(index.name)} "
            f"ON {self._progress.sql} (target_table, location) WHERE NOT duplicate"
        )
        self._create_owners(cur, self._owners)
        self._create_quarantine_table(cur)

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._home = None
        self._router = None
        self._targets = {}
        self._routes = {}
        self._set_up = False
        if conn is not None:
            _close_quietly(conn, "connection")


class _Undone(Exception):
    """Ends a transaction that must roll back (its work only read, or a probe), carrying
    its ``value``."""

    def __init__(self, value: int | None) -> None:
        super().__init__("rolled back on purpose")
        self.value = value


def _describe(batches: Sequence[ConsumedBatch]) -> str:
    if len(batches) == 1:
        return f"sequence {batches[0].sequence} ({batches[0].location})"
    return f"sequences {batches[0].sequence}..{batches[-1].sequence}"


def _close_quietly(closing: Any, what: str) -> None:
    try:
        closing.close()
    except Exception:  # closing a dead connection, or a cursor of one
        logger.debug("closing a %s failed", what, exc_info=True)
