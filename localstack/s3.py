"""Where an S3-compatible server is and how to sign in to it, in the forms each client wants.

:class:`S3Endpoint` is what every S3 server in this package hands out (moto, SeaweedFS, or an
external one named by ``MILLPOND_TEST_S3_*`` variables). Helpers here use boto3, which is only a
dependency of the local services, never of Millpond itself.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from millpond.localstack._process import LocalServiceError, StoreEndpoint, wait_for

__all__ = [
    "S3Endpoint",
    "ensure_bucket",
    "external_s3_from_env",
    "s3_client",
    "wait_until_writable",
]

logger = logging.getLogger(__name__)

_ENV_PREFIX = "MILLPOND_TEST_S3_"


@dataclass(frozen=True, slots=True, kw_only=True)
class S3Endpoint(StoreEndpoint):
    """An S3-compatible endpoint, a bucket on it and the credentials to use it."""

    endpoint: str
    """Base URL of the S3 API, e.g. ``http://127.0.0.1:43121`` (path-style addressing)."""
    bucket: str
    """Bucket name; it exists once a server hands the endpoint out."""
    access_key_id: str
    """Access key ID that requests are signed with."""
    secret_access_key: str = field(repr=False)
    """Secret key; left out of ``repr`` so it never lands in logs or test reports."""
    region: str = "us-east-1"
    """Signing region."""

    def __post_init__(self) -> None:
        for name in ("endpoint", "bucket", "access_key_id", "secret_access_key", "region"):
            if not getattr(self, name):
                raise ValueError(f"S3Endpoint.{name}: expected a non-empty string, found ''")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"S3Endpoint.endpoint: expected an http:// or https:// URL, found {self.endpoint!r}"
            )

    @property
    def url(self) -> str:
        """The bucket as a store URL, ``s3://{bucket}``."""
        return f"s3://{self.bucket}"

    def store_options(self) -> dict[str, str]:
        """Return obstore ``S3Config`` options for this endpoint.

        Returns:
            Keys ``aws_endpoint``, ``aws_access_key_id``, ``aws_secret_access_key``,
            ``aws_region``, ``aws_allow_http``, ``aws_virtual_hosted_style_request`` and
            ``aws_conditional_put`` (``"etag"``, which the queue manifest's CAS needs).
        """
        return {
            "aws_endpoint": self.endpoint,
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self.secret_access_key,
            "aws_region": self.region,
            "aws_allow_http": "true",
            "aws_virtual_hosted_style_request": "false",
            "aws_conditional_put": "etag",
        }

    def env(self) -> dict[str, str]:
        """Return the standard AWS environment variables for this endpoint.

        Suitable for child processes (producers, Spark executors, the CLI) that build their
        clients from the environment.

        Returns:
            ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
            ``AWS_REGION``, ``AWS_DEFAULT_REGION`` and ``AWS_ALLOW_HTTP``.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }


def external_s3_from_env(environ: Mapping[str, str] | None = None) -> S3Endpoint | None:
    """Return the external S3 endpoint named by ``MILLPOND_TEST_S3_*`` variables, if any.

    Lets the suite run against MinIO or AWS. ``MILLPOND_TEST_S3_ENDPOINT`` switches it on;
    ``MILLPOND_TEST_S3_ACCESS_KEY_ID`` and ``MILLPOND_TEST_S3_SECRET_ACCESS_KEY`` are then
    required, ``MILLPOND_TEST_S3_BUCKET`` defaults to ``millpond`` and
    ``MILLPOND_TEST_S3_REGION`` to ``us-east-1``. The bucket must already exist.

    Args:
        environ: the environment; defaults to ``os.environ``.

    Returns:
        The endpoint, or ``None`` when ``MILLPOND_TEST_S3_ENDPOINT`` is unset or empty.

    Raises:
        ValueError: the endpoint is set but a credential is missing.
    """
    env = os.environ if environ is None else environ
    endpoint = env.get(f"{_ENV_PREFIX}ENDPOINT", "")
    if not endpoint:
        return None
    missing = [
        f"{_ENV_PREFIX}{key}"
        for key in ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY")
        if not env.get(f"{_ENV_PREFIX}{key}")
    ]
    if missing:
        raise ValueError(
            f"{_ENV_PREFIX}ENDPOINT is set, so expected {' and '.join(missing)} too, found unset"
        )
    return S3Endpoint(
        endpoint=endpoint,
        bucket=env.get(f"{_ENV_PREFIX}BUCKET") or "millpond",
        access_key_id=env[f"{_ENV_PREFIX}ACCESS_KEY_ID"],
        secret_access_key=env[f"{_ENV_PREFIX}SECRET_ACCESS_KEY"],
        region=env.get(f"{_ENV_PREFIX}REGION") or "us-east-1",
    )


def s3_client(endpoint: S3Endpoint, *, timeout: float = 10.0) -> Any:
    """Return a boto3 S3 client for the endpoint (path-style, signed with its keys, no retries).

    Args:
        endpoint: where and as whom.
        timeout: connect and read timeout in seconds.

    Returns:
        A ``botocore`` S3 client.
    """
    import boto3  # local services only; Millpond itself never needs boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint.endpoint,
        aws_access_key_id=endpoint.access_key_id,
        aws_secret_access_key=endpoint.secret_access_key,
        region_name=endpoint.region,
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=timeout,
            read_timeout=timeout,
            retries={"max_attempts": 1, "mode": "standard"},
        ),
    )


def ensure_bucket(endpoint: S3Endpoint) -> None:
    """Create the endpoint's bucket unless it already exists (and is ours).

    Args:
        endpoint: where and which bucket.

    Raises:
        botocore.exceptions.ClientError: the server refused for another reason.
    """
    from botocore.exceptions import ClientError

    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=endpoint.bucket)
        logger.info("created bucket %s at %s", endpoint.bucket, endpoint.endpoint)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") not in {
            "BucketAlreadyOwnedByYou",
            "BucketAlreadyExists",
        }:
            raise


def wait_until_writable(
    endpoint: S3Endpoint,
    *,
    timeout: float,
    what: str,
    alive: Callable[[], str | None] | None = None,
) -> None:
    """Wait until the bucket takes a write, a read and a delete (a probe object, then gone).

    Listing buckets is not enough for SeaweedFS: its S3 gateway answers before the volume
    server has registered with the master, and the first write would fail.

    Args:
        endpoint: where and which bucket; the bucket must exist.
        timeout: seconds until giving up.
        what: names the server in the error message.
        alive: as in :func:`millpond.localstack._process.wait_for`.

    Raises:
        LocalServiceError: the bucket did not become writable in time.
    """
    client = s3_client(endpoint, timeout=5.0)
    key = f".localstack-probe/{uuid.uuid4().hex}"

    def probe() -> bool:
        client.put_object(Bucket=endpoint.bucket, Key=key, Body=b"probe")
        body = client.get_object(Bucket=endpoint.bucket, Key=key)["Body"].read()
        client.delete_object(Bucket=endpoint.bucket, Key=key)
        if body != b"probe":
            raise LocalServiceError(f"{what}: read back {body!r}, expected b'probe'")
        return True

    wait_for(probe, timeout=timeout, what=f"{what} bucket {endpoint.bucket}", alive=alive)
