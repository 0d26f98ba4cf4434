"""Each backend's options: plain HTTP for a local endpoint, and where credentials come from,
named without their values. Pure: no store is contacted."""

from __future__ import annotations

import json

import pytest

from millpond.errors import ConfigError
from millpond.storage import open_store
from millpond.storage._backends import backend_of, prepare


@pytest.mark.parametrize(
    ("url", "backend"),
    [("s3://b", "s3"), ("s3a://b/x", "s3"), ("az://c/r", "azure"), ("gs://b", "gcs"),
     ("file:///x", None), ("abfs://c", None), ("bucket", None)],
)  # fmt: skip
def test_backend_of(url: str, backend: str | None) -> None:
    assert backend_of(url) == backend


def test_s3_credentials_from_options_or_environment() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    from_env = prepare("s3", {}, env)
    assert from_env.credential_source == "an access key from the environment (AWS_ACCESS_KEY_ID)"
    given = prepare("s3", {"aws_access_key_id": "AKIA", "aws_secret_access_key": "x"}, {})
    assert given.credential_source == "an access key from store_options (access_key_id)"
    nothing = prepare("s3", {}, {})
    assert nothing.credential_source.startswith("the instance metadata service")
    assert "AWS_ACCESS_KEY_ID" in nothing.credential_hint
    for prepared in (from_env, given, nothing):
        assert "s3cr3t" not in repr(prepared)


def test_plain_http_only_for_an_http_endpoint() -> None:
    assert prepare("s3", {"aws_endpoint": "http://127.0.0.1:9000"}, {}).client["allow_http"]
    assert "allow_http" not in prepare("s3", {"aws_endpoint": "https://s3.example"}, {}).client
    azure = prepare("azure", {}, {"AZURE_STORAGE_ENDPOINT": "http://127.0.0.1:10000/acct"})
    assert azure.client["allow_http"] is True
    emulator = prepare("azure", {}, {"AZURE_STORAGE_USE_EMULATOR": "true"})
    assert emulator.client["allow_http"] is True
    assert emulator.credential_source == (
        "the emulator's well-known key from the environment (AZURE_STORAGE_USE_EMULATOR)"
    )
    key = json.dumps({"gcs_base_url": "http://127.0.0.1:4443", "disable_oauth": True})
    gcs = prepare("gcs", {"google_service_account_key": key}, {})
    assert gcs.client["allow_http"] is True
    assert gcs.credential_source == "a service-account key from store_options (service_account_key)"
    assert "allow_http" not in prepare("gcs", {}, {"GOOGLE_SERVICE_ACCOUNT": "/nope.json"}).client


def test_azure_and_gcs_credential_sources() -> None:
    assert prepare("azure", {}, {"AZURE_STORAGE_ACCOUNT_KEY": "k"}).credential_source == (
        "an account key from the environment (AZURE_STORAGE_ACCOUNT_KEY)"
    )
    assert prepare("azure", {"azure_storage_sas_key": "sv=x"}, {}).credential_source == (
        "a SAS token from store_options (sas_key)"
    )
    assert prepare("azure", {}, {}).credential_source.startswith("managed identity")
    assert prepare("gcs", {}, {"GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}).credential_source == (
        "application default credentials from the environment (GOOGLE_APPLICATION_CREDENTIALS)"
    )


def test_opening_azure_and_gcs_urls_sends_nothing() -> None:
    az = open_store("az://container/root", {"azure_storage_account_name": "acct",
                                            "azure_storage_account_key": "a2V5"})  # fmt: skip
    assert az.url == "az://container/root"
    assert "a2V5" not in repr(az)
    key = json.dumps(
        {"disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
    )
    gs = open_store("gs://bucket/root", {"google_service_account_key": key})
    assert gs.url == "gs://bucket/root"
    with pytest.raises(ConfigError) as missing:  # a key file that is not there: named at once
        open_store("gs://bucket/root", {"google_service_account": "/nonexistent.json"})
    assert "/nonexistent.json" in str(missing.value)
    with pytest.raises(ConfigError) as info:
        open_store("az://container", {"azure_no_such_option": "x"})
    assert info.value.key in ("store", "store_options")


@pytest.mark.parametrize(
    ("url", "options", "env", "named"),
    [
        ("s3://b/q", {"aws_endpoint": "127.0.0.1:9000"}, {}, "aws_endpoint"),
        ("s3://b/q", {"endpoint_url": "http://127.0.0.1:99999"}, {}, "endpoint_url"),
        ("s3://b/q", {"aws_endpoint": "http://[::1"}, {}, "aws_endpoint"),
        ("s3://b/q", {"aws_endpoint": ""}, {}, "aws_endpoint"),
        ("s3://b/q", {}, {"AWS_ENDPOINT_URL": "minio:9000"}, "AWS_ENDPOINT_URL"),
        ("gs://b/q", {"google_base_url": "127.0.0.1:4443"}, {}, "google_base_url"),
        ("gs://b/q", {}, {"GOOGLE_BASE_URL": "http//127.0.0.1:4443"}, "GOOGLE_BASE_URL"),
    ],
)
def test_an_endpoint_that_is_not_an_http_url_is_refused_at_open(
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    options: dict[str, str],
    env: dict[str, str],
    named: str,
) -> None:
    """obstore took these and panicked on the first request (a Rust trace, not an error)."""
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        open_store(
            url,
            {**options, "aws_access_key_id": "a", "aws_secret_access_key": "b"}
            if url.startswith("s3")
            else {**options, "google_skip_signature": "true"},
        )
    assert info.value.key == named
    assert "expected an http:// or https:// URL" in str(info.value)
    for fine in ("http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com"):
        assert prepare("s3", {"aws_endpoint": fine}, {}).config["aws_endpoint"] == fine
