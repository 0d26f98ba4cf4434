"""Checks that a store can hold a queue: what ``millpond doctor`` runs, and the cheap part that
producers, consumers and the CLI run at start.

Each check returns a :class:`CheckResult`: pass, fail or skip, what was found, and on a failure
how to fix it. They write only under ``_millpond_check/`` below the store root (never a
``.batch`` object under the data prefix, so GC never sees them) and delete what they wrote.

* :func:`run_store_checks` — every store check, in order: credentials, bucket, permissions,
  conditional create, conditional update, clock skew, manifest. A check that cannot run
  because an earlier one failed is skipped, saying why.
* :func:`preflight` — at start, once per store and process: for a role that lists, one
  listing (credentials, bucket, permission to list); for a writer, one probe object that
  checks conditional writes in 5 requests and, from the store's stamp on it, reads the store's
  clock (a producer, which never lists, sends only these 5). A refusal raises
  :class:`~millpond.errors.StoreAccessError` within seconds; a store that does not answer is
  left to the caller's retries, as before.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, NoReturn

from millpond.common.clock import Clock, SystemClock
from millpond.common.tasks import BackgroundTask
from millpond.errors import (
    ConflictError,
    FormatError,
    NotFoundError,
    StorageError,
    StoreAccessError,
)
from millpond.formats.manifest import decode_manifest
from millpond.storage.store import ObjectStore
from millpond.storage.store_time import StoreTime, probe_store_time

__all__ = [
    "MAX_CLOCK_SKEW",
    "PROBE_PREFIX",
    "CheckResult",
    "preflight",
    "run_store_checks",
    "store_clock_skew",
]

logger = logging.getLogger(__name__)

PROBE_PREFIX = "_millpond_check"
"""Where checks write their probe objects, below the store root."""
MAX_CLOCK_SKEW = 30.0
"""Seconds of skew against the store's clock above which the clock check fails."""
PREFLIGHT_TIMEOUT = 5.0
"""Seconds :func:`preflight` waits for a store that does not answer before carrying on."""

Status = Literal["pass", "fail", "skip"]

_CONDITIONAL_HINT = (
    "this store cannot hold a queue manifest safely: use a release that enforces "
    "conditional writes (older SeaweedFS, MinIO and Ceph releases accept or ignore "
    "If-None-Match / If-Match), or another store"
)
_PROBE_FIRST = b"millpond start-up check\n"
_PROBE_UPDATED = b"millpond start-up check, updated\n"
_passed: set[str] = set()  # stores (and checks) this process has passed once already
_passed_lock = threading.Lock()


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check: its name, pass/fail/skip, what was found and, on a failure, a fix."""

    name: str
    status: Status
    detail: str
    hint: str = ""

    @property
    def ok(self) -> bool:
        """Whether the check did not fail (a skip is not a failure of its own)."""
        return self.status != "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _result(name: str, ok: bool, detail: str, hint: str = "") -> CheckResult:
    return CheckResult(name=name, status="pass" if ok else "fail", detail=detail, hint=hint)


def run_store_checks(
    store: ObjectStore,
    *,
    manifest_path: str = "ingest/manifest",
    clock: Clock | None = None,
    max_skew: float = MAX_CLOCK_SKEW,
) -> list[CheckResult]:
    """Every store check, in order; none raises for what it finds.

    Args:
        store: the store to check.
        manifest_path: the queue manifest to read.
        clock: this machine's clock (for the skew check).
        max_skew: seconds of clock skew that still pass.

    Returns:
        One result per check: credentials, bucket, permissions, conditional_create,
        conditional_update, clock_skew, manifest.
    """
    results = _access_checks(store)
    base = f"{PROBE_PREFIX}/{uuid.uuid4().hex}"
    if not all(r.ok for r in results):
        why = next(r.name for r in results if not r.ok)
        names = ("permissions", "conditional_create", "conditional_update", "clock_skew")
        results += [_skip(name, f"{why} failed") for name in names]
        results.append(_skip("manifest", f"{why} failed"))
        return results
    results.append(_guarded("permissions", lambda: _permissions(store, f"{base}/object")))
    create = _guarded("conditional_create", lambda: _conditional_create(store, f"{base}/cas"))
    results.append(create)
    if create.ok:
        results.append(
            _guarded("conditional_update", lambda: _conditional_update(store, f"{base}/cas"))
        )
    else:
        results.append(_skip("conditional_update", "conditional_create failed"))
    results.append(
        _guarded("clock_skew", lambda: _clock_skew(store, f"{base}/clock", clock, max_skew))
    )
    store.delete_many([f"{base}/object", f"{base}/cas", f"{base}/clock"])
    results.append(_guarded("manifest", lambda: _manifest(store, manifest_path)))
    return results


def _skip(name: str, why: str) -> CheckResult:
    return CheckResult(name=name, status="skip", detail=f"skipped: {why}")


def _guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    try:
        return check()
    except StoreAccessError as err:
        return _result(name, False, err.message, err.hint)
    except StorageError as err:
        return _result(name, False, f"the store failed: {err}", "check the endpoint and network")


def _access_checks(store: ObjectStore) -> list[CheckResult]:
    """Credentials and bucket, from one listing under the probe prefix."""
    source = store.credential_source()
    bucket = _bucket_name(store)
    try:
        store.list(PROBE_PREFIX, recursive=False)
    except StoreAccessError as err:
        if err.problem not in ("bucket", "permission"):
            return [
                _result("credentials", False, err.message, err.hint),
                _skip("bucket", "credentials failed"),
            ]
        said = err.message if err.problem == "bucket" else f"cannot list {bucket}: {err.message}"
        found = _result("bucket", False, said, err.hint)
    except StorageError as err:
        return [
            _result(
                "credentials",
                False,
                f"{source}; could not reach the store to try them: {err}",
                "check the endpoint URL, the network and that the store is up",
            ),
            _skip("bucket", "the store did not answer"),
        ]
    else:
        found = _result("bucket", True, f"{bucket} exists and lists")
    return [_result("credentials", True, f"{source}; accepted"), found]


def _permissions(store: ObjectStore, path: str) -> CheckResult:
    steps: list[tuple[str, Callable[[], object]]] = [
        ("put", lambda: store.put(path, b"millpond doctor")),
        ("get", lambda: store.get(path)),
        ("list", lambda: store.list(path.rpartition("/")[0])),
        ("delete", lambda: store.delete_many([path])),
    ]
    for name, step in steps:
        try:
            outcome = step()
        except (StoreAccessError, StorageError) as err:
            said, hint = (err.message, err.hint) if isinstance(err, StoreAccessError) else (err, "")
            return _result(
                "permissions",
                False,
                f"{name} refused under {store.url}: {said}",
                hint or f"allow list, get, put and delete under {store.url}",
            )
        if name == "get" and getattr(outcome, "data", None) != b"millpond doctor":
            return _result("permissions", False, f"get of {path} returned other bytes")
        if name == "list" and path not in {getattr(i, "path", None) for i in outcome}:  # type: ignore[attr-defined]
            return _result("permissions", False, f"list under {store.url} misses {path}")
        if name == "delete" and outcome:
            return _result("permissions", False, f"delete of {path} failed: {outcome}")
    return _result("permissions", True, f"put, get, list and delete allowed under {store.url}")


def _conditional_create(store: ObjectStore, path: str) -> CheckResult:
    store.put_if_absent(path, b"first")
    try:
        store.put_if_absent(path, b"second")
    except ConflictError:
        pass
    else:
        return _result(
            "conditional_create",
            False,
            "a second create-if-absent (If-None-Match: *) of one object was accepted",
            _CONDITIONAL_HINT,
        )
    if store.get(path).data != b"first":
        return _result(
            "conditional_create",
            False,
            "a refused create-if-absent (If-None-Match: *) overwrote the object anyway",
            _CONDITIONAL_HINT,
        )
    return _result("conditional_create", True, "a second If-None-Match: * create was rejected")


def _conditional_update(store: ObjectStore, path: str) -> CheckResult:
    stale = store.get(path).etag
    if stale is None:
        return _result("conditional_update", False, "the store returns no ETag", _CONDITIONAL_HINT)
    store.put_if_match(path, b"update", stale)
    try:
        store.put_if_match(path, b"stale write", stale)
    except ConflictError:
        pass
    else:
        return _result(
            "conditional_update",
            False,
            "an update conditional on a stale ETag (If-Match) was accepted",
            _CONDITIONAL_HINT,
        )
    if store.get(path).data != b"update":
        return _result(
            "conditional_update",
            False,
            "a refused stale update (If-Match) overwrote the object anyway",
            _CONDITIONAL_HINT,
        )
    return _result("conditional_update", True, "an If-Match update on a stale ETag was rejected")


def store_clock_skew(store: ObjectStore, path: str, clock: Clock | None = None) -> float:
    """Seconds the store's clock is ahead of this machine's (negative: behind).

    The probe of :mod:`millpond.storage.store_time` (write a tiny object at ``path``, read its
    last-modified time back); a skew within the probe's uncertainty (about a second, as stores
    keep whole seconds) reads as 0.

    Raises:
        StorageError: the store failed.
        StoreAccessError: the store refused.
    """
    probe = probe_store_time(store, path, clock or SystemClock())
    return probe.skew_seconds if probe.offset_ms >= 0 else -probe.skew_seconds


def _clock_skew(store: ObjectStore, path: str, clock: Clock | None, max_skew: float) -> CheckResult:
    skew = store_clock_skew(store, path, clock)
    direction = "ahead of" if skew > 0 else "behind"
    detail = (
        "this machine's clock agrees with the store's (within 1 s)"
        if skew == 0
        else f"the store's clock is {abs(skew):.1f} s {direction} this machine's"
    )
    ok = abs(skew) <= max_skew
    return _result(
        "clock_skew",
        ok,
        detail,
        ""
        if ok
        else f"sync this machine's clock (NTP): GC and re-uploads compare batch "
        f"names' times across machines, and tolerate at most {max_skew:.0f} s",
    )


def _manifest(store: ObjectStore, manifest_path: str) -> CheckResult:
    try:
        got = store.get(manifest_path)
    except NotFoundError:
        return _result(
            "manifest",
            True,
            f"no manifest yet at {store.url}/{manifest_path}: the first producer (or "
            "`millpond consume --create`) creates it",
        )
    try:
        manifest = decode_manifest(got.data, name=manifest_path)
    except FormatError as err:
        return _result(
            "manifest", False, str(err), "see `millpond inspect`; restore it from a backup"
        )
    return _result(
        "manifest",
        True,
        f"{store.url}/{manifest_path}: {len(manifest.entries)} entries, epoch "
        f"{manifest.epoch}, next sequence {manifest.next_sequence}",
    )


def _bucket_name(store: ObjectStore) -> str:
    scheme, _, rest = store.url.partition("://")
    noun = "container" if scheme == "az" else "bucket"
    return f"{noun} {rest.split('/', 1)[0]!r}" if rest else store.url


def preflight(
    store: ObjectStore,
    *,
    write: bool,
    lists: bool = True,
    clock: Clock | None = None,
    timeout: float = PREFLIGHT_TIMEOUT,
) -> StoreTime | None:
    """The cheap checks at start: fail fast on what no retry fixes.

    For a caller that lists (``lists``), one listing of the probe prefix: credentials, bucket,
    permission to list. For a writer, one probe object that shows a second create-if-absent
    and an update on an ETag the object does not have are both refused and leave it as it was
    (:func:`_probe_conditional_writes`, 5 requests); its first write also proves credentials,
    bucket and permission to write, and the store's stamp on it gives the store's clock, which
    the caller gets back instead of probing again. A producer, which never lists, sends only
    the probe.

    Once per store and process: what passed is not checked again (later refusals still
    surface as errors), and then no clock is returned. Local stores (memory, ``file://``) are
    not checked. A store that fails or does not answer within ``timeout`` is left to the
    caller's own retries (the check goes on in the background and only logs).

    Args:
        store: the store about to be used.
        write: whether the caller will write (producers, consumers).
        lists: whether the caller will list objects (consumers and collectors do; producers
            do not).
        clock: this machine's clock, against which the store's is read; default the system's.
        timeout: seconds to wait for an answer.

    Returns:
        The store's clock as read from the probe's write, when this call wrote one and the
        store stamped it; otherwise ``None``.

    Raises:
        StoreAccessError: credentials missing or rejected, the bucket missing, listing (or
            writing) not allowed, or conditional writes that do not reject a stale write.
    """
    if store.is_local:
        return None
    check = _Background(store, write=write, lists=lists, clock=clock)
    if not BackgroundTask("millpond-preflight", check.run).start().join(timeout):
        check.abandoned.set()  # the start carries on without it: a refusal is only logged
        logger.warning(
            "store check at start: %s did not answer within %.0f s; carrying on",
            store.url,
            timeout,
        )
        return None
    if check.refusal is not None:
        raise check.refusal
    return check.measured


class _Background:
    """One :func:`preflight` check, run on a thread of its own so the start need not wait for a
    store that does not answer."""

    def __init__(
        self, store: ObjectStore, *, write: bool, lists: bool, clock: Clock | None
    ) -> None:
        self._store = store
        self._write = write
        self._lists = lists
        self._clock = clock
        self.refusal: StoreAccessError | None = None
        """What the store refused, once :meth:`run` has finished."""
        self.measured: StoreTime | None = None
        """The store's clock as the probe read it, once :meth:`run` has finished."""
        self.abandoned = threading.Event()
        """Set once the start carried on without the check."""

    def run(self) -> None:
        """The task's body: check, keep what was found, log what comes too late to raise."""
        store = self._store
        try:
            self.measured = _preflight(
                store, write=self._write, lists=self._lists, clock=self._clock
            )
        except StoreAccessError as err:
            self.refusal = err
            if self.abandoned.is_set():  # too late to fail the start: say it loudly
                logger.error("store check at start: %s", err)  # noqa: TRY400
        except StorageError as err:
            logger.warning(
                "store check at start: %s did not answer (%s); carrying on", store.url, err
            )


def _preflight(
    store: ObjectStore, *, write: bool, lists: bool, clock: Clock | None
) -> StoreTime | None:
    base = f"{type(store).__name__}:{store.url}"
    listed, written = f"{base}:list", f"{base}:conditional_writes"
    with _passed_lock:
        need_list = (lists or not write) and listed not in _passed
        need_probe = write and written not in _passed
    if need_list:
        store.list(PROBE_PREFIX, recursive=False)
        with _passed_lock:
            _passed.add(listed)
    if not need_probe:
        return None
    measured = _probe_conditional_writes(store, clock or SystemClock())
    with _passed_lock:
        _passed.add(written)
    return measured


def _probe_conditional_writes(store: ObjectStore, clock: Clock) -> StoreTime | None:
    """Check conditional writes on one new probe object, then delete it: 6 requests.

    1. create-if-absent: the probe (credentials, bucket and permission to write with it);
    2. create-if-absent again: must be refused (``If-None-Match: *``);
    3. update conditional on the probe's current ETag: must succeed. A store that refuses it
       (ETags that do not round-trip) would refuse every manifest append, for ever; the
       store stamps this write with its own time;
    4. update conditional on the first ETag, now stale: must be refused (``If-Match``);
    5. HEAD: the probe has step 3's ETag (no refused write landed anyway), and its
       last-modified time gives the store's clock;
    6. delete the probe.

    ``millpond doctor`` (:func:`run_store_checks`) checks the same with more requests.

    Returns:
        The store's clock, read from step 3's write; ``None`` if the store keeps no time.

    Raises:
        StoreAccessError: a refusal (credentials, bucket, permission), or conditional writes
            that do not work (``problem="conditional_writes"``).
        StorageError: the store failed.
    """
    path = f"{PROBE_PREFIX}/{uuid.uuid4().hex}/cas"
    try:
        etag = store.put_if_absent(path, _PROBE_FIRST)
    except StorageError:
        store.delete_many([path])  # the create may have landed before the failure
        raise
    try:
        return _judge_probe(store, path, etag, clock)
    finally:
        store.delete_many([path])


def _judge_probe(store: ObjectStore, path: str, etag: str | None, clock: Clock) -> StoreTime | None:
    if etag is None:  # the write's answer carried none: ask for it (one more request)
        etag = store.head(path).etag
        if etag is None:
            _refuse_conditional(store, "the store returns no ETag")
    try:
        store.put_if_absent(path, b"second")
    except ConflictError:
        pass
    else:
        _refuse_conditional(
            store, "a second create-if-absent (If-None-Match: *) of one object was accepted"
        )
    before = clock.now_ms()
    try:
        updated = store.put_if_match(path, _PROBE_UPDATED, etag)
    except ConflictError:
        if store.get(path).data == b"second":
            _refuse_conditional(
                store, "a refused create-if-absent (If-None-Match: *) overwrote the object anyway"
            )
        _refuse_conditional(
            store,
            "an update conditional on the object's current ETag (If-Match) was refused: the "
            "ETags the store returns do not match its own",
        )
    after = clock.now_ms()
    try:
        store.put_if_match(path, b"stale write", etag)
    except ConflictError:
        pass
    else:
        _refuse_conditional(store, "an update conditional on a stale ETag (If-Match) was accepted")
    info = store.head(path)
    # Another ETag than the update's: the refused write landed anyway, or the store spells
    # ETags differently in HEAD answers than in write answers. The bytes tell which.
    if (updated is None or info.etag != updated) and store.get(path).data != _PROBE_UPDATED:
        _refuse_conditional(store, "a refused stale update (If-Match) overwrote the object anyway")
    if info.last_modified is None:
        return None
    return StoreTime.from_write(info.last_modified, before, after)


def _refuse_conditional(store: ObjectStore, detail: str) -> NoReturn:
    raise StoreAccessError(
        f"{store.url}: conditional writes do not work: {detail}",
        problem="conditional_writes",
        hint=_CONDITIONAL_HINT,
    )
