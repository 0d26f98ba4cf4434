"""The command line's edges, run as an operator runs it (a real process): bad usage is one line
and exit 2, read-only commands create nothing and say "no queue at …", ``consume`` wants
``--create`` for a new queue, ``--version``, a real ``--help``, and no lock files left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from millpond import Producer, ProducerConfig
from millpond.localstack import S3Endpoint
from millpond.storage import open_store
from tests.support import run_cli, unique_root


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env)


def _one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_bad_log_level_is_a_usage_error(tmp_path: Path) -> None:
    line = _one_line(_run("--log-level", "LOUD", "inspect", tmp_path.as_uri()), 2)
    assert line == (
        "millpond: error: argument --log-level: expected DEBUG, INFO, WARNING or ERROR, "
        "found 'LOUD' (see millpond --help)"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["gc", "URL", "--interval", "soon"],
            "argument --interval: expected a finite number of seconds > 0, found 'soon'",
        ),
        (["status", "URL", "--output", "yaml"], "argument --output: invalid choice: 'yaml'"),
        (["inspect", "URL", "--store-option", "novalue"], "store-option: expected KEY=VALUE"),
        (["inspect", "ftp://host/x"], "store: expected an s3://bucket[/root], az://"),
        # obstore panicked on the first request: a Rust trace, exit code 1.
        (
            ["status", "s3://b/q", "--store-option", "aws_endpoint=127.0.0.1:9000"],
            "aws_endpoint: expected an http:// or https:// URL",
        ),
        # The root ended at the '?': the queue was created at .../q.
        (["consume", "URL?x", "--sink", "sqlite:///x.db", "--create"], "takes no '?' or '#'"),
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--poll-interval", "-1"],
            "argument --poll-interval: expected a finite number of seconds > 0, found '-1'",
        ),
        # NaN passes every "< 0" test and infinity makes a wait endless: the service polled
        # without pause, or never again, and its reporter thread died of an OverflowError.
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--poll-interval", "nan"],
            "argument --poll-interval: expected a finite number of seconds > 0, found 'nan'",
        ),
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--report-interval", "inf"],
            "argument --report-interval: expected a finite number of seconds >= 0, found 'inf'",
        ),
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--progress-interval", "0"],
            "argument --progress-interval: expected a finite number of seconds > 0",
        ),
        # The coordinator's round thread died on sleep(nan) or sleep(-1) once it first paused.
        (
            ["coordinator", "URL", "--yield-slots", "nan"],
            "argument --yield-slots: expected a finite number of store requests >= 0",
        ),
        (
            ["coordinator", "URL", "--busy-seconds", "-1"],
            "argument --busy-seconds: expected a finite number of seconds >= 0, found '-1'",
        ),
        (["gc", "URL", "--grace-period", "inf"], "argument --grace-period: expected a finite"),
        # Taken as 1 without a word before.
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--max-group", "0"],
            "argument --max-group: expected an integer >= 1, found '0'",
        ),
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--quarantine-limit", "-1"],
            "argument --quarantine-limit: expected an integer >= 1, found '-1'",
        ),
        (["coordinator", "URL", "--yield-every", "0"], "argument --yield-every: expected an"),
        (["doctor", "URL", "--max-clock-skew", "nan"], "argument --max-clock-skew: expected a"),
        (["consume", "URL", "--sink", "mysql://db/x"], "sink: "),
        (["doctor", "URL", "--max-clock-skew", "much"], "argument --max-clock-skew"),
        (["frobnicate"], "unknown command 'frobnicate' (see millpond --help)"),
    ],
)
def test_every_bad_value_is_a_one_line_usage_error(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    url = (tmp_path / "q").as_uri()
    line = _one_line(_run(*[a.replace("URL", url) if a.startswith("URL") else a for a in args]), 2)
    assert line.startswith("millpond")
    assert "error: " in line
    assert expected in line
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # Was "millpond: error: unrecognized arguments: --tabel orders (see millpond --help)",
        # and millpond --help lists no subcommand's options.
        (
            ["consume", "URL", "--sink", "sqlite:///x.db", "--tabel", "orders"],
            "millpond consume: error: unrecognized argument --tabel: did you mean --table? "
            "(see millpond consume --help)",
        ),
        # Was "the following arguments are required: --sink": the typo is the cause.
        (
            ["consume", "URL", "--snk=sqlite:///x.db"],
            "millpond consume: error: unrecognized argument --snk: did you mean --sink? "
            "(see millpond consume --help)",
        ),
        (
            ["consum", "URL"],
            "millpond: error: unknown command 'consum': did you mean consume? "
            "(see millpond --help)",
        ),
        (
            ["status", "URL", "-z", "more"],
            "millpond status: error: unrecognized arguments: -z more (see millpond status --help)",
        ),
    ],
)
def test_a_misspelt_option_names_the_closest_and_the_commands_help(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    url = (tmp_path / "q").as_uri()
    assert _one_line(_run(*[url if a == "URL" else a for a in args]), 2) == expected
    assert not (tmp_path / "q").exists()


def test_the_coordinator_commands_defaults_are_the_coordinators() -> None:
    """``millpond coordinator`` spells each pacing default again for its ``--help``: they
    must not drift from ``AppendCoordinator``'s (the quiet pause's moved to 3 s)."""
    import argparse
    import inspect

    from millpond.coordinator.command import add_arguments
    from millpond.coordinator.rounds import AppendCoordinator

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parameters = inspect.signature(AppendCoordinator).parameters
    names = (
        "yield_every",
        "yield_slots",
        "quiet_yield_interval",
        "busy_seconds",
        "consumer_yield_interval",
    )
    for name in names:
        assert parser.get_default(name) == parameters[name].default, name


def test_the_consume_commands_ack_batch_size_is_the_consumers() -> None:
    """``millpond consume`` spells the dequeue step again: it must not drift from
    ``ConsumerConfig``'s (it moved from 100 to 1000 acks)."""
    import argparse
    import dataclasses

    from millpond.consumer import ConsumerConfig
    from millpond.consumer.app.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (field,) = [f for f in dataclasses.fields(ConsumerConfig) if f.name == "ack_batch_size"]
    assert parser.get_default("ack_batch_size") == field.default == 1000


def test_version() -> None:
    result = _run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == "millpond 0.1.0"


def test_help_describes_the_tool_with_examples() -> None:
    result = _run("--help")
    assert result.returncode == 0
    out = result.stdout
    assert "stateless ingest buffer on object storage" in out
    assert "az://container[/root], gs://bucket[/root]" in out
    assert "examples:" in out
    assert "millpond doctor s3://my-bucket/queue" in out
    for command in ("inspect", "status", "doctor", "consume", "gc"):
        assert f"\n    {command}" in out
    assert "The ``millpond`` command line" not in out


def test_status_without_a_database_does_not_load_pandas(tmp_path: Path) -> None:
    """Importing pandas takes 0.4 s of a command that answers in half a second. The JSON
    column writer made it load in every process importing the sinks (a ``pa.scalar`` at
    import: pyarrow's conversion imports pandas), ``status`` and ``--help`` included:
    ``status --help`` took 1.2-1.3 s with it, 0.4-0.65 s without. Only opening a
    database's ADBC driver loads it now (its dbapi imports ``pyarrow.dataset``)."""
    url = (tmp_path / "queue").as_uri()
    with Producer(ProducerConfig(store=url, wal_dir=str(tmp_path / "wal"))) as producer:
        producer.produce([b"x"]).wait(timeout=30)
    code = (
        "import sys\n"
        "from millpond.cli.main import main\n"
        "import millpond.consumer.sinks\n"
        f"code = main(['status', {url!r}])\n"
        "print('pandas' in sys.modules, code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "queue length     1 entries" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "False 0"


@pytest.mark.parametrize(
    "command", [["inspect"], ["status"], ["gc", "--dry-run"], ["gc", "--once"]]
)
def test_read_only_commands_create_nothing_and_say_no_queue(
    tmp_path: Path, command: list[str]
) -> None:
    root = tmp_path / "typo" / "queue"
    line = _one_line(_run(command[0], root.as_uri(), *command[1:]), 1)
    assert (
        line == f"millpond {command[0]}: no queue at {root.as_uri()}: the directory does not exist"
    )
    assert not (tmp_path / "typo").exists()


def test_read_only_commands_on_an_empty_directory_name_the_manifest(tmp_path: Path) -> None:
    line = _one_line(_run("status", tmp_path.as_uri(), "--manifest-path", "q/manifest"), 1)
    assert line == f"millpond status: no queue at {tmp_path.as_uri()}: no manifest at q/manifest"
    assert list(tmp_path.iterdir()) == []


def test_status_names_a_missing_bucket(moto_s3: S3Endpoint) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    result = _run("status", "s3://no-such-bucket/q", env={**env, **moto_s3.env()})
    line = _one_line(result, 1)
    assert line == (
        "millpond status: s3://no-such-bucket/q: bucket 'no-such-bucket' does not exist; "
        "create the bucket, or fix the store URL"
    )


def test_consume_refuses_a_missing_queue_unless_create(tmp_path: Path) -> None:
    root = tmp_path / "new-queue"
    sink = f"sqlite://{tmp_path / 'sink.db'}"
    line = _one_line(_run("consume", root.as_uri(), "--sink", sink), 1)
    assert line == (
        f"millpond consume: no queue at {root.as_uri()}: the directory does not exist "
        "(pass --create to start an empty queue there)"
    )
    assert not root.exists()
    assert not (tmp_path / "sink.db").exists()
    result = _run("consume", root.as_uri(), "--sink", sink, "--create", "--exit-when-idle")
    assert result.returncode == 0, result.stderr
    assert (root / "ingest" / "manifest").is_file()


def test_no_lock_files_are_left_behind(tmp_path: Path) -> None:
    root = tmp_path / "queue"
    with Producer(ProducerConfig(store=root.as_uri(), wal_dir=tmp_path / "wal")) as producer:
        for i in range(5):
            producer.produce([b"%d" % i]).wait(30)
    sink = f"sqlite://{tmp_path / 'sink.db'}"
    consumed = _run("consume", root.as_uri(), "--sink", sink, "--exit-when-idle", "--no-gc")
    assert consumed.returncode == 0, consumed.stderr
    # The queue's claim keeps the RFC's 600 s grace period: nothing is old enough to go yet.
    collected = _run("gc", root.as_uri(), "--grace-period", "600", "--output", "json")
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["deleted"] == 0
    assert sorted(p.name for p in root.rglob(".*")) == []
    listed = [i.path for i in open_store(root.as_uri()).list() if "/_millpond/" not in i.path]
    assert len(listed) == 6  # the manifest and five batch objects
    assert "ingest/manifest" in listed


def test_doctor_and_status_on_a_fresh_remote_root(moto_s3: S3Endpoint) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **moto_s3.env()}
    url = moto_s3.url_for(unique_root())
    line = _one_line(_run("inspect", url, env=env), 1)
    assert line == f"millpond inspect: no queue at {url}: no manifest at ingest/manifest"
    result = _run("doctor", url, env=env)
    assert result.returncode == 0, result.stdout
    assert "no manifest yet" in result.stdout
