"""Fixtures for the consumer tests: a sink database per backend (SQLite file, PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from consumer_support import Database

from millpond.localstack import PostgresServer


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh target table in SQLite (a file under ``tmp_path``) or the session PostgreSQL."""
    if request.param == "sqlite":
        yield Database("sqlite", f"sqlite://{tmp_path / 'sink.db'}")
    else:
        server = request.getfixturevalue("postgres_server")
        yield Database("postgres", server.url)


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> Database:
    """A fresh target table in the session PostgreSQL only."""
    return Database("postgres", postgres_server.url)
