"""The one reading of a sink URL, for every command that takes ``--sink``.

``consume``, ``status``, ``doctor``, ``quarantine`` and ``replay`` (and :func:`open_sink`) all
parse ``--sink`` here, so a URL one of them takes, every one of them takes, and means the same
database:

* ``sqlite:///absolute/path.db[?busy_timeout_ms=N]``; ``sqlite:////absolute/path.db`` (what
  the demo prints: an absolute path after ``sqlite:///``) is the same file. The file is created
  on first use, its directory never: a directory that does not exist is a typo, refused naming
  it before anything is written anywhere;
* ``postgresql://user@host:port/database[?...]`` (or ``postgres://``): libpq's URL, passed on
  as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, unquote, urlsplit

from millpond.errors import ConfigError

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_MS",
    "SinkUrl",
    "parse_sink_url",
    "postgres_url",
    "redact",
    "secrets",
    "sqlite_database_path",
]

DEFAULT_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another process's lock before SQLite reports "busy"."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkUrl:
    """A parsed ``--sink``."""

    kind: Literal["sqlite", "postgresql"]
    url: str
    """As given (for PostgreSQL, what libpq is handed)."""
    path: Path | None = None
    """SQLite: the database file, absolute."""
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS
    """SQLite: ``?busy_timeout_ms=``."""


def parse_sink_url(url: str) -> SinkUrl:
    """Read a sink URL (see the module doc).

    Raises:
        ConfigError: an unsupported URL, an unknown option, a relative SQLite path, or a SQLite
            path whose directory does not exist (named).
    """
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is not None and parts.scheme == "sqlite":
        path = unquote(parts.path)
        if parts.netloc or not path.startswith("/"):
            raise ConfigError("sink", f"expected sqlite:///absolute/path.db, found {url!r}")
        query = parse_qs(parts.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"busy_timeout_ms"})
        if unknown:
            raise ConfigError("sink", f"expected only busy_timeout_ms in {url!r}, found {unknown}")
        timeout = query.get("busy_timeout_ms", [str(DEFAULT_BUSY_TIMEOUT_MS)])[-1]
        if not (timeout.isascii() and timeout.isdigit()):  # not "²"
            raise ConfigError(
                "busy_timeout_ms", f"expected milliseconds (an integer), found {timeout!r}"
            )
        return SinkUrl(
            kind="sqlite",
            url=url,
            path=sqlite_database_path(path),
            busy_timeout_ms=int(timeout),
        )
    if parts is not None and parts.scheme in ("postgresql", "postgres"):
        return SinkUrl(kind="postgresql", url=postgres_url(url))
    shown = redact(url) if isinstance(url, str) else url
    raise ConfigError("sink", f"expected a sqlite:/// or postgresql:// URL, found {shown!r}")


def sqlite_database_path(path: str | Path) -> Path:
    """``path`` as the SQLite database file it names, checked: absolute paths keep one leading
    slash (``//tmp/x.db`` is ``/tmp/x.db``, as the kernel reads it), and its directory must
    exist.

    Raises:
        ConfigError: an empty path or ``:memory:``, a directory, or a missing directory.
    """
    text = str(path)
    if text in ("", ":memory:"):
        raise ConfigError("sink", f"expected a database file path, found {text!r}")
    if text.startswith("//"):
        text = "/" + text.lstrip("/")
    database = Path(text)
    if database.is_dir():
        raise ConfigError("sink", f"expected an SQLite database file, found a directory {text}")
    parent = database.absolute().parent
    if not parent.is_dir():
        # A mistyped path must not make a new database (nor its directories) and take a queue
        # over into it: the database file is created on first use, its directory never.
        raise ConfigError(
            "sink",
            f"expected an existing directory for the SQLite database {text}, found no "
            f"directory {parent}",
        )
    return database


def postgres_url(url: str) -> str:
    """``url`` checked as a PostgreSQL sink URL (libpq parses the rest when it connects).

    Raises:
        ConfigError: not ``postgresql://`` or ``postgres://`` with a host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
        raise ConfigError(
            "sink", f"expected postgresql://user@host:port/database, found {redact(url)!r}"
        )
    return url


def redact(url: str) -> str:
    """The URL without its passwords (credentials never reach logs or errors).

    Done on the text, not on a parse: a password with a ``#``, ``?`` or ``/`` left unescaped
    ends the URL's authority early for :func:`~urllib.parse.urlsplit`, which then finds no
    password at all. Everything between ``user:`` and the last ``@`` goes, and the value of a
    ``password`` or ``sslpassword`` query parameter (libpq reads both).
    """
    split = _split_password(url)
    if split is not None:
        url = f"{split[0]}***{split[2]}"
    return _PASSWORD_PARAMETER.sub(r"\1***", url)


def secrets(url: str) -> list[str]:
    """What of ``url`` :func:`redact` hides, as written and percent-decoded (libpq's messages
    quote a value it could not decode)."""
    split = _split_password(url)
    found = [split[1]] if split is not None else []
    found += [m.group(2) for m in _PASSWORD_PARAMETER.finditer(url)]
    found += [unquote(secret) for secret in found]
    return sorted({secret for secret in found if secret}, key=len, reverse=True)


def _split_password(url: str) -> tuple[str, str, str] | None:
    """``(up to "user:", the password, from the last "@")``, or ``None`` without one."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return None
    userinfo, at, host = rest.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return (f"{scheme}{sep}{user}:", password, f"{at}{host}") if colon else None


_PASSWORD_PARAMETER = re.compile(r"(?i)([?&](?:ssl)?password=)([^&#]*)")
