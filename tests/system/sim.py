"""The simulated world's time and store: one clock for every role, one real store, faults.

* :class:`SimClock` — wall and monotonic time that only move when the schedule advances them or
  a role sleeps (a backoff): no test waits for real time to pass.
* :class:`Recorder` — wraps the one real store every role shares (an obstore memory store). It
  stamps each write with the simulated time (garbage collection reads last-modified times), and
  records what the store applied, in order: manifest footers, batch writes, deletes, appends.
* :class:`RoleStore` — what one role (a producer process, a consumer, a collector, a Spark
  driver) sees of the store. The schedule arms faults on it: a call that fails before it reaches
  the store, one that lands and then reports failure, a conditional write held back and landed
  later (behind a newer one's back), the store down for a while, the queue's manifest answering
  404 or garbage to the role's reads for a while, and a crash of the role at any call (before
  or after the call lands), after which every call of that role raises
  :class:`SimulatedCrash`. A schedule may also run another role's action between any two of
  this role's requests (:meth:`RoleStore.interleave`): a takeover between any two requests of an
  older consumer.

Fencing at the store: once a newer consumer's takeover has returned (:meth:`Recorder.fence`),
no conditional write of an older consumer of that queue — the manifest, the backlog index
head — may land; the recorder notes any that does (:attr:`Recorder.fenced_writes`). Nor may a
backlog index head be created carrying an epoch below its manifest's
(:attr:`Recorder.stale_heads`).

Under the checker's runtime (:mod:`tests.system.runtime`) each request of a role is a
scheduling point before it is sent and after its answer (another thread may act in between),
and the recorder's :attr:`~Recorder.trace` lists every request in the order sent, with its
answer: two runs of a seed must give the same trace.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
import weakref
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from millpond.errors import CommitStateUnknownError, ConflictError, NotFoundError, StorageError
from millpond.formats.manifest import decode_manifest
from millpond.queue.index import decode_head
from millpond.storage.store import (
    DeleteFailure,
    ForwardingStore,
    GetResult,
    ObjectInfo,
    ObjectStore,
)
from tests.invariants import ObjectEvent
from tests.system.runtime import current_runtime

__all__ = ["Fault", "Recorder", "RoleStore", "SimClock", "SimulatedCrash", "SkewedClock"]


class SimulatedCrash(BaseException):
    """The role's process died here. A ``BaseException``: nothing in millpond catches it as an
    error; it ends the thread it hits, as a real crash ends the process."""


_CLOCKS: weakref.WeakSet[SimClock] = weakref.WeakSet()
"""Every simulated clock alive, for :func:`inherit_clock_readings`."""


def inherit_clock_readings() -> Callable[[], None]:
    """Called where a thread is made; what it returns, first thing in the new thread.

    A new thread starts with the clock readings of the thread that made it. ``Peek.outrun``
    sends a writer's compare-and-swap on a thread of its own, right after the writer checked
    its deadline on the clock: the write is sent on that reading, and the timing assumption
    (:meth:`RoleStore._in_time`) must bound it by that reading — a new thread has none of its
    own, and its writes went unbounded (a write whose writer was descheduled while the
    schedule moved the clock 200 s landed: checker seed 560703, "appended while it did not
    exist"). The runtime (:mod:`tests.system.runtime`) calls it for every thread it starts."""
    readings = [(clock, clock.last_read()) for clock in list(_CLOCKS)]

    def inherit() -> None:
        for clock, at in readings:
            clock.inherit(at)

    return inherit


class SimClock:
    """Simulated wall clock (ms) and monotonic clock (s).

    Under the schedule's runtime (:mod:`tests.system.runtime`) it is the runtime's time line:
    ``sleep`` blocks the calling thread until the time has come, and time moves on only when
    every thread is blocked (:meth:`jump_to`) or when the schedule moves it (:meth:`advance`).
    Outside one, ``sleep`` advances the clock.

    It remembers when each thread last read it (:meth:`last_read`): a write sent on that
    reading (a deadline checked, then the request) is :meth:`since` it old when it lands.
    """

    def __init__(self, start_ms: int = 1_800_000_000_000) -> None:
        self._lock = threading.Lock()
        self._start_ms = start_ms
        self._now = 0.0
        self._reads = threading.local()
        _CLOCKS.add(self)

    def inherit(self, at: float | None) -> None:
        """Take ``at`` as this thread's last reading (one it has not made itself)."""
        if at is not None and getattr(self._reads, "at", None) is None:
            self._reads.at = at

    def now_ms(self) -> int:
        with self._lock:
            self._reads.at = self._now
            return self._start_ms + int(self._now * 1000)

    def monotonic(self) -> float:
        with self._lock:
            self._reads.at = self._now
            return self._now

    def last_read(self) -> float | None:
        """The simulated time this thread last read the clock, if it ever did."""
        at: float | None = getattr(self._reads, "at", None)
        return at

    def since(self, moment: float) -> float:
        """Seconds from ``moment`` to now, without counting as this thread's reading."""
        with self._lock:
            return self._now - moment

    def sleep(self, seconds: float) -> None:
        runtime = current_runtime()
        if runtime is not None and runtime.registered():
            runtime.sleep(seconds)
        else:
            self.advance(seconds)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += max(0.0, seconds)

    def current(self) -> float:
        """The simulated time, without counting as this thread's reading (the runtime's)."""
        with self._lock:
            return self._now

    def jump_to(self, moment: float) -> None:
        """Move the time on to ``moment`` (every thread is blocked until then)."""
        with self._lock:
            self._now = max(self._now, moment)


class SkewedClock:
    """A role's view of the simulated clock: its wall clock off by ``skew_ms``."""

    def __init__(self, sim: SimClock, skew_ms: int) -> None:
        self._sim = sim
        self.skew_ms = skew_ms

    def now_ms(self) -> int:
        return self._sim.now_ms() + self.skew_ms

    def monotonic(self) -> float:
        return self._sim.monotonic()

    def sleep(self, seconds: float) -> None:
        self._sim.sleep(seconds)


class Recorder(ForwardingStore):
    """The shared store: stamps writes with simulated time and records what was applied."""

    def __init__(
        self,
        inner: ObjectStore,
        clock: SimClock,
        manifests: Iterable[str],
        in_flight_limit: float | None = None,
    ) -> None:
        super().__init__(inner)
        self.clock = clock
        self.in_flight_limit = in_flight_limit
        """The timing assumption: a manifest write lands within this many seconds of the
        clock reading it was sent on (``grace period - reupload_after``), or never."""
        self.late: list[str] = []
        """Manifest writes that would have landed later than that: they never landed."""
        self.lock = threading.RLock()
        self._stamps: dict[str, int] = {}
        self._manifests = set(manifests)
        self._referenced: dict[str, set[str]] = {m: set() for m in self._manifests}
        # Locations each backlog index head names (by head path): referenced like the
        # manifest's, so a delete of one is a deleted live batch.
        self._indexed: dict[str, set[str]] = {}
        self.footers: dict[str, list[tuple[int, int]]] = {m: [] for m in self._manifests}
        self._starts: dict[str, int] = {}
        """Manifest path -> the first sequence its last written state holds (its
        next_sequence when empty)."""
        self._dequeue_asks: dict[str, list[tuple[int, int]]] = {m: [] for m in self._manifests}
        """Manifest path -> every (epoch, through) a consumer asked the coordinator to
        dequeue."""
        self.unasked_dequeues: list[str] = []
        """Coordinator writes that removed entries no consumer holding the manifest's epoch had
        asked it to remove (a fenced consumer's dequeue, written on its behalf)."""
        self.objects: list[ObjectEvent] = []
        self.step = 0
        """The schedule's current step, stamped on every event."""
        self.doubled: list[str] = []
        """Locations a manifest state held twice (step and location), for the checker."""
        self.held: list[Callable[[], object]] = []
        """Conditional manifest writes held back; they land before the next manifest write."""
        self.fenced: set[str] = set()
        """Role names of consumers a newer consumer's takeover has fenced (it returned)."""
        self.fenced_writes: list[str] = []
        """Conditional writes of a fenced consumer that landed after the takeover returned."""
        self.stale_heads: list[str] = []
        """Backlog index heads created carrying an epoch below their manifest's."""
        self.trace: list[str] = []
        """Every request a role sent, in the order sent, with its answer
        (:meth:`RoleStore._request`): under the runtime, a seed gives the same trace."""
        self.private: list[bytes] = []
        """What differs between two runs of one seed besides the store's URL (:meth:`digest`)."""
        self._index_manifests: dict[str, str] = {}
        """Index head path -> its queue's manifest (:meth:`index_of`)."""

    def index_of(self, head_path: str, manifest_path: str) -> None:
        """``head_path`` is the backlog index head of the queue at ``manifest_path``."""
        self._index_manifests[head_path] = manifest_path

    def note(self, line: str) -> None:
        self.trace.append(line)

    def digest(self, data: bytes) -> str:
        """A short digest of ``data``, what differs between two runs of a seed left out (the
        store's URL, a name made for each world, and the run's directory: a sink's path in a
        set-aside batch's reason)."""
        normal = data.replace(self.url.encode(), b"<store>")
        for private in self.private:
            normal = normal.replace(private, b"<private>")
        return f"{len(data)}:{zlib.crc32(normal):08x}"

    def describe(self, result: object) -> str:
        """An answer, as the trace notes it."""
        if isinstance(result, GetResult):
            return f"{result.etag} {self.digest(result.data)}"
        if isinstance(result, ObjectInfo):
            return f"{result.path} {result.size} {result.etag}"
        if isinstance(result, builtins.list):
            return "[" + " ".join(self.describe(item) for item in result) + "]"
        if isinstance(result, DeleteFailure):
            return f"failed:{result.path}"
        return str(result)

    def ask_dequeue(self, manifest_path: str, epoch: int, through: int) -> None:
        """A consumer holding ``epoch`` asked the coordinator to dequeue through ``through``."""
        with self.lock:
            self._dequeue_asks[manifest_path].append((epoch, through))

    def coordinator_wrote(self, path: str, start_before: int | None) -> None:
        """The coordinator's write of ``path`` landed, its first sequence ``start_before``
        before: entries it removed must be what a consumer holding the epoch asked for."""
        epoch = self.footers[path][-1][1]
        removed_through = self._starts[path] - 1
        if start_before is None or removed_through < start_before:
            return  # nothing removed: an append
        if not any(e == epoch and t >= removed_through for e, t in self._dequeue_asks[path]):
            self.unasked_dequeues.append(
                f"step {self.step}: the coordinator removed {path} entries through "
                f"{removed_through} at epoch {epoch}; no consumer holding it asked"
            )

    def start_of(self, path: str) -> int | None:
        return self._starts.get(path)

    def fence(self, roles: Iterable[str]) -> None:
        """A takeover returned: no conditional write of these consumers may land from now."""
        with self.lock:
            self.fenced.update(roles)

    # -- recording ------------------------------------------------------------------------

    def _stamp(self, path: str) -> None:
        self._stamps[path] = self.clock.now_ms()

    def _manifest_written(self, path: str, data: bytes) -> None:
        manifest = decode_manifest(data, name=path)
        self.footers[path].append((manifest.next_sequence, manifest.epoch))
        entries = manifest.entries
        self._starts[path] = entries[0].sequence if entries else manifest.next_sequence
        now = {entry.location for entry in manifest.entries}
        if len(now) != len(manifest.entries):
            seen: set[str] = set()
            for entry in manifest.entries:
                if entry.location in seen:
                    self.doubled.append(f"step {self.step}: {entry.location}")
                seen.add(entry.location)
        for location in sorted(now - self._referenced[path]):
            self.objects.append(ObjectEvent(self.step, "append", location))
        self._referenced[path] = now

    def _index_written(self, path: str, data: bytes) -> None:
        head = decode_head(data, name=path)
        locations: set[str] = set()
        for segment in head.segments:
            entries = decode_manifest(self.inner.get(segment.path).data).entries
            locations.update(e.location for e in entries if e.sequence > head.dequeued_through)
        self._indexed[path] = locations

    def _written(self, path: str, data: bytes) -> None:
        self._stamp(path)
        if path in self._manifests:
            self._manifest_written(path, data)
        elif path.endswith("/_millpond/index/head"):
            self._index_written(path, data)
        elif path.endswith(".batch"):
            self.objects.append(ObjectEvent(self.step, "write", path))

    def release_held(self) -> None:
        """Land every held-back conditional write (each still under its own precondition)."""
        with self.lock:
            held, self.held = self.held, []
        for write in held:
            with contextlib.suppress(Exception):
                write()

    # -- writes ---------------------------------------------------------------------------

    def put(self, path: str, data: bytes) -> str | None:
        with self.lock:
            etag = self.inner.put(path, data)
            self._written(path, data)
            return etag

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        if path in self._manifests:
            self.release_held()
        with self.lock:
            etag = self.inner.put_if_absent(path, data)
            self._written(path, data)
            manifest = self._index_manifests.get(path)
            if manifest is not None:
                self._check_new_head(path, data, manifest)
            return etag

    def _check_new_head(self, path: str, data: bytes, manifest: str) -> None:
        """A backlog index head was created: it must carry the manifest's current epoch
        (an older consumer's first move must not create one after a takeover's bump)."""
        footers = self.footers[manifest]
        epoch = footers[-1][1] if footers else 0
        head = decode_head(data, name=path)
        if head.epoch < epoch:
            self.stale_heads.append(
                f"step {self.step}: {path} created carrying epoch {head.epoch}, the manifest "
                f"{manifest} at epoch {epoch}"
            )

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        if path in self._manifests:
            self.release_held()
        with self.lock:
            new = self.inner.put_if_match(path, data, etag)
            self._written(path, data)
            return new

    def copy(self, source: str, target: str) -> None:
        with self.lock:
            self.inner.copy(source, target)
            self._stamp(target)
            if target.endswith(".batch"):
                self.objects.append(ObjectEvent(self.step, "write", target))

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        wanted = list(paths)
        with self.lock:
            failures = self.inner.delete_many(wanted)
            failed = {f.path for f in failures}
            referenced = set().union(*self._referenced.values(), *self._indexed.values())
            for path in wanted:
                if path not in failed and path.endswith(".batch"):
                    self.objects.append(
                        ObjectEvent(self.step, "delete", path, referenced=path in referenced)
                    )
                    self._stamps.pop(path, None)
            return failures

    # -- times ----------------------------------------------------------------------------

    def _timed(self, info: ObjectInfo) -> ObjectInfo:
        stamp = self._stamps.get(info.path)
        if stamp is None:
            return info
        moment = datetime.fromtimestamp(stamp / 1000, tz=UTC)
        return ObjectInfo(info.path, info.size, moment, info.etag)

    def head(self, path: str) -> ObjectInfo:
        return self._timed(self.inner.head(path))

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        return [self._timed(info) for info in self.inner.list(prefix, recursive=recursive)]


@dataclass(slots=True)
class Fault:
    """One armed fault: ``op`` calls of this role skip ``after`` matches, then ``mode`` hits."""

    op: str
    """``cas`` (conditional manifest writes), ``put`` (batch object writes), ``read`` (any
    read), ``delete``, ``any``; or ``manifest``: the role's reads of a queue's manifest, with
    the modes ``missing`` and ``garbage`` (and only those)."""
    mode: str
    """``fail`` (before the store), ``land`` (lands, then reports failure), ``hold`` (a
    conditional write held back and landed later), ``crash`` (the role dies before the call)
    or ``crash_after`` (it dies after the call landed); for ``manifest``, ``missing`` (a 404)
    or ``garbage`` (bytes that do not decode)."""
    after: int = 0
    times: int = 1


class RoleStore(ForwardingStore):
    """One role's view of the shared store, with the faults the schedule armed for it."""

    def __init__(
        self,
        recorder: Recorder,
        name: str,
        world_down: Callable[[], bool],
        *,
        bounded: bool = False,
        cas_delay: float = 0.0,
        late_conflict: float = 0.0,
    ) -> None:
        super().__init__(recorder)
        self.recorder = recorder
        self.name = name
        self.bounded = bounded
        """Its manifest writes carry a deadline (producers, the coordinator, a Spark driver):
        the recorder's ``in_flight_limit`` holds for them."""
        self.cas_delay = cas_delay
        """Real seconds each manifest write takes (the coordinator's: rounds long enough for
        its producers to upload behind a request that is out, and chain it)."""
        self.late_conflict = late_conflict
        """Real seconds a manifest write that lost its compare-and-swap waits before it is
        answered, as SeaweedFS answers some: a writer reading alongside its writes goes on
        without the answer (``Peek.outrun``)."""
        self._down = world_down
        self.faults: list[Fault] = []
        self.dead = False
        self._lock = threading.Lock()
        self.requests = 0
        """Requests made so far, fetches of batch objects not counted (the read-ahead's
        threads send them in no fixed order)."""
        self._interleave: tuple[str, int, Callable[[], None]] | None = None
        self._kinds: dict[str, int] = {}

    def interleave(self, kind: str, at: int, action: Callable[[], None]) -> None:
        """Run ``action`` once, just before this role's request number ``at`` (from 0) of
        ``kind`` is sent, on the thread sending it: another role acts between two of this
        one's. ``kind``: ``any`` (every counted request), ``write`` (every write or delete),
        ``manifest`` (the queue's manifest), ``index`` (the backlog index) or ``dead-letter``
        (copies of set-aside batches)."""
        with self._lock:
            self._interleave = (kind, at, action)

    def _kind(self, path: str) -> str:
        if path in self.recorder.footers:
            return "manifest"
        if "/_millpond/index/" in path:
            return "index"
        if "-dead-letter/" in path:
            return "dead-letter"
        return "other"

    def _point(self, path: str, *, fetch: bool = False, write: bool = False) -> None:
        """A request is about to be sent: count it, and run the interleaved action if due."""
        if fetch and path.endswith(".batch"):
            return
        kinds = (self._kind(path), "any", *(("write",) if write else ()))
        with self._lock:
            self.requests += 1
            seen = {k: self._kinds.get(k, 0) for k in kinds}
            for k in kinds:
                self._kinds[k] = seen[k] + 1
            due = self._interleave
            if due is None or due[0] not in seen or seen[due[0]] != due[1]:
                return
            self._interleave = None
        due[2]()

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def disarm(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take(self, op: str) -> str | None:
        with self._lock:
            if self.dead:
                raise SimulatedCrash(f"{self.name} is dead")
            for fault in self.faults:
                if fault.op not in (op, "any") or (op == "manifest") != (fault.op == "manifest"):
                    continue
                if fault.after > 0:
                    fault.after -= 1
                    continue
                fault.times -= 1
                if fault.times <= 0:
                    self.faults.remove(fault)
                if fault.mode == "crash":
                    self.dead = True
                    raise SimulatedCrash(f"{self.name} crashed before a {op}")
                return fault.mode
        if self._down():
            raise StorageError(f"{self.name}: the store is down (simulated)")
        return None

    def _crashed_after(self, op: str) -> None:
        with self._lock:
            self.dead = True
        raise SimulatedCrash(f"{self.name} crashed after a {op} landed")

    def _read(self, path: str, call: Callable[[], Any], *, garbage: int = 64) -> Any:
        self._point(path, fetch=True)
        if path in self.recorder.footers:
            answer = self._take("manifest")
            if answer == "missing":
                raise NotFoundError(f"{path}: not found (simulated: the manifest answers 404)")
            if answer == "garbage":
                return GetResult(b"\xff" * garbage, '"garbage"')
        mode = self._take("read")
        if mode == "fail":
            raise StorageError(f"{self.name}: injected read failure")
        result = call()
        if mode == "crash_after":
            self._crashed_after("read")
        return result

    def _in_time(self, op: str, path: str, call: Callable[[], Any]) -> Callable[[], Any]:
        """``call``, landing only within the timing assumption of the clock reading it was
        sent on (a thread descheduled past it in real time while the schedule moved the
        clock on would land it later than any real store lets a request live)."""
        limit = self.recorder.in_flight_limit
        sent = self.recorder.clock.last_read()
        if op != "cas" or not self.bounded or limit is None or sent is None:
            return call

        def land() -> Any:
            age = self.recorder.clock.since(sent)
            if age > limit:
                with self.recorder.lock:
                    self.recorder.late.append(f"{self.name}: {path} sent {age:.0f} s ago")
                raise CommitStateUnknownError(
                    f"{path}: request outlived the timing assumption ({age:.0f} s); not landed"
                )
            return call()

        return land

    def _fenced_check(self, op: str, path: str, call: Callable[[], Any]) -> Callable[[], Any]:
        """``call``, noting it when it lands after a takeover fenced this role (decided under
        the recorder's lock, which the landing and :meth:`Recorder.fence` both take); for the
        coordinator, noting a dequeue it wrote that no consumer holding the epoch asked for."""
        if op != "cas" and not path.endswith("/_millpond/index/head"):
            return call
        if self.name == "coordinator":

            def land_for_consumers() -> Any:
                with self.recorder.lock:
                    before = self.recorder.start_of(path)
                    result = call()
                    self.recorder.coordinator_wrote(path, before)
                    return result

            return land_for_consumers

        def land() -> Any:
            with self.recorder.lock:
                result = call()
                if self.name in self.recorder.fenced:
                    self.recorder.fenced_writes.append(
                        f"step {self.recorder.step}: {self.name} wrote {path} after a newer "
                        "consumer's takeover returned"
                    )
                return result

        return land

    def _write(self, op: str, path: str, call: Callable[[], Any], held: bool = False) -> Any:
        self._point(path, write=True)
        call = self._fenced_check(op, path, self._in_time(op, path, call))
        mode = self._take(op)
        if mode == "fail":
            raise CommitStateUnknownError(f"{path}: injected failure before sending")
        if mode == "hold" and held:
            with self.recorder.lock:
                self.recorder.held.append(call)
            raise CommitStateUnknownError(f"{path}: injected timeout (request held back)")
        if op == "cas" and self.cas_delay:
            self.recorder.clock.sleep(self.cas_delay)
        try:
            result = call()
        except ConflictError:
            if op == "cas" and self.late_conflict:
                self.recorder.clock.sleep(self.late_conflict)
            raise
        if mode == "land":
            raise CommitStateUnknownError(f"{path}: injected timeout after the write landed")
        if mode == "crash_after":
            self._crashed_after(op)
        return result

    # -- the ObjectStore surface ----------------------------------------------------------

    def _request(self, op: str, path: str, call: Callable[[], Any], data: bytes = b"") -> Any:
        """One request of this role: a scheduling point before it is sent and after its
        answer (another thread may act in between), and a line in the recorder's trace."""
        runtime = current_runtime()
        if runtime is not None:
            runtime.point("request")
        sent = f"{self.name} {op} {path}" + (f" {self.recorder.digest(data)}" if data else "")
        try:
            result = call()
        except BaseException as err:
            self.recorder.note(f"{sent} !{type(err).__name__}")
            if runtime is not None and not isinstance(err, SimulatedCrash):
                runtime.point("response")
            raise
        self.recorder.note(f"{sent} {self.recorder.describe(result)}")
        if runtime is not None:
            runtime.point("response")
        return result

    def get(self, path: str) -> GetResult:
        result: GetResult = self._request(
            "get", path, lambda: self._read(path, lambda: self.inner.get(path))
        )
        return result

    def get_if_changed(self, path: str, etag: str | None) -> GetResult | None:
        result: GetResult | None = self._request(
            "get_if_changed",
            path,
            lambda: self._read(path, lambda: self.inner.get_if_changed(path, etag)),
        )
        return result

    def get_tail(self, path: str, length: int, etag: str | None = None) -> GetResult | None:
        result: GetResult | None = self._request(
            "get_tail",
            path,
            lambda: self._read(
                path, lambda: self.inner.get_tail(path, length, etag), garbage=length
            ),
        )
        return result

    def head(self, path: str) -> ObjectInfo:
        result: ObjectInfo = self._request(
            "head", path, lambda: self._read(path, lambda: self.inner.head(path))
        )
        return result

    def list(self, prefix: str = "", *, recursive: bool = True) -> builtins.list[ObjectInfo]:
        result: builtins.list[ObjectInfo] = self._request(
            "list",
            prefix,
            lambda: self._read(prefix, lambda: self.inner.list(prefix, recursive=recursive)),
        )
        return result

    def _op(self, path: str) -> str:
        return "cas" if path in self.recorder.footers else "put"

    def put(self, path: str, data: bytes) -> str | None:
        result: str | None = self._request(
            "put", path, lambda: self._write("put", path, lambda: self.inner.put(path, data)), data
        )
        return result

    def put_if_absent(self, path: str, data: bytes) -> str | None:
        op = self._op(path)
        result: str | None = self._request(
            "put_if_absent",
            path,
            lambda: self._write(
                op, path, lambda: self.inner.put_if_absent(path, data), held=op == "cas"
            ),
            data,
        )
        return result

    def put_if_match(self, path: str, data: bytes, etag: str) -> str | None:
        op = self._op(path)
        result: str | None = self._request(
            f"put_if_match({etag})",
            path,
            lambda: self._write(
                op, path, lambda: self.inner.put_if_match(path, data, etag), held=op == "cas"
            ),
            data,
        )
        return result

    def copy(self, source: str, target: str) -> None:
        self._request(
            f"copy({source})",
            target,
            lambda: self._write("put", target, lambda: self.inner.copy(source, target)),
        )

    def delete_many(self, paths: Iterable[str]) -> builtins.list[DeleteFailure]:
        wanted = list(paths)
        result: builtins.list[DeleteFailure] = self._request(
            "delete_many", " ".join(wanted), lambda: self._delete_many(wanted)
        )
        return result

    def _delete_many(self, wanted: builtins.list[str]) -> builtins.list[DeleteFailure]:
        self._point(wanted[0] if wanted else "", write=True)
        mode = self._take("delete")
        if mode == "fail":
            return [DeleteFailure(p, "injected failure") for p in wanted]
        failures: builtins.list[DeleteFailure] = self.inner.delete_many(wanted)
        if mode == "land":
            return [DeleteFailure(p, "injected timeout after the delete landed") for p in wanted]
        if mode == "crash_after":
            self._crashed_after("delete")
        return failures
