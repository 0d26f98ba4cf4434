"""A producer (and consumer) fails within seconds on what no retry fixes, naming it: missing
credentials, a missing bucket, conditional writes that do not work. A store that is merely
unreachable at start is still waited out.

No test here reaches beyond loopback: the credential chain is pointed at a closed loopback
port (``AWS_METADATA_ENDPOINT``) and so is the endpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from millpond import Consumer, ConsumerConfig, Producer, ProducerConfig, StoreAccessError
from millpond.common.retry import RetryPolicy
from millpond.localstack import MotoS3Server, S3Endpoint, start_moto
from millpond.localstack._process import free_ports
from millpond.storage import ForwardingStore, open_store
from tests.docs.snippets import blocks
from tests.support import unique_root

# The first example of the docs' producer page, as a reader runs it before setting credentials.
PAGE_SNIPPET = next(b.code for b in blocks("user-guide/producer.md") if b.language == "python")


def _no_aws_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    closed = free_ports(2)
    env["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{closed[0]}"
    # Should anything ever get past the credentials, it meets a closed loopback port too.
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{closed[1]}"
    return env


def test_the_producer_page_example_without_credentials_fails_fast_naming_them(
    tmp_path: Path,
) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(PAGE_SNIPPET)
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_no_aws_env(),
        cwd=tmp_path,
    )
    seconds = time.monotonic() - began
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "millpond.errors.StoreAccessError: s3://millpond/shop: no credentials found"
    )
    assert "instance metadata service" in last
    assert "AWS_ACCESS_KEY_ID" in last
    assert seconds < 10, f"took {seconds:.1f} s"


def test_missing_bucket_fails_fast_naming_it(moto_s3: S3Endpoint, tmp_path: Path) -> None:
    bucket = f"no-such-{unique_root()}"
    began = time.monotonic()
    with pytest.raises(StoreAccessError) as info:
        Producer(
            ProducerConfig(
                store=f"s3://{bucket}/q",
                store_options=moto_s3.store_options(),
                wal_dir=tmp_path / "wal",
            )
        )
    assert time.monotonic() - began < 10
    assert info.value.problem == "bucket"
    assert f"bucket '{bucket}' does not exist" in str(info.value)
    # The WAL directory is not left locked: a producer with a good store takes it at once.
    good = ProducerConfig(
        store=moto_s3.url_for(unique_root()),
        store_options=moto_s3.store_options(),
        wal_dir=tmp_path / "wal",
    )
    with Producer(good) as producer:
        producer.produce([b"x"]).wait(30)


def test_missing_container_fails_the_consumer_fast(azurite_blob, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    missing = dataclasses.replace(azurite_blob, container="no-such-container")
    consumer = Consumer(
        ConsumerConfig(store=missing.url_for("q"), store_options=missing.store_options())
    )
    with pytest.raises(StoreAccessError) as info:
        consumer.initialize()
    assert "container 'no-such-container' does not exist" in str(info.value)
    consumer.close()


class IgnoresIfMatch(ForwardingStore):
    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        return self.inner.put(path, data)


def test_a_store_without_working_conditional_writes_is_refused(
    moto_s3: S3Endpoint, tmp_path: Path
) -> None:
    broken = IgnoresIfMatch(open_store(moto_s3.url_for(unique_root()), moto_s3.store_options()))
    with pytest.raises(StoreAccessError) as info:
        Producer(ProducerConfig(store=broken, wal_dir=tmp_path / "wal"))
    assert info.value.problem == "conditional_writes"
    assert "If-Match" in str(info.value)
    with pytest.raises(StoreAccessError):
        Consumer(ConsumerConfig(store=broken)).initialize()


@pytest.fixture
def stopped_moto() -> MotoS3Server:
    server = start_moto(bucket="late")
    server.stop()
    return server


def test_an_unreachable_store_is_still_waited_out(
    stopped_moto: MotoS3Server, tmp_path: Path
) -> None:
    endpoint = stopped_moto.endpoint
    url = endpoint.url_for(unique_root())
    config = ProducerConfig(
        store=url,
        store_options=endpoint.store_options(),
        wal_dir=tmp_path / "wal",
        flush_interval=0.02,
        retry=RetryPolicy(max_attempts=10, max_elapsed=1.0, base_delay=0.01, max_delay=0.1),
    )
    began = time.monotonic()
    producer = Producer(config)  # the store is down: start anyway
    try:
        assert time.monotonic() - began < 8
        handle = producer.produce([b"kept"])
        handle.wait_staged(10)
        assert not handle.done()
        stopped_moto.start()
        handle.wait(60)
        assert open_store(url, endpoint.store_options()).get("ingest/manifest").data
    finally:
        producer.close(timeout=60)
        stopped_moto.stop()
