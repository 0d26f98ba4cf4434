"""Store checks (``millpond doctor``'s core) and the start-up preflight, on real servers.

Every check passes on moto, SeaweedFS, Azurite and fake-gcs-server; each failure names the
problem and a fix: missing credentials, a missing bucket, a store that ignores ``If-Match`` or
``If-None-Match``, a skewed clock. Tests without credentials point the AWS credential chain at
a closed loopback port (``AWS_METADATA_ENDPOINT``), so it never leaves the machine.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from millpond.errors import ConflictError, StoreAccessError
from millpond.formats.manifest import empty_manifest
from millpond.localstack import AzureEndpoint, GcsEndpoint, S3Endpoint
from millpond.localstack._process import free_ports
from millpond.storage import ForwardingStore, ObjectInfo, ObjectStore, open_store
from millpond.storage.checks import CheckResult, preflight, run_store_checks, store_clock_skew
from tests.support import unique_root

_ENDPOINTS = {
    "moto": "moto_s3",
    "seaweedfs": "seaweedfs_s3",
    "azurite": "azurite_blob",
    "gcs": "fake_gcs",
}
_NAMES = [
    "credentials",
    "bucket",
    "permissions",
    "conditional_create",
    "conditional_update",
    "clock_skew",
    "manifest",
]


@pytest.fixture(params=list(_ENDPOINTS))
def remote(request: pytest.FixtureRequest) -> ObjectStore:
    """A fresh root on each real server in turn."""
    endpoint = request.getfixturevalue(_ENDPOINTS[str(request.param)])
    return open_store(endpoint.url_for(unique_root()), endpoint.store_options())


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS_* variables, and the instance metadata service at a closed loopback port."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{free_ports(1)[0]}")


def _by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    assert [r.name for r in results] == _NAMES
    return {r.name: r for r in results}


def _keyless(endpoint: S3Endpoint) -> dict[str, str]:
    options = endpoint.store_options()
    del options["aws_access_key_id"], options["aws_secret_access_key"]
    return options


class IgnoresIfMatch(ForwardingStore):
    """A store whose conditional update writes unconditionally (as broken stores did)."""

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self.inner.put(path, data)


class IgnoresIfNoneMatch(ForwardingStore):
    """A store whose conditional create overwrites whatever is there."""

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        return self.inner.put(path, data)


def test_every_check_passes_on_every_real_server(remote: ObjectStore) -> None:
    checks = _by_name(run_store_checks(remote))
    assert all(c.status == "pass" for c in checks.values()), checks
    assert "accepted" in checks["credentials"].detail
    assert "If-None-Match" in checks["conditional_create"].detail
    assert "If-Match" in checks["conditional_update"].detail
    assert "no manifest yet" in checks["manifest"].detail
    # Nothing is left behind: the probes are deleted.
    assert remote.list() == []


def test_the_manifest_check_reads_a_real_manifest(remote: ObjectStore) -> None:
    remote.put("ingest/manifest", empty_manifest(epoch=3, next_sequence=7))
    checks = _by_name(run_store_checks(remote))
    assert checks["manifest"].status == "pass"
    assert "epoch 3, next sequence 7" in checks["manifest"].detail
    remote.put("ingest/manifest", b"not a manifest")
    broken = _by_name(run_store_checks(remote))["manifest"]
    assert broken.status == "fail"
    assert "millpond inspect" in broken.hint


def test_missing_credentials_fail_naming_where_they_were_looked_for(
    moto_s3: S3Endpoint, no_aws_credentials: None
) -> None:
    store = open_store(moto_s3.url_for(unique_root()), _keyless(moto_s3))
    began = time.monotonic()
    checks = _by_name(run_store_checks(store))
    assert time.monotonic() - began < 10
    assert checks["credentials"].status == "fail"
    assert "instance metadata" in checks["credentials"].detail
    assert "AWS_ACCESS_KEY_ID" in checks["credentials"].hint
    assert [c.status for c in checks.values()][1:] == ["skip"] * 6
    with pytest.raises(StoreAccessError) as info:
        preflight(store, write=True)
    assert info.value.problem == "credentials"


def test_credentials_never_appear_in_results(seaweedfs_s3: S3Endpoint) -> None:
    wrong = dataclasses.replace(seaweedfs_s3, secret_access_key="wrong-secret-value-123")
    store = open_store(wrong.url_for(unique_root()), wrong.store_options())
    checks = _by_name(run_store_checks(store))
    assert checks["credentials"].status == "fail"
    # The part the store rejected and where it was set, once; the fix only in the hint.
    assert "the store rejected the secret key (store option aws_secret_access_key)" in (
        checks["credentials"].detail
    )
    assert "access key id (store option aws_access_key_id)" in checks["credentials"].detail
    assert checks["credentials"].hint == (
        "set the store option aws_secret_access_key to the secret of the access key id in the "
        "store option aws_access_key_id"
    )
    assert checks["credentials"].hint not in checks["credentials"].detail
    text = repr(checks)
    assert "wrong-secret-value-123" not in text


def test_a_missing_bucket_fails_with_its_name(moto_s3: S3Endpoint) -> None:
    missing = dataclasses.replace(moto_s3, bucket=f"no-such-{unique_root()}")
    store = open_store(missing.url_for("q"), missing.store_options())
    checks = _by_name(run_store_checks(store))
    assert checks["credentials"].status == "pass"
    assert checks["bucket"].status == "fail"
    assert missing.bucket in checks["bucket"].detail
    assert "create the bucket" in checks["bucket"].hint
    with pytest.raises(StoreAccessError) as info:
        preflight(store, write=False)
    assert info.value.problem == "bucket"
    assert missing.bucket in str(info.value)


def test_a_missing_container_fails_with_its_name(azurite_blob: AzureEndpoint) -> None:
    missing = dataclasses.replace(azurite_blob, container="no-such-container")
    store = open_store(missing.url_for("q"), missing.store_options())
    bucket = _by_name(run_store_checks(store))["bucket"]
    assert bucket.status == "fail"
    assert "container 'no-such-container' does not exist" in bucket.detail


def test_a_store_that_ignores_if_match_fails_the_update_check(moto_s3: S3Endpoint) -> None:
    inner = open_store(moto_s3.url_for(unique_root()), moto_s3.store_options())
    checks = _by_name(run_store_checks(IgnoresIfMatch(inner)))
    assert checks["conditional_create"].status == "pass"
    update = checks["conditional_update"]
    assert update.status == "fail"
    assert "stale ETag (If-Match) was accepted" in update.detail
    assert "conditional writes" in update.hint
    with pytest.raises(StoreAccessError) as info:
        preflight(IgnoresIfMatch(inner), write=True)
    assert info.value.problem == "conditional_writes"
    preflight(IgnoresIfMatch(inner), write=False)  # a reader writes nothing: not checked


def test_a_store_that_ignores_if_none_match_fails_the_create_check(
    seaweedfs_s3: S3Endpoint,
) -> None:
    inner = open_store(seaweedfs_s3.url_for(unique_root()), seaweedfs_s3.store_options())
    checks = _by_name(run_store_checks(IgnoresIfNoneMatch(inner)))
    assert checks["conditional_create"].status == "fail"
    assert "If-None-Match: *" in checks["conditional_create"].detail
    assert checks["conditional_update"].status == "skip"


def test_preflight_passes_on_every_real_server_and_reads_the_store_clock(
    remote: ObjectStore,
) -> None:
    measured = preflight(remote, write=True, lists=False)
    assert measured is not None
    # Every local server shares this machine's clock.
    assert measured.skew_seconds <= 1.0, measured
    assert remote.list() == []  # the probe object is deleted
    # Once per store and process: passed, it is not sent again.
    assert preflight(remote, write=True, lists=False) is None


class RefusesButCreates(ForwardingStore):
    """Answers a second create-if-absent with a conflict, after overwriting anyway."""

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        try:
            return self.inner.put_if_absent(path, data)
        except ConflictError:
            self.inner.put(path, data)
            raise


class RefusesButUpdates(ForwardingStore):
    """Answers a stale If-Match update with a conflict, after writing it anyway."""

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        try:
            return self.inner.put_if_match(path, data, etag)
        except ConflictError:
            self.inner.put(path, data)
            raise


class RefusesEveryUpdate(ForwardingStore):
    """Refuses every conditional update: its ETags do not match its own (on the first manifest
    append a producer would lose every race, for ever)."""

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        raise ConflictError(f"{path}: changed since ETag {etag} was read")


@pytest.mark.parametrize(
    ("broken", "detail"),
    [
        (IgnoresIfNoneMatch, "a second create-if-absent (If-None-Match: *) of one object was"),
        (RefusesEveryUpdate, "an update conditional on the object's current ETag (If-Match) was"),
        (IgnoresIfMatch, "an update conditional on a stale ETag (If-Match) was accepted"),
        (RefusesButCreates, "a refused create-if-absent (If-None-Match: *) overwrote the"),
        (RefusesButUpdates, "a refused stale update (If-Match) overwrote the object anyway"),
    ],
)
def test_preflight_refuses_every_way_conditional_writes_can_be_broken(
    seaweedfs_s3: S3Endpoint, broken: type[ForwardingStore], detail: str
) -> None:
    inner = open_store(seaweedfs_s3.url_for(unique_root()), seaweedfs_s3.store_options())
    with pytest.raises(StoreAccessError) as info:
        preflight(broken(inner), write=True, lists=False)
    assert info.value.problem == "conditional_writes"
    assert detail in str(info.value)
    assert "conditional writes" in info.value.hint
    assert inner.list() == []  # the probe object is deleted all the same


class NoEtagOnWrite(ForwardingStore):
    """A store whose write answers carry no ETag (HEAD and GET still give it)."""

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        self.inner.put_if_absent(path, data)
        return None


class RespelledEtag(ForwardingStore):
    """A store that spells ETags differently in HEAD answers than in write answers."""

    def head(self, path: str) -> ObjectInfo:
        info = self.inner.head(path)
        return dataclasses.replace(info, etag=f"W/{info.etag}")


@pytest.mark.parametrize("quirk", [NoEtagOnWrite, RespelledEtag])
def test_preflight_passes_a_working_store_with_unusual_etags(
    moto_s3: S3Endpoint, quirk: type[ForwardingStore]
) -> None:
    inner = open_store(moto_s3.url_for(unique_root()), moto_s3.store_options())
    assert preflight(quirk(inner), write=True, lists=False) is not None
    assert inner.list() == []


def test_fake_gcs_server_without_its_proxy_fails_the_permission_check(
    fake_gcs: GcsEndpoint,
) -> None:
    # fake-gcs-server itself refuses the XML-API uploads obstore sends: doctor says so.
    direct = dataclasses.replace(fake_gcs, endpoint=fake_gcs.direct_url)
    store = open_store(direct.url_for(unique_root()), direct.store_options())
    checks = _by_name(run_store_checks(store))
    assert checks["bucket"].status == "pass"
    assert checks["permissions"].status == "fail"
    assert "put refused" in checks["permissions"].detail
    assert "invalid uploadType" in checks["permissions"].detail


class SkewedStore(ForwardingStore):
    """Reports last-modified times shifted by ``skew`` seconds, like a store whose clock is off."""

    def __init__(self, inner: ObjectStore, skew: float) -> None:
        super().__init__(inner)
        self.skew = skew

    def head(self, path: str):  # type: ignore[no-untyped-def]
        import datetime

        info = self.inner.head(path)
        assert info.last_modified is not None
        shifted = info.last_modified + datetime.timedelta(seconds=self.skew)
        return dataclasses.replace(info, last_modified=shifted)


def test_clock_skew_is_measured_and_judged(moto_s3: S3Endpoint) -> None:
    inner = open_store(moto_s3.url_for(unique_root()), moto_s3.store_options())
    assert abs(store_clock_skew(inner, "clock")) <= 1.0
    ahead = SkewedStore(inner, 120)
    assert 118 <= store_clock_skew(ahead, "clock") <= 121
    clock = _by_name(run_store_checks(ahead))["clock_skew"]
    assert clock.status == "fail"
    assert "ahead of this machine's" in clock.detail
    assert "NTP" in clock.hint
    behind = _by_name(run_store_checks(SkewedStore(inner, -5)))["clock_skew"]
    assert behind.status == "pass"
    assert "behind" in behind.detail


def test_preflight_waits_out_an_unreachable_store(no_aws_credentials: None) -> None:
    port = free_ports(1)[0]
    store = open_store(
        "s3://bucket/q",
        {
            "aws_endpoint": f"http://127.0.0.1:{port}",
            "aws_access_key_id": "k",
            "aws_secret_access_key": "s",
            "aws_region": "us-east-1",
        },
    )
    began = time.monotonic()
    preflight(store, write=True, timeout=5)  # no answer is not a refusal: no error
    assert time.monotonic() - began < 6
