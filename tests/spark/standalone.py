"""A two-worker Spark standalone cluster on loopback, for the one test that needs speculation.

Spark never launches a speculative copy of a task on a host where an attempt of it already
runs, and local mode is one host. Here two workers register under two names of the loopback
address, ``127.0.0.1`` and ``localhost``, so Spark sees two hosts while everything stays on
127.0.0.1. Each process runs in its own process group and is stopped by its PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from millpond.localstack._process import free_ports, stop_process_group, wait_for

WORKER_HOSTS = ("127.0.0.1", "localhost")


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


@contextmanager
def standalone_cluster(workdir: Path) -> Iterator[str]:
    """Start a master and one single-core worker per name in :data:`WORKER_HOSTS`.

    Yields:
        The master URL, ``spark://127.0.0.1:PORT``.
    """
    env = {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_NO_DAEMONIZE": "1",
        # No REST submission server: it would listen on the fixed port 6066.
        "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        # The master's and workers' JVMs take the suite's options for Spark's JVMs too.
        "SPARK_DAEMON_JAVA_OPTS": os.environ.get("SPARK_SUBMIT_OPTS", ""),
    }
    (port,) = free_ports(1)
    master_url = f"spark://127.0.0.1:{port}"
    processes: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        master_log = workdir / "master.log"
        processes.append(
            (
                "spark master",
                _spawn(
                    [
                        "org.apache.spark.deploy.master.Master",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--webui-port",
                        "0",
                    ],
                    master_log,
                    env,
                ),
            )
        )
        for index, host in enumerate(WORKER_HOSTS):
            work = workdir / f"worker{index}"
            work.mkdir()
            log = workdir / f"worker{index}.log"
            processes.append(
                (
                    f"spark worker {host}",
                    _spawn(
                        [
                            "org.apache.spark.deploy.worker.Worker",
                            "--host",
                            host,
                            "--webui-port",
                            "0",
                            "--cores",
                            "1",
                            "--memory",
                            "1g",
                            "--work-dir",
                            str(work),
                            master_url,
                        ],
                        log,
                        env,
                    ),
                )
            )
        for index in range(len(WORKER_HOSTS)):
            log = workdir / f"worker{index}.log"
            wait_for(
                lambda log=log: True if b"Successfully registered" in log.read_bytes() else None,
                timeout=90,
                what=f"spark worker {WORKER_HOSTS[index]}",
            )
        yield master_url
    finally:
        for name, process in reversed(processes):
            stop_process_group(process, timeout=10, name=name)
