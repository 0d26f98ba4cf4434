"""The code blocks of the documentation (``docs/**/*.md``), extracted and run as a reader runs
them; ``docs/contributing.md`` is the contract this module keeps.

A page's blocks run in order, in one ``bash -euo pipefail`` process of their own, in an empty
directory: ``sh`` blocks as they are, ``console`` blocks' ``$ `` lines, ``python`` blocks each
in a ``python`` process of its own, a titled block (``python title="job.py"``) written to that
file. ``text`` blocks are output and are not run. A block preceded by
``<!-- docs-test: skip: WHY -->`` is not run; every other block must be one of the above.

The environment is the caller's: :func:`local_environment` reads it from ``millpond local
--background``, as ``eval "$(millpond local --background)"`` gives it to a reader's shell.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DOCS",
    "Block",
    "LocalServers",
    "PageRun",
    "blocks",
    "local_servers",
    "pages",
    "reader_environment",
    "run_page",
]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUN = frozenset({"python", "sh", "console"})
"""Languages whose blocks run."""
OUTPUT = frozenset({"text"})
"""Languages whose blocks are output shown to the reader."""

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')
_SKIP = re.compile(r"^\s*<!-- docs-test: skip: (?P<why>.+?) -->\s*$")
_EOF = "__MILLPOND_DOCS_BLOCK__"


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block of a page."""

    page: str
    """The page, relative to ``docs/``."""
    line: int
    """The line of its opening fence (1-based)."""
    language: str
    title: str | None
    code: str
    skip: str | None
    """Why it is not run, when the page says so."""

    @property
    def where(self) -> str:
        return f"{Path('docs', self.page)}:{self.line}".removeprefix("docs/../")

    @property
    def text(self) -> tuple[str, str | None, str]:
        """What a reader sees of it: its language, its title and its code."""
        return (self.language, self.title, self.code)


def pages() -> list[str]:
    """Every page of the site, relative to ``docs/`` (the hooks' folder is no page)."""
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``docs/<page>`` (``../README.md``: the README's), in order."""
    lines = (DOCS / page).read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        info = opening["info"].strip()
        language = info.split()[0] if info else ""
        title = _TITLE.search(info)
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        code = "\n".join(line[indent:] for line in lines[index + 1 : end])
        skip = _SKIP.match(lines[index - 1]) if index else None
        found.append(
            Block(
                page=page,
                line=index + 1,
                language=language,
                title=title["title"] if title else None,
                code=code + "\n",
                skip=skip["why"] if skip else None,
            )
        )
        index = end + 1
    return found


def _step(block: Block, number: int) -> str:
    """The bash that runs (or writes) one block, after a line naming it."""
    head = f'echo "=== {block.where} ({block.language}) at $(date +%T.%3N)" >&2\n'
    if block.title is not None:
        return head + f"cat > {shlex.quote(block.title)} <<'{_EOF}'\n{block.code}{_EOF}\n"
    if block.language == "python":
        name = f"_docs_block_{number:02d}.py"
        return head + f"cat > {name} <<'{_EOF}'\n{block.code}{_EOF}\npython {name}\n"
    if block.language == "console":
        return head + _console_commands(block.code)
    return head + block.code


def _console_commands(text: str) -> str:
    commands: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued:
            commands[-1] += "\n" + line
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            continue
        continued = line.endswith("\\")
    return "\n".join(commands) + "\n"


def script(page: str, *, on_exit: str = "") -> str:
    """What a reader types for ``page``, in order, as one bash script; ``on_exit`` (the
    test's, not the page's) runs when it ends, however it ends."""
    steps = [
        _step(block, number)
        for number, block in enumerate(blocks(page))
        if block.skip is None and (block.title is not None or block.language in RUN)
    ]
    trap = f"trap {shlex.quote(on_exit)} EXIT\n" if on_exit else ""
    return "set -euo pipefail\n" + trap + "".join(steps)


@dataclass(frozen=True, slots=True)
class PageRun:
    """What running a page's blocks printed (stdout and stderr together, in order)."""

    page: str
    returncode: int
    output: str

    def failure(self) -> str:
        """Which block failed, and the end of what it printed."""
        markers = re.findall(r"^=== (\S+ \(\w+\)) at ", self.output, re.M)
        where = markers[-1] if markers else "before the first block"
        return f"{where} exited {self.returncode}:\n{self.output[-6000:]}"


def run_page(
    page: str, env: dict[str, str], cwd: Path, *, timeout: float = 300, on_exit: str = ""
) -> PageRun:
    """Run every block of ``page`` as a reader would, in ``cwd``.

    The bash process leads a process group of its own: whatever a page left running in the
    background (a page that forgot a ``kill``, or failed before it) is ended with it."""
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    transcript = cwd / "_docs_transcript.txt"
    # A file, not a pipe: a background job the page left running would hold a pipe open.
    with transcript.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", script(page, on_exit=on_exit)],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the page's own background jobs, by group
    output = transcript.read_text()
    if proc.returncode == -signal.SIGKILL:
        output += f"\n(killed after {timeout:.0f} s)"
    return PageRun(page=page, returncode=proc.returncode, output=output)


def reader_environment() -> dict[str, str]:
    """A reader's shell before ``millpond local``: no AWS_* of the caller's; the instance
    metadata service at a closed loopback port (nothing asks a cloud for credentials)."""
    from millpond.localstack._process import free_ports

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MILLPOND_"))}
    env["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{free_ports(1)[0]}"
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's end-of-life banner
    return env


class LocalServers:
    """``millpond local --background``: its variables, and a stop that waits until both
    servers are gone (ports closed)."""

    def __init__(self, env: dict[str, str]) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "millpond.cli", "local", "--background", "--timeout", "60"],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"millpond local did not start:\n{done.stderr}")
        self.variables: dict[str, str] = {}
        for line in done.stdout.splitlines():
            if line.startswith("export "):
                name, _, value = shlex.split(line)[1].partition("=")
                self.variables[name] = value
        self.env = {**env, **self.variables}

    def ports(self) -> list[int]:
        from urllib.parse import urlsplit

        return [
            urlsplit(self.variables[name]).port or 0
            for name in ("AWS_ENDPOINT_URL", "MILLPOND_SINK")
        ]

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the process it reported (``kill $MILLPOND_LOCAL_PID``), then wait until
        neither server accepts a connection."""
        import socket

        os.kill(int(self.variables["MILLPOND_LOCAL_PID"]), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for port in self.ports():
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except OSError:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"millpond local still serves port {port}")
                time.sleep(0.1)  # polling a condition, with a deadline


@contextlib.contextmanager
def local_servers() -> Iterator[LocalServers]:
    """``millpond local --background`` in a reader's environment, stopped on the way out."""
    running = LocalServers(reader_environment())
    try:
        yield running
    finally:
        running.stop()
