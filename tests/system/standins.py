"""What the product's modules see during a schedule: the runtime's stand-ins.

:func:`patch` replaces, in the globals of every module under the runtime's
``patch_prefixes`` (``millpond``; found through ``sys.modules``, so modules that move keep
working, and as they load when imported during the schedule), what the product would block or
draw on with the runtime's own, and notes how to put it all back:

* ``threading`` (``Thread``, ``Lock``, ``RLock``, ``Condition``, ``Event``, ``Semaphore``,
  ``current_thread``, ``main_thread``; ``local`` and ``get_ident`` stay real: the runtime's
  threads are real threads) — :mod:`tests.system.primitives`;
* ``time.sleep`` and the monotonic clocks (``time.time`` and ``time_ns`` stay real: only the
  sink's commit stamps read them), and any ``SystemClock``: a clock nobody injected reads the
  schedule's time;
* the names imported from ``concurrent.futures`` (``ThreadPoolExecutor``, ``Future``, ``wait``,
  ``as_completed``);
* ``selectors`` and ``http`` (``http.client.HTTPConnection``), and every ``socketserver``
  server class a module defines: the coordinator's HTTP runs on :mod:`tests.system.simnet`;
* ``random``, ``os.urandom``, ``uuid.uuid4`` and ``secrets``: drawn from a generator seeded
  with the schedule's seed, so a seed fixes batch names, jitter and tokens too;
* ``os.fsync`` and ``os.fdatasync`` return at once: a simulated crash loses nothing the page
  cache holds, and a real sync would hold the baton for its whole latency.

Dataclass fields that default to a ``threading`` primitive (``field(default_factory=
threading.Event)``, bound when the class was made) get the stand-in through the generated
``__init__``'s closure. Every stand-in gives the real thing to a thread the runtime does not
know (a leftover of another test), so only the schedule's own threads are simulated.
"""

from __future__ import annotations

import concurrent
import concurrent.futures
import dataclasses
import http
import http.client
import importlib.abc
import os
import random
import secrets
import selectors
import socketserver
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable
from typing import Any

from tests.system import simnet
from tests.system.primitives import (
    SimBoundedSemaphore,
    SimCondition,
    SimEvent,
    SimExecutor,
    SimFuture,
    SimLock,
    SimRLock,
    SimSemaphore,
    sim_as_completed,
    sim_wait,
)
from tests.system.runtime import Runtime, SimThread, _registered, current_runtime

__all__ = ["patch"]

Undo = Callable[[], None]


def patch(runtime: Runtime, undo: list[Undo]) -> None:
    """Put the stand-ins into the product's modules — those loaded now, and those imported
    during the schedule — adding to ``undo`` what puts the originals back (run last first)."""
    replacements = _replacements(runtime)
    replacements[id(_SYSTEM_CLOCK)] = _system_clock(runtime)

    def patch_module(name: str, module: types.ModuleType) -> None:
        if name in runtime.exclude_modules or not _wanted(runtime, name):
            return
        namespace = module.__dict__
        for key, value in list(namespace.items()):
            new = replacements.get(id(value))
            if new is None and isinstance(value, type) and value.__name__ == "SystemClock":
                new = replacements[id(_SYSTEM_CLOCK)]
            if new is not None:
                namespace[key] = new
                undo.append(_setter(namespace, key, value))
            elif isinstance(value, type) and value.__module__ == name:
                undo.extend(_patch_class(runtime, value, namespace, key, replacements))

    hook = _PatchOnImport(runtime, patch_module)
    sys.meta_path.insert(0, hook)
    undo.append(lambda: sys.meta_path.remove(hook))  # undone last: nothing imports then
    for name, module in list(sys.modules.items()):
        if module is not None:
            patch_module(name, module)


_SYSTEM_CLOCK = object()  # the key of the SystemClock stand-in in the replacements


def _wanted(runtime: Runtime, name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in runtime.patch_prefixes)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Gives a product module imported during the schedule the stand-ins as it loads."""

    def __init__(self, runtime: Runtime, patch: Callable[[str, types.ModuleType], None]) -> None:
        self._runtime = runtime
        self._patch = patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _wanted(self._runtime, fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        patch = self._patch

        class Patching(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                patch(fullname, module)

            def __getattr__(self, name: str) -> Any:  # get_data, resource readers, ...
                return getattr(loader, name)

        spec.loader = Patching()
        return spec


def _patch_class(
    runtime: Runtime, cls: type, namespace: dict[str, Any], key: str, replacements: dict[int, Any]
) -> list[Undo]:
    undo: list[Undo] = []
    if dataclasses.is_dataclass(cls):
        init = cls.__dict__.get("__init__")
        for cell in getattr(init, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            new = replacements.get(id(content))
            if new is not None:
                cell.cell_contents = new
                undo.append(_cell_setter(cell, content))
    if issubclass(cls, socketserver.BaseServer):
        namespace[key] = runtime.net.server_class(cls)
        undo.append(_setter(namespace, key, cls))
    return undo


def _setter(namespace: dict[str, Any], key: str, value: Any) -> Undo:
    def undo() -> None:
        namespace[key] = value

    return undo


def _cell_setter(cell: Any, value: Any) -> Undo:
    def undo() -> None:
        cell.cell_contents = value

    return undo


def _system_clock(runtime: Runtime) -> type:
    """A ``SystemClock`` on the schedule's time (the real one for a foreign thread)."""

    class SimSystemClock:
        def now_ms(self) -> int:
            if not runtime.registered():
                return time.time_ns() // 1_000_000
            wall = getattr(runtime.time_line, "now_ms", None)
            return int(wall()) if wall is not None else int(runtime.now() * 1000)

        def monotonic(self) -> float:
            return runtime.now() if runtime.registered() else time.monotonic()

        def sleep(self, seconds: float) -> None:
            if runtime.registered():
                runtime.sleep(seconds)
            elif seconds > 0:
                time.sleep(seconds)

    return SimSystemClock


def _dispatch(sim: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    """``sim`` for the runtime's threads, ``real`` for any other (another test's leftover)."""

    def make(*args: Any, **kwargs: Any) -> Any:
        if _registered() is not None:
            return sim(*args, **kwargs)
        return real(*args, **kwargs)

    make.__name__ = getattr(real, "__name__", "stand_in")
    return make


def _proxy(name: str, original: types.ModuleType, **overrides: Any) -> types.ModuleType:
    """A module like ``original`` but for ``overrides``."""
    module = types.ModuleType(name)
    module.__dict__.update(original.__dict__)
    module.__dict__.update(overrides)
    return module


def _current_thread() -> Any:
    found = _registered()
    return found[1] if found is not None else threading.current_thread()


def _main_thread() -> Any:
    runtime = current_runtime()
    if runtime is not None and runtime.main is not None:
        return runtime.main
    return threading.main_thread()


def _no_sync(fd: int) -> None:
    os.fstat(fd)  # a closed descriptor still fails, as it would


def _replacements(runtime: Runtime) -> dict[int, Any]:
    """By the identity of what a module imported: what it sees during the schedule."""
    table = {**_threads_and_time(runtime), **_randomness(runtime), **_futures_and_network(runtime)}
    return {id(key): value for key, value in table.items()}


def _threads_and_time(runtime: Runtime) -> dict[Any, Any]:
    def monotonic() -> float:
        return runtime.now() if _registered() is not None else time.monotonic()

    def sleep(seconds: float) -> None:
        if _registered() is not None:
            runtime.sleep(seconds)
        else:
            time.sleep(seconds)

    def ns() -> int:
        return int(monotonic() * 1e9)

    sim_threading = _proxy(
        "threading",
        threading,
        Thread=_dispatch(SimThread, threading.Thread),
        Lock=_dispatch(SimLock, threading.Lock),
        RLock=_dispatch(SimRLock, threading.RLock),
        Condition=_dispatch(SimCondition, threading.Condition),
        Event=_dispatch(SimEvent, threading.Event),
        Semaphore=_dispatch(SimSemaphore, threading.Semaphore),
        BoundedSemaphore=_dispatch(SimBoundedSemaphore, threading.BoundedSemaphore),
        current_thread=_current_thread,
        currentThread=_current_thread,
        main_thread=_main_thread,
    )
    sim_time = _proxy(
        "time",
        time,
        sleep=sleep,
        monotonic=monotonic,
        perf_counter=monotonic,
        monotonic_ns=ns,
        perf_counter_ns=ns,
    )
    return {
        threading: sim_threading,
        threading.Thread: sim_threading.Thread,
        threading.Lock: sim_threading.Lock,
        threading.RLock: sim_threading.RLock,
        threading.Condition: sim_threading.Condition,
        threading.Event: sim_threading.Event,
        threading.Semaphore: sim_threading.Semaphore,
        threading.current_thread: _current_thread,
        time: sim_time,
        time.sleep: sleep,
        time.monotonic: monotonic,
        time.perf_counter: monotonic,
    }


_DRAWS = (
    "random",
    "uniform",
    "randint",
    "randrange",
    "choice",
    "choices",
    "shuffle",
    "sample",
    "getrandbits",
    "gauss",
    "expovariate",
    "triangular",
    "betavariate",
    "normalvariate",
    "lognormvariate",
    "randbytes",
)


def _randomness(runtime: Runtime) -> dict[Any, Any]:
    rng = runtime.data_random
    sim_random = _proxy("random", random, **{name: getattr(rng, name) for name in _DRAWS})
    sim_os = _proxy(
        "os", os, urandom=lambda n: rng.randbytes(n), fsync=_no_sync, fdatasync=_no_sync
    )
    sim_uuid = _proxy("uuid", uuid, uuid4=lambda: uuid.UUID(int=rng.getrandbits(128), version=4))
    sim_secrets = _proxy(
        "secrets",
        secrets,
        token_bytes=lambda n=32: rng.randbytes(n),
        token_hex=lambda n=32: rng.randbytes(n).hex(),
        randbits=rng.getrandbits,
        randbelow=lambda n: rng.randrange(n),
        choice=rng.choice,
    )
    return {random: sim_random, os: sim_os, uuid: sim_uuid, secrets: sim_secrets}


def _futures_and_network(runtime: Runtime) -> dict[Any, Any]:
    executor = _dispatch(SimExecutor, concurrent.futures.ThreadPoolExecutor)
    future = _dispatch(SimFuture, concurrent.futures.Future)
    wait = _dispatch(sim_wait, concurrent.futures.wait)
    as_completed = _dispatch(sim_as_completed, concurrent.futures.as_completed)
    sim_futures = _proxy(
        "concurrent.futures",
        concurrent.futures,
        ThreadPoolExecutor=executor,
        Future=future,
        wait=wait,
        as_completed=as_completed,
    )
    sim_concurrent = _proxy("concurrent", concurrent, futures=sim_futures)
    sim_client = _proxy("http.client", http.client, HTTPConnection=runtime.net.connection_class())
    sim_http = _proxy("http", http, client=sim_client)
    sim_selectors = _proxy(
        "selectors",
        selectors,
        DefaultSelector=simnet.SimSelector,
        SelectSelector=simnet.SimSelector,
        PollSelector=simnet.SimSelector,
        EpollSelector=simnet.SimSelector,
    )
    return {
        concurrent: sim_concurrent,
        concurrent.futures: sim_futures,
        concurrent.futures.ThreadPoolExecutor: executor,
        concurrent.futures.Future: future,
        concurrent.futures.wait: wait,
        concurrent.futures.as_completed: as_completed,
        http: sim_http,
        http.client: sim_client,
        http.client.HTTPConnection: sim_client.HTTPConnection,
        selectors: sim_selectors,
    }
