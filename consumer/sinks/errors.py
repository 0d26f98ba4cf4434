"""Database errors classified once, by table: transient (retry with backoff) or permanent.

A transient error means the database cannot take the batch *now* (the connection dropped,
a lock or a serialization conflict, a full disk, the server shutting down): the transaction
rolled back, so the same batch is retried with backoff until it lands. A permanent error
means it never will as things stand (bad data, a type or name the table refuses, missing
privileges): the consumer stops and names the batch, and an operator fixes the cause.

PostgreSQL errors carry a SQLSTATE (``err.sqlstate`` on ADBC errors): :data:`POSTGRES_CODES`
classifies exact codes first, then :data:`POSTGRES_CLASSES` the two-character class. An error
without a SQLSTATE happened below SQL, on the connection (ADBC ``OperationalError``, status
``IO``): transient, unless its text is the server refusing the connection for good (a
missing database or role, a rejected password: ``_CONNECT_REFUSALS``) or a URL libpq cannot
parse; any other ADBC error without one is the driver refusing the data: permanent.

SQLite errors: ``adbc-driver-sqlite`` (1.13) fills neither ``vendor_code`` nor ``sqlstate``;
its message carries SQLite's own text for the result code (``sqlite3_errstr``, stable across
versions), so :data:`SQLITE_CODES` maps each primary result code to that text and to its
class. A ``vendor_code``, should a driver version fill it, wins over the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "POSTGRES_CLASSES",
    "POSTGRES_CODES",
    "SQLITE_CODES",
    "ErrorClass",
    "classify_postgres",
    "classify_sqlite",
]


@dataclass(frozen=True, slots=True)
class ErrorClass:
    """What a database error means for the batch being written."""

    code: str
    """The SQLSTATE, or ``SQLITE_<NAME>``, or ``connection`` / ``driver``."""
    name: str
    """The condition name (``serialization_failure``, ``SQLITE_BUSY``, ...)."""
    transient: bool
    """Retry the same batch later (``True``) or stop and name it (``False``)."""

    def __str__(self) -> str:
        return f"{self.code} {self.name}, {'transient' if self.transient else 'permanent'}"


T, P = True, False

POSTGRES_CODES: dict[str, tuple[str, bool]] = {
    # Inside transient classes, the codes that retrying cannot fix.
    "08P01": ("protocol_violation", P),  # malformed COPY data: the same bytes fail again
    "57P04": ("database_dropped", P),
    "58P01": ("undefined_file", P),
    "58P02": ("duplicate_file", P),
    "53400": ("configuration_limit_exceeded", P),  # temp_file_limit & co: a setting to raise
    "40002": ("transaction_integrity_constraint_violation", P),  # a deferred constraint
    # Inside permanent classes, the codes that clear up by themselves.
    "55P03": ("lock_not_available", T),  # lock_timeout, NOWAIT
    "55006": ("object_in_use", T),
    "25006": ("read_only_sql_transaction", T),  # a standby: the primary is being failed over
    "57014": ("query_canceled", T),  # statement_timeout, pg_cancel_backend
    # Every CREATE the sink sends says IF NOT EXISTS, which turns an existing relation into a
    # notice: duplicate_table comes only from another session creating it at the same moment
    # (seen in CI: two consumers' first writes racing), and the retry finds it created.
    "42P07": ("duplicate_table (concurrent CREATE ... IF NOT EXISTS)", T),
}
"""Exact SQLSTATEs whose class differs from their class's default."""

POSTGRES_CLASSES: dict[str, tuple[str, bool]] = {
    "08": ("connection_exception", T),
    "40": ("transaction_rollback", T),  # serialization_failure, deadlock_detected
    "53": ("insufficient_resources", T),  # disk_full, out_of_memory, too_many_connections
    "57": ("operator_intervention", T),  # admin_shutdown, crash_shutdown, cannot_connect_now
    "58": ("system_error", T),  # io_error
    "0A": ("feature_not_supported", P),
    "22": ("data_exception", P),
    "23": ("integrity_constraint_violation", P),
    "25": ("invalid_transaction_state", P),
    "28": ("invalid_authorization_specification", P),
    "3D": ("invalid_catalog_name", P),
    "3F": ("invalid_schema_name", P),
    "42": ("syntax_error_or_access_rule_violation", P),  # duplicate_column, undefined_table
    "54": ("program_limit_exceeded", P),  # too many columns
    "55": ("object_not_in_prerequisite_state", P),
    "XX": ("internal_error", P),  # data_corrupted, index_corrupted
}
"""SQLSTATE classes (first two characters). A class not listed is permanent."""

SQLITE_CODES: dict[int, tuple[str, str, bool]] = {
    1: ("SQLITE_ERROR", "SQL logic error", P),  # duplicate column, no such table, ...
    2: ("SQLITE_INTERNAL", "internal logic error", P),
    3: ("SQLITE_PERM", "access permission denied", P),
    4: ("SQLITE_ABORT", "query aborted", T),
    5: ("SQLITE_BUSY", "database is locked", T),  # another process holds the lock
    6: ("SQLITE_LOCKED", "database table is locked", T),
    7: ("SQLITE_NOMEM", "out of memory", T),
    8: ("SQLITE_READONLY", "attempt to write a readonly database", P),
    9: ("SQLITE_INTERRUPT", "interrupted", T),
    10: ("SQLITE_IOERR", "disk I/O error", T),
    11: ("SQLITE_CORRUPT", "database disk image is malformed", P),
    13: ("SQLITE_FULL", "database or disk is full", T),  # also max_page_count reached
    14: ("SQLITE_CANTOPEN", "unable to open database file", T),
    15: ("SQLITE_PROTOCOL", "locking protocol", T),
    17: ("SQLITE_SCHEMA", "database schema has changed", T),
    18: ("SQLITE_TOOBIG", "string or blob too big", P),
    19: ("SQLITE_CONSTRAINT", "constraint failed", P),
    20: ("SQLITE_MISMATCH", "datatype mismatch", P),
    21: ("SQLITE_MISUSE", "bad parameter or other API misuse", P),
    22: ("SQLITE_NOLFS", "large file support is disabled", P),
    23: ("SQLITE_AUTH", "authorization denied", P),
    25: ("SQLITE_RANGE", "column index out of range", P),
    26: ("SQLITE_NOTADB", "file is not a database", P),
}
"""SQLite primary result codes: name, the text SQLite reports for it, transient."""

# Texts SQLite reports instead of ``sqlite3_errstr`` for some codes (``sqlite3_errmsg``).
_SQLITE_MESSAGES: tuple[tuple[str, int], ...] = (
    ("constraint failed", 19),  # "UNIQUE constraint failed: t.a", "NOT NULL constraint ..."
    ("database is locked", 5),
    ("database table is locked", 6),
    ("database schema is locked", 6),
    ("disk i/o error", 10),
)


# What libpq says of a connection URL it cannot parse, before it tries any server: retrying
# cannot help (fe-connect.c's URI and option parsers).
_BAD_CONNECTION_URL = re.compile(
    r"invalid (?:URI|percent-encoded token|connection option|integer value|port number"
    r"|\w+ value)|(?:missing|extra) key/value separator|unexpected character .* in URI"
    r"|end of string reached when looking for matching|IPv6 host address may not be empty"
    r"|forbidden value %00"
)


# What the server says when it refuses a connection, which libpq passes on as text: ADBC gives
# no SQLSTATE for a connection that never opened, so these are read from the message and
# classified as the same SQLSTATE would be once connected (a database dropped in a session is
# 57P04, permanent; the same database missing at connect time was retried for ever). Texts of
# a server whose ``lc_messages`` is not English are not recognised: they stay transient.
_CONNECT_REFUSALS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r'FATAL:\s+database ".*" does not exist'), "3D000"),
    (re.compile(r'FATAL:\s+role ".*" does not exist'), "28000"),
    (re.compile(r'FATAL:\s+role ".*" is not permitted to log in'), "28000"),
    (re.compile(r"FATAL:\s+no pg_hba\.conf entry"), "28000"),
    (re.compile(r"FATAL:\s+password authentication failed"), "28P01"),
    (re.compile(r"fe_sendauth: no password supplied"), "28P01"),
    (re.compile(r"FATAL:\s+permission denied for database"), "42501"),
)


def classify_postgres(
    sqlstate: str | None,
    *,
    connection_level: bool,
    constraint: str | None = None,
    message: str = "",
) -> ErrorClass:
    """The class of a PostgreSQL error.

    Args:
        sqlstate: the error's SQLSTATE, when the server sent one.
        connection_level: the driver failed below SQL (ADBC ``OperationalError`` or
            ``InterfaceError``); used only when there is no SQLSTATE.
        constraint: the constraint a violation names (``PG_DIAG_CONSTRAINT_NAME``).
        message: the driver's message; tells a connection URL libpq cannot parse, or a
            server refusing the connection for good (a missing database or role, a password
            or ``pg_hba.conf`` rule it rejects: permanent), from a server it cannot reach
            (transient).
    """
    if sqlstate:
        if sqlstate == "23505" and constraint and constraint.startswith("pg_"):
            # A unique index of the system catalog: two sessions created the same table (or
            # type) at once. The loser's retry finds it created.
            return ErrorClass(sqlstate, "unique_violation on the catalog (concurrent DDL)", T)
        if sqlstate in POSTGRES_CODES:
            name, transient = POSTGRES_CODES[sqlstate]
        else:
            name, transient = POSTGRES_CLASSES.get(sqlstate[:2], ("unclassified", P))
        return ErrorClass(sqlstate, name, transient)
    if connection_level:
        if _BAD_CONNECTION_URL.search(message):
            return ErrorClass("connection", "a connection URL libpq cannot parse", P)
        for refusal, code in _CONNECT_REFUSALS:
            if refusal.search(message):
                found = classify_postgres(code, connection_level=False)
                return ErrorClass(
                    code, f"{found.name} (the server refused the connection)", found.transient
                )
        return ErrorClass("connection", "connection failure (no SQLSTATE)", T)
    return ErrorClass("driver", "refused by the driver (no SQLSTATE)", P)


def classify_sqlite(vendor_code: int | None, message: str) -> ErrorClass:
    """The class of a SQLite error, from its result code or SQLite's text for it."""
    if vendor_code is not None and (vendor_code & 0xFF) in SQLITE_CODES:
        code = vendor_code & 0xFF  # an extended code's low byte is its primary code
    else:
        text = message.lower()
        errstrs = [(errstr.lower(), n) for n, (_, errstr, _) in SQLITE_CODES.items() if n != 1]
        texts = [*_SQLITE_MESSAGES, *errstrs]
        # Anything else (a prepare error: "duplicate column name", "no such table") is
        # SQLITE_ERROR, the generic code SQLite gives to statements that cannot run.
        code = next((candidate for fragment, candidate in texts if fragment in text), 1)
    name, _errstr, transient = SQLITE_CODES[code]
    return ErrorClass(f"result code {code}", name, transient)
