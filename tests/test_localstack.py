"""The local services really start, answer, bind loopback only, enforce CAS, and stop cleanly."""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import adbc_driver_postgresql.dbapi as pg_dbapi
import obstore
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

from millpond.localstack import (
    LocalServiceError,
    MotoS3Server,
    PostgresServer,
    S3Endpoint,
    SeaweedFS,
    external_s3_from_env,
    find_weed_binary,
    listening_addresses,
    start_postgres,
)
from millpond.localstack import _child as child_module
from millpond.localstack._process import free_ports
from millpond.localstack.s3 import s3_client
from millpond.storage import open_store
from tests.support import StoreTarget

LOOPBACK = "127.0.0.1"


def _status(err: ClientError) -> int:
    status: int = err.response["ResponseMetadata"]["HTTPStatusCode"]
    return status


def _key() -> str:
    return f"test-localstack/{uuid.uuid4().hex}"


def _process_group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(params=["moto", "seaweedfs"])
def s3(request: pytest.FixtureRequest) -> S3Endpoint:
    """Each local S3 server in turn."""
    endpoint: S3Endpoint = request.getfixturevalue(f"{request.param}_s3")
    return endpoint


# --- S3Endpoint and configuration ------------------------------------------------------------


def test_endpoint_forms() -> None:
    endpoint = S3Endpoint(
        endpoint="http://127.0.0.1:9",
        bucket="b",
        access_key_id="AKID",
        secret_access_key="top-secret-value",
    )
    assert "top-secret-value" not in repr(endpoint)
    assert endpoint.url == "s3://b"
    assert endpoint.url_for("t-1") == "s3://b/t-1"
    assert endpoint.url_for("/t-1/") == "s3://b/t-1"
    assert endpoint.store_options() == {
        "aws_endpoint": "http://127.0.0.1:9",
        "aws_access_key_id": "AKID",
        "aws_secret_access_key": "top-secret-value",
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
        "aws_virtual_hosted_style_request": "false",
        "aws_conditional_put": "etag",
    }
    env = endpoint.env()
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert env["AWS_SECRET_ACCESS_KEY"] == "top-secret-value"
    assert env["AWS_ALLOW_HTTP"] == "true"


def test_endpoint_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        S3Endpoint(endpoint="127.0.0.1:9", bucket="b", access_key_id="a", secret_access_key="s")
    with pytest.raises(ValueError, match="bucket"):
        S3Endpoint(endpoint="http://h", bucket="", access_key_id="a", secret_access_key="s")


def test_external_s3_from_env() -> None:
    assert external_s3_from_env({}) is None
    endpoint = external_s3_from_env(
        {
            "MILLPOND_TEST_S3_ENDPOINT": "https://s3.eu-west-1.amazonaws.com",
            "MILLPOND_TEST_S3_BUCKET": "mine",
            "MILLPOND_TEST_S3_ACCESS_KEY_ID": "AKID",
            "MILLPOND_TEST_S3_SECRET_ACCESS_KEY": "secret",
            "MILLPOND_TEST_S3_REGION": "eu-west-1",
        }
    )
    assert endpoint == S3Endpoint(
        endpoint="https://s3.eu-west-1.amazonaws.com",
        bucket="mine",
        access_key_id="AKID",
        secret_access_key="secret",
        region="eu-west-1",
    )
    with pytest.raises(ValueError, match="MILLPOND_TEST_S3_SECRET_ACCESS_KEY"):
        external_s3_from_env(
            {"MILLPOND_TEST_S3_ENDPOINT": "http://h", "MILLPOND_TEST_S3_ACCESS_KEY_ID": "a"}
        )


def test_free_ports_are_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8


# --- both S3 servers ---------------------------------------------------------------------------


def test_s3_put_get_list(s3: S3Endpoint) -> None:
    client = s3_client(s3)
    prefix = _key()
    for i in range(3):
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/{i}", Body=f"body-{i}".encode())
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{prefix}/{i}" for i in range(3)]
    assert client.get_object(Bucket=s3.bucket, Key=f"{prefix}/1")["Body"].read() == b"body-1"


def test_s3_if_none_match_creates_only_once(s3: S3Endpoint) -> None:
    client = s3_client(s3)
    key = _key()
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert _status(caught.value) == 412
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"first"


def test_s3_if_match_updates_only_unchanged(s3: S3Endpoint) -> None:
    client = s3_client(s3)
    key = _key()
    stale = client.put_object(Bucket=s3.bucket, Key=key, Body=b"v1")["ETag"]
    current = client.put_object(Bucket=s3.bucket, Key=key, Body=b"v2", IfMatch=stale)["ETag"]
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"lost", IfMatch=stale)
    assert _status(caught.value) == 412
    response = client.put_object(Bucket=s3.bucket, Key=key, Body=b"v3", IfMatch=current)
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"v3"


def test_s3_if_match_on_missing_key_fails(s3: S3Endpoint) -> None:
    # AWS and moto answer 404 NoSuchKey; SeaweedFS answers 412. Either way nothing is written.
    client = s3_client(s3)
    key = _key()
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"x", IfMatch='"0123456789abcdef"')
    assert _status(caught.value) in {404, 412}
    with pytest.raises(ClientError):
        client.head_object(Bucket=s3.bucket, Key=key)


def _race(
    clients: list[Any], bucket: str, key: str, condition: dict[str, str]
) -> tuple[list[int], list[int]]:
    """Release one conditional PUT per client at once; return winners and losers' statuses."""
    barrier = threading.Barrier(len(clients))
    winners: list[int] = []
    losers: list[int] = []

    def contend(i: int) -> None:
        barrier.wait()
        try:
            clients[i].put_object(Bucket=bucket, Key=key, Body=f"c{i}".encode(), **condition)
            winners.append(i)
        except ClientError as err:
            losers.append(_status(err))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return winners, losers


@pytest.mark.parametrize("condition", ["if-none-match", "if-match"])
def test_s3_conditional_put_has_one_winner_under_contention(s3: S3Endpoint, condition: str) -> None:
    """Racing conditional PUTs on one key: exactly one may win, or the manifest CAS breaks."""
    contenders, rounds = 4, 3
    clients = [s3_client(s3) for _ in range(contenders)]
    for _ in range(rounds):
        key = _key()
        headers = {"IfNoneMatch": "*"}
        if condition == "if-match":
            base = clients[0].put_object(Bucket=s3.bucket, Key=key, Body=b"base")["ETag"]
            headers = {"IfMatch": base}
        winners, losers = _race(clients, s3.bucket, key, headers)
        assert len(winners) == 1, f"{len(winners)} winners, losers answered {losers}"
        assert set(losers) <= {409, 412}
        body = clients[0].get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        assert body == f"c{winners[0]}".encode()


def test_s3_store_options_work_with_obstore(s3: S3Endpoint) -> None:
    """The options the store adapter receives give working conditional puts through obstore."""
    store = S3Store(s3.bucket, prefix=_key(), config=s3.store_options())
    first = obstore.put(store, "manifest", b"v1", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "manifest", b"again", mode="create")
    second = obstore.put(store, "manifest", b"v2", mode={"e_tag": first["e_tag"]})
    with pytest.raises(PreconditionError):
        obstore.put(store, "manifest", b"lost", mode={"e_tag": first["e_tag"]})
    obstore.put(store, "manifest", b"v3", mode={"e_tag": second["e_tag"]})
    assert bytes(obstore.get(store, "manifest").bytes()) == b"v3"


def test_store_target_is_fresh(store_target: StoreTarget) -> None:
    if store_target.kind == "memory":
        # A named memory store, fresh per test: nothing in it yet.
        assert store_target.url.startswith("memory://t-")
        assert open_store(store_target.url).list() == []
        return
    assert store_target.root.rsplit("/", 1)[-1].startswith("t-")
    if store_target.kind == "file":
        assert store_target.url.startswith("file:///")
        assert not any(store_target.local_path().iterdir())
        return
    assert store_target.endpoint is not None
    assert store_target.url == f"s3://{store_target.endpoint.bucket}/{store_target.root}"
    listed = s3_client(store_target.endpoint).list_objects_v2(
        Bucket=store_target.endpoint.bucket, Prefix=f"{store_target.root}/"
    )
    assert listed["KeyCount"] == 0


# --- moto --------------------------------------------------------------------------------------


def test_moto_binds_loopback(moto_server: MotoS3Server) -> None:
    assert moto_server.endpoint.endpoint == f"http://{LOOPBACK}:{moto_server.port}"
    assert (LOOPBACK, moto_server.port) in listening_addresses(os.getpid())


def test_moto_stop_start_keeps_data_and_port(moto_server: MotoS3Server) -> None:
    endpoint = moto_server.endpoint
    client = s3_client(endpoint, timeout=2.0)
    key = _key()
    client.put_object(Bucket=endpoint.bucket, Key=key, Body=b"kept")
    moto_server.stop()
    try:
        assert (LOOPBACK, endpoint_port(endpoint)) not in listening_addresses(os.getpid())
        # The pooled keep-alive connection was cut too: this is a real outage.
        with pytest.raises(EndpointConnectionError):
            client.get_object(Bucket=endpoint.bucket, Key=key)
    finally:
        moto_server.start()
    assert moto_server.endpoint == endpoint
    assert client.get_object(Bucket=endpoint.bucket, Key=key)["Body"].read() == b"kept"


def endpoint_port(endpoint: S3Endpoint) -> int:
    return int(endpoint.endpoint.rsplit(":", 1)[1])


# --- SeaweedFS ---------------------------------------------------------------------------------


def test_weed_binary_found() -> None:
    weed = find_weed_binary()
    assert os.access(weed, os.X_OK)


def test_seaweedfs_listens_on_loopback_only(seaweedfs_server: SeaweedFS) -> None:
    assert seaweedfs_server.pid is not None
    addresses = listening_addresses(seaweedfs_server.pid)
    assert addresses, "weed holds no listening sockets"
    assert {ip for ip, _ in addresses} == {LOOPBACK}
    assert {port for _, port in addresses} == set(seaweedfs_server.ports.values())


def test_seaweedfs_requires_the_configured_keys(seaweedfs_s3: S3Endpoint) -> None:
    wrong = S3Endpoint(
        endpoint=seaweedfs_s3.endpoint,
        bucket=seaweedfs_s3.bucket,
        access_key_id=seaweedfs_s3.access_key_id,
        secret_access_key="not-the-secret",
    )
    with pytest.raises(ClientError) as caught:
        s3_client(wrong).put_object(Bucket=wrong.bucket, Key=_key(), Body=b"x")
    assert _status(caught.value) == 403


def test_seaweedfs_stop_start_keeps_data_and_cleans_up(tmp_path: Path) -> None:
    server = SeaweedFS(data_dir=tmp_path / "weed")
    server.start()
    try:
        endpoint, ports = server.endpoint, server.ports
        client = s3_client(endpoint, timeout=2.0)
        key = _key()
        etag = client.put_object(Bucket=endpoint.bucket, Key=key, Body=b"kept")["ETag"]
        first_pid = server.pid
        assert first_pid is not None
        server.stop(timeout=0)  # a crash: SIGKILL straight away
        assert _process_group_gone(first_pid)
        with pytest.raises(EndpointConnectionError):
            client.get_object(Bucket=endpoint.bucket, Key=key)
        server.start()
        assert (server.endpoint, server.ports) == (endpoint, ports)
        assert client.get_object(Bucket=endpoint.bucket, Key=key)["Body"].read() == b"kept"
        # The CAS state survived too: the old ETag still guards the object.
        client.put_object(Bucket=endpoint.bucket, Key=key, Body=b"v2", IfMatch=etag)
        second_pid = server.pid
        assert second_pid is not None
    finally:
        server.stop(timeout=1.0)  # the polite path: SIGTERM, then SIGKILL
    assert _process_group_gone(second_pid)
    assert not server.running
    for name in ("master.grpc", "volume.grpc", "filer.grpc", "s3.grpc"):
        kind = name.split(".")[0]
        assert not Path(f"/tmp/seaweedfs-{kind}-grpc-{ports[name]}.sock").exists()
    assert not list(Path("/tmp").glob(f"weed.*.{second_pid}")), "glog wrote into /tmp"


def test_seaweedfs_start_failure_reports_log_tail(tmp_path: Path) -> None:
    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'no storage for you' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    server = SeaweedFS(data_dir=tmp_path / "data", binary=fake)
    with pytest.raises(LocalServiceError, match=r"(?s)exited with code 3.*no storage for you"):
        server.start(timeout=10)
    assert not server.running


# --- PostgreSQL --------------------------------------------------------------------------------


def test_postgres_answers_through_adbc(postgres_server: PostgresServer) -> None:
    assert (
        postgres_server.url == f"postgresql://postgres@{LOOPBACK}:{postgres_server.port}/millpond"
    )
    with pg_dbapi.connect(postgres_server.url) as conn, conn.cursor() as cursor:
        cursor.execute("SELECT current_database(), current_setting('fsync'), 6 * 7")
        assert cursor.fetchall() == [("millpond", "on", 42)]


def test_postgres_listens_on_loopback_only(postgres_server: PostgresServer) -> None:
    assert postgres_server.pid is not None
    assert listening_addresses(postgres_server.pid) == [(LOOPBACK, postgres_server.port)]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root has to switch to the postgres user")
def test_postgres_runs_as_postgres_user_when_root(postgres_server: PostgresServer) -> None:
    assert postgres_server.pid is not None
    assert os.stat(f"/proc/{postgres_server.pid}").st_uid == pwd.getpwnam("postgres").pw_uid


def test_postgres_stop_leaves_nothing_behind(postgres_server: PostgresServer) -> None:
    # postgres_server is requested only to skip when the binaries are missing.
    server = start_postgres()
    pid, root = server.pid, server.root
    assert pid is not None
    assert root is not None
    server.stop()
    assert _process_group_gone(pid)
    assert not root.exists()
    assert not server.running
    server.stop()  # idempotent


def test_postgres_retries_when_its_port_is_taken(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # postgres_server is requested only to skip when the binaries are missing.
    with socket.create_server((LOOPBACK, 0)) as squatter:
        taken = squatter.getsockname()[1]
        real_free_ports = child_module.free_ports
        offers = iter([[taken]])
        monkeypatch.setattr(
            child_module, "free_ports", lambda n: next(offers, None) or real_free_ports(n)
        )
        with start_postgres() as server:
            assert server.port != taken
            assert listening_addresses(server.pid or 0) == [(LOOPBACK, server.port)]


# --- interpreter exit --------------------------------------------------------------------------

_FORGETFUL_SCRIPT = """
import json
from millpond.localstack import start_postgres, start_seaweedfs
weed = start_seaweedfs()
pg = start_postgres()
print(json.dumps({"pids": [weed.pid, pg.pid], "dirs": [str(weed.root), str(pg.root)]}))
# exits without stop() or close()
"""


def test_services_left_open_are_closed_at_exit(postgres_server: PostgresServer) -> None:
    # postgres_server is requested only to skip when the binaries are missing.
    result = subprocess.run(
        [sys.executable, "-c", _FORGETFUL_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    left = json.loads(result.stdout.strip().splitlines()[-1])
    for pid in left["pids"]:
        assert _process_group_gone(pid)
    for directory in left["dirs"]:
        assert not Path(directory).exists()
