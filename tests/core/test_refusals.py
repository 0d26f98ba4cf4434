"""A newcomer's store mistakes, each named by its real cause and where the value came from,
with its fix said once (issue 47).

Before: a bucket name with a '!' and a wrong secret key both read "the store rejected the
credentials … set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" with a line of raw XML, and a
secret given as an option beside an access key id from the environment was blamed on "an
access key from the environment".
"""

from __future__ import annotations

import os
import subprocess

import pytest

from millpond.errors import ConfigError, StoreAccessError
from millpond.localstack import S3Endpoint
from millpond.localstack._process import free_ports
from millpond.storage import open_store
from millpond.storage._backends import prepare
from tests.support import run_cli, unique_root


def _env(endpoint: S3Endpoint, **changes: str) -> dict[str, str]:
    """The endpoint's AWS_* variables and nothing else of AWS; the metadata service closed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(endpoint.env())
    env["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{free_ports(1)[0]}"
    env.update(changes)
    return env


def _doctor(url: str, env: dict[str, str]) -> tuple[str, str]:
    """``millpond doctor URL``: its credentials line and the fix under it."""
    done: subprocess.CompletedProcess[str] = run_cli("doctor", url, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    failed = next(i for i, line in enumerate(lines) if line.startswith("FAIL"))
    fixes = [line.strip() for line in lines if line.strip().startswith("fix:")]
    assert len(fixes) == 1, done.stdout
    assert "<?xml" not in done.stdout, done.stdout
    fix = lines[failed + 1].strip()
    assert fix.removeprefix("fix: ") not in lines[failed]  # the fix is said once
    return lines[failed], fix


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (
            "s3://my_bucket!/q",
            "store: s3://my_bucket!/q: bucket name 'my_bucket!' holds '_' and '!': S3 bucket "
            "names hold only lowercase letters, digits, '.' and '-'; fix the store URL",
        ),
        (
            "az://My-Container/q",
            "store: az://My-Container/q: container name 'My-Container' holds 'M' and 'C': "
            "Azure container names hold only lowercase letters, digits and '-'; fix the store URL",
        ),
        (
            "gs://my bucket/q",
            "store: gs://my bucket/q: bucket name 'my bucket' holds ' ': GCS bucket names hold "
            "only lowercase letters, digits, '.', '-' and '_'; fix the store URL",
        ),
    ],
)
def test_a_bucket_name_no_store_allows_is_refused_before_any_request(url: str, said: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url, {"aws_endpoint": "http://127.0.0.1:1"})  # a closed port: no request
    assert str(info.value) == said


def test_the_command_line_refuses_it_as_bad_usage(seaweedfs_s3: S3Endpoint) -> None:
    done = run_cli("doctor", "s3://my_bucket!/q", env=_env(seaweedfs_s3))
    assert done.returncode == 2
    assert done.stderr == (
        "millpond doctor: error: store: s3://my_bucket!/q: bucket name 'my_bucket!' holds '_' "
        "and '!': S3 bucket names hold only lowercase letters, digits, '.' and '-'; fix the "
        "store URL\n"
    )


def test_a_name_only_old_buckets_have_is_tried_and_its_rule_named_when_missing(
    seaweedfs_s3: S3Endpoint,
) -> None:
    """S3 served capitals and '_' in names made before 2018: such a name is asked for, and
    when there is no such bucket the fix says why the name may be wrong."""
    failed, fix = _doctor("s3://My_Bucket/q", _env(seaweedfs_s3))
    assert failed.split(None, 2)[1:] == [
        "bucket",
        "s3://My_Bucket/q: bucket 'My_Bucket' does not exist",
    ]
    assert fix == (
        "fix: create the bucket, or fix the store URL (bucket name 'My_Bucket' holds 'M', '_' "
        "and 'B': S3 bucket names hold only lowercase letters, digits, '.' and '-')"
    )


def test_a_wrong_secret_key_is_named_with_its_variable(seaweedfs_s3: S3Endpoint) -> None:
    failed, fix = _doctor(
        seaweedfs_s3.url_for(unique_root()), _env(seaweedfs_s3, AWS_SECRET_ACCESS_KEY="wrong")
    )
    assert failed.startswith("FAIL  credentials")
    assert failed.endswith(
        "/_millpond_check: the store rejected the secret key (AWS_SECRET_ACCESS_KEY from the "
        "environment): the request's signature does not match, so it is not the secret of the "
        "access key id (AWS_ACCESS_KEY_ID from the environment) (the store answered 403 "
        "SignatureDoesNotMatch)"
    )
    assert fix == (
        "fix: set AWS_SECRET_ACCESS_KEY to the secret of the access key id in AWS_ACCESS_KEY_ID"
    )


def test_an_unknown_access_key_id_is_named_with_its_variable(seaweedfs_s3: S3Endpoint) -> None:
    failed, fix = _doctor(
        seaweedfs_s3.url_for(unique_root()), _env(seaweedfs_s3, AWS_ACCESS_KEY_ID="nobody")
    )
    assert failed.endswith(
        "the store does not know the access key id (AWS_ACCESS_KEY_ID from the environment) "
        "(the store answered 403 InvalidAccessKeyId)"
    )
    assert fix == (
        "fix: set AWS_ACCESS_KEY_ID to an access key id of this store (and "
        "AWS_SECRET_ACCESS_KEY to its secret)"
    )


def test_a_spark_option_secret_beside_an_environment_key_id_is_blamed_on_the_option(
    seaweedfs_s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the Spark driver runs before any task (``SparkWriteSettings.probe``), with
    ``.option("aws_secret_access_key", …)`` wrong and the access key id from the
    environment."""
    from millpond.producer.spark.options import SparkWriteSettings

    for name, value in _env(seaweedfs_s3).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    settings = SparkWriteSettings.from_options(
        {"path": seaweedfs_s3.url_for(unique_root()), "aws_secret_access_key": "wrong"}
    )
    with pytest.raises(StoreAccessError) as info:
        settings.probe()
    assert info.value.problem == "credentials"
    assert "an access key from the environment" not in str(info.value)
    assert info.value.message.endswith(
        ": the store rejected the secret key (store option aws_secret_access_key): the "
        "request's signature does not match, so it is not the secret of the access key id "
        "(AWS_ACCESS_KEY_ID from the environment) (the store answered 403 SignatureDoesNotMatch)"
    )
    assert info.value.hint == (
        "set the store option aws_secret_access_key to the secret of the access key id in "
        "AWS_ACCESS_KEY_ID"
    )


def test_an_access_key_in_two_places_names_both() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIA"}
    mixed = prepare("s3", {"aws_secret_access_key": "x"}, env)
    assert mixed.credential_source == (
        "an access key from the environment (AWS_ACCESS_KEY_ID) with its secret from "
        "store_options (secret_access_key)"
    )
    assert mixed.credential_parts == {
        "access key id": "AWS_ACCESS_KEY_ID from the environment",
        "secret key": "store option aws_secret_access_key",
    }
    assert "x" not in repr(mixed.credential_parts)
