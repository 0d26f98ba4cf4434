"""The object-store adapter, on every store (memory, file, moto, SeaweedFS, Azurite, GCS).

Each test opens the store named by the parametrized ``any_store_target`` fixture, so one
behaviour is checked the same way on all six.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import obstore
import pytest

from millpond.errors import ConfigError, ConflictError, NotFoundError
from millpond.localstack import AzureEndpoint
from millpond.storage import GetResult, ObjectStore, open_store
from millpond.storage.file_store import FileStore
from tests.support import StoreTarget, unique_root

from ._helpers import open_target


@pytest.fixture
def store(any_store_target: StoreTarget) -> ObjectStore:
    return open_target(any_store_target)


def test_get_returns_bytes_and_the_put_etag(store: ObjectStore) -> None:
    etag = store.put("a/obj", b"hello")
    got = store.get("a/obj")
    assert got.data == b"hello"
    assert got.etag
    assert etag == got.etag
    assert store.head("a/obj").size == 5


def test_put_overwrites_and_changes_etag(store: ObjectStore) -> None:
    first = store.put("a/obj", b"one")
    second = store.put("a/obj", b"two")
    assert first != second
    assert store.get("a/obj") == type(store.get("a/obj"))(data=b"two", etag=second)


def test_missing_object_is_not_found(store: ObjectStore) -> None:
    with pytest.raises(NotFoundError):
        store.get("nope/obj")
    with pytest.raises(FileNotFoundError):  # plain except clauses work too
        store.head("nope/obj")
    with pytest.raises(NotFoundError):
        store.get_if_changed("nope/obj", None)
    with pytest.raises(NotFoundError):
        store.get_if_changed("nope/obj", "some-etag")


def test_put_if_absent_creates_once(store: ObjectStore) -> None:
    etag = store.put_if_absent("m", b"first")
    assert etag == store.get("m").etag
    with pytest.raises(ConflictError):
        store.put_if_absent("m", b"second")
    assert store.get("m").data == b"first"


def test_put_if_match_refuses_a_stale_etag(store: ObjectStore) -> None:
    stale = store.put_if_absent("m", b"v1")
    assert stale is not None
    current = store.put_if_match("m", b"v2", stale)
    assert current is not None
    assert current != stale
    with pytest.raises(ConflictError):
        store.put_if_match("m", b"v3-lost", stale)
    got = store.get("m")
    assert got.data == b"v2"
    assert got.etag == current
    newest = store.put_if_match("m", b"v3", current)
    assert store.get("m").data == b"v3"
    assert store.get("m").etag == newest


def test_put_if_match_on_a_missing_object_conflicts(store: ObjectStore) -> None:
    etag = store.put("other", b"x")
    assert etag is not None
    with pytest.raises(ConflictError):
        store.put_if_match("missing", b"y", etag)
    with pytest.raises(NotFoundError):
        store.get("missing")


def test_get_if_changed(store: ObjectStore) -> None:
    etag = store.put("m", b"v1")
    assert store.get_if_changed("m", etag) is None
    full = store.get_if_changed("m", None)
    assert full is not None
    assert full.data == b"v1"
    new_etag = store.put("m", b"v2")
    changed = store.get_if_changed("m", etag)
    assert changed is not None
    assert (changed.data, changed.etag) == (b"v2", new_etag)
    assert store.get_if_changed("m", new_etag) is None


def test_get_tail_reads_the_last_bytes_unless_unchanged(store: ObjectStore) -> None:
    # The consumer's fence check (issue 44, case 2: Azure Blob refused the suffix range).
    data = b"0123456789" * 3
    first = store.put("m", data)
    assert store.get_tail("m", 22) == GetResult(data=data[-22:], etag=first)
    assert store.get_tail("m", 22, first) is None
    second = store.put("m", b"short")
    # Shorter than asked for: all of it, with the ETag of that version.
    assert store.get_tail("m", 22, first) == GetResult(data=b"short", etag=second)
    assert store.get_tail("m", 22, second) is None
    with pytest.raises(NotFoundError):
        store.get_tail("missing", 22)
    with pytest.raises(NotFoundError):
        store.get_tail("missing", 22, first)


def test_case2_get_tail_on_azure_reads_one_version_when_replaced_between_head_and_range(
    azurite_blob: AzureEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Azure takes no suffix range: a HEAD for the size, then a range pinned to its ETag. A
    writer replacing the object between the two must not yield one version's bytes with
    another's ETag (the fence check would then 304 forever on an epoch it never read): the
    range is refused (412) and one whole conditional GET answers. The write in between is a
    real one, on the real server, made when the HEAD has returned."""
    url = azurite_blob.url_for(unique_root())
    store = open_store(url, azurite_blob.store_options())
    writer = open_store(url, azurite_blob.store_options())
    seen = store.put("m", b"v1" * 10 + b"FOOTER-ONE")
    store.put("m", b"v2" * 20 + b"FOOTER-TWO")
    newest = b"v3" * 30 + b"FOOTER-333"
    written: list[str | None] = []
    sent: list[dict[str, Any]] = []
    real_get = obstore.get

    def get_then_replace(target: Any, path: str, *, options: Any = None) -> Any:
        sent.append(dict(options or {}))
        result = real_get(target, path, options=options)
        if (options or {}).get("head") and not written:
            written.append(writer.put("m", newest))
        return result

    monkeypatch.setattr(obstore, "get", get_then_replace)
    got = store.get_tail("m", 10, seen)
    assert got == GetResult(data=b"FOOTER-333", etag=written[0])
    assert [sorted(options) for options in sent] == [
        ["head", "if_none_match"],  # 200: changed since `seen`; v2's size and ETag
        ["if_match", "range"],  # 412: v3 replaced v2 meanwhile
        ["if_none_match"],  # v3, whole: bytes and ETag from one answer
    ]
    monkeypatch.undo()
    # Undisturbed: a 304 on the HEAD, or the range of the version the HEAD named.
    assert store.get_tail("m", 10, written[0]) is None
    assert store.get_tail("m", 10, seen) == GetResult(data=b"FOOTER-333", etag=written[0])


def test_copy_copies_the_bytes_and_overwrites(store: ObjectStore) -> None:
    """The quarantine and the Spark commit copy objects. fake-gcs-server's proxy once turned
    obstore's copy (a PUT with ``x-goog-copy-source`` and no body) into an upload of nothing."""
    etag = store.put("a/src", b"payload")
    store.copy("a/src", "b/new copy")
    assert store.get("b/new copy").data == b"payload"
    store.put("b/old", b"older bytes")
    store.copy("a/src", "b/old")
    assert store.get("b/old").data == b"payload"
    assert store.head("b/old").size == len(b"payload")
    assert store.get("a/src") == GetResult(data=b"payload", etag=etag)


def test_copy_of_a_missing_object_is_not_found_and_writes_nothing(store: ObjectStore) -> None:
    with pytest.raises(NotFoundError):
        store.copy("nope/obj", "b/dst")
    with pytest.raises(NotFoundError):
        store.get("b/dst")
    store.put("b/kept", b"kept")
    with pytest.raises(NotFoundError):
        store.copy("nope/obj", "b/kept")
    assert store.get("b/kept").data == b"kept"


def test_list_recursive_and_not(store: ObjectStore) -> None:
    for path in ["p/a", "p/b", "p/sub/c", "p/sub/deeper/d", "pother/x", "top"]:
        store.put(path, path.encode())
    recursive = {info.path: info.size for info in store.list("p")}
    assert recursive == {"p/a": 3, "p/b": 3, "p/sub/c": 7, "p/sub/deeper/d": 14}
    flat = {info.path for info in store.list("p", recursive=False)}
    assert flat == {"p/a", "p/b"}  # nested prefixes are excluded
    assert {info.path for info in store.list("p/", recursive=False)} == flat
    assert {info.path for info in store.list("p/sub", recursive=False)} == {"p/sub/c"}
    everything = {info.path for info in store.list()}
    assert everything == {"p/a", "p/b", "p/sub/c", "p/sub/deeper/d", "pother/x", "top"}
    assert {info.path for info in store.list(recursive=False)} == {"top"}
    assert store.list("absent") == []
    assert store.list("absent", recursive=False) == []


def test_list_range_lists_directly_under_the_prefix_in_name_order_between_bounds(
    store: ObjectStore,
) -> None:
    """What GC lists: only names below the queue's floor, in order, nested objects left out."""
    for path in ["q/05", "q/01", "q/03", "q/04", "q/02", "q/sub/00", "q/_millpond/x", "qq/00"]:
        store.put(path, path.encode())
    assert [i.path for i in store.list_range("q")] == ["q/01", "q/02", "q/03", "q/04", "q/05"]
    assert [(i.path, i.size) for i in store.list_range("q", end_before="q/03")] == [
        ("q/01", 4),
        ("q/02", 4),
    ]
    assert [i.path for i in store.list_range("q", start_after="q/02", end_before="q/05")] == [
        "q/03",
        "q/04",
    ]
    assert list(store.list_range("q", end_before="q/")) == []
    assert list(store.list_range("absent")) == []
    assert [i.path for i in store.list_range("", end_before="q")] == []


def test_delete_many_with_a_missing_object(store: ObjectStore) -> None:
    for path in ["d/1", "d/2", "d/3"]:
        store.put(path, b"x")
    failures = store.delete_many(iter(["d/1", "d/missing", "d/3"]))
    assert failures == []
    assert {info.path for info in store.list("d")} == {"d/2"}
    assert store.delete_many([]) == []


def test_delete_many_in_bulk(store: ObjectStore, any_store_target: StoreTarget) -> None:
    # More than one S3 DeleteObjects request (1000 keys each). The Azure and GCS emulators take
    # 6-11 s for a thousand deletes of mostly missing objects; a few dozen test the same path.
    count = 60 if any_store_target.kind in ("azurite", "gcs") else 1005
    paths = [f"bulk/{i:04d}" for i in range(count)]
    for path in paths[:20]:
        store.put(path, b"x")
    assert store.delete_many(paths) == []
    assert store.list("bulk") == []


def test_open_store_rejects_unknown_schemes() -> None:
    with pytest.raises(ConfigError) as info:
        open_store("ftp://user:secret@host/x")
    assert info.value.key == "store"
    assert "secret" not in str(info.value)


def test_file_store_checks_a_version_without_reading_the_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence check on a file store: an 82 MB manifest was read and hashed for every check.
    The write records its hash on the file; a check reads the attribute and the tail only."""
    import millpond.storage.file_store as file_store

    store = FileStore(tmp_path)
    data = b"x" * 100_000 + b"footer"
    etag = store.put("m", data)
    hashed: list[int] = []
    real = file_store._etag
    monkeypatch.setattr(file_store, "_etag", lambda data: hashed.append(len(data)) or real(data))
    assert store.get_tail("m", 6, etag) is None
    assert store.get_if_changed("m", etag) is None
    assert store.get_tail("m", 6) == GetResult(data=b"footer", etag=etag)
    assert store.put_if_match("m", b"new", etag) == real(b"new")
    assert hashed == [3]  # only the bytes written
    # Changed by hand (a new time): the content is hashed again, the ETag is still its hash.
    (tmp_path / "m").write_bytes(b"by hand")
    assert store.get_tail("m", 4, real(b"new")) == GetResult(data=b"hand", etag=real(b"by hand"))


def test_file_store_refuses_paths_outside_its_root(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    for bad in ["../escape", "a/../../b", "", ".hidden", "a/.lock"]:
        with pytest.raises(ConfigError):
            store.put(bad, b"x")
    store.put("a/b", b"x")
    # Lock and temp files stay invisible.
    assert [info.path for info in store.list()] == ["a/b"]


@pytest.mark.parametrize("allow_http", ["true", "false"])
def test_open_s3_with_aws_allow_http_option(allow_http: str) -> None:
    # obstore 0.12 panics on ``aws_allow_http`` in its S3 config; the adapter moves it to the
    # client options. Opening does no IO, so no server is needed.
    store = open_store(
        "s3://bucket/root",
        {
            "aws_endpoint": "http://127.0.0.1:9",
            "aws_allow_http": allow_http,
            "aws_access_key_id": "k",
            "aws_secret_access_key": "s",
            "aws_region": "us-east-1",
        },
    )
    assert store.url == "s3://bucket/root"


def test_open_s3_from_the_standard_aws_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    assert open_store("s3://bucket").url == "s3://bucket"


def test_store_survives_pickling(any_store_target: StoreTarget) -> None:
    # Producers hand stores to worker processes (Spark executors, multiprocessing).
    store = open_target(any_store_target)
    if not any_store_target.shareable:
        with pytest.raises(TypeError):  # a memory store lives in one process only
            pickle.dumps(store)
        return
    etag = store.put_if_absent("m", b"v1")
    assert etag is not None
    copy = pickle.loads(pickle.dumps(store))
    assert copy.url == store.url
    assert copy.get("m").data == b"v1"
    copy.put_if_match("m", b"v2", etag)  # the conditional-put setting survives
    with pytest.raises(ConflictError):
        copy.put_if_match("m", b"v3", etag)
    assert store.get("m").data == b"v2"


def test_open_store_adopts_an_obstore_object_and_an_object_store() -> None:
    from obstore.store import MemoryStore

    adopted = open_store(MemoryStore())
    etag = adopted.put_if_absent("k", b"1")
    assert etag is not None
    adopted.put_if_match("k", b"2", etag)
    assert adopted.get("k").data == b"2"
    assert open_store(adopted) is adopted
    with pytest.raises(ConfigError):
        open_store(object())


def test_file_store_reports_objects_it_cannot_delete(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    store.put("dir/inner", b"x")
    store.put("gone", b"x")
    failures = store.delete_many(["dir", "gone", "missing"])  # "dir" is a directory
    assert [f.path for f in failures] == ["dir"]
    assert failures[0].reason
    assert {info.path for info in store.list()} == {"dir/inner"}


def test_file_store_creates_nothing_until_the_first_write(tmp_path: Path) -> None:
    root = tmp_path / "typo" / "queue"
    store = open_store(root.as_uri())
    assert store.list() == []
    with pytest.raises(NotFoundError):
        store.get("ingest/manifest")
    assert store.delete_many(["ingest/x.batch"]) == []
    assert not (tmp_path / "typo").exists()
    store.put_if_absent("ingest/manifest", b"m")
    assert (root / "ingest" / "manifest").read_bytes() == b"m"


def _hidden_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))


def test_file_store_leaves_no_lock_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = FileStore(root)
    etag = store.put_if_absent("ingest/01J0000000000000000000000A.batch", b"batch")
    store.put("ingest/other", b"x")
    first = store.put_if_absent("ingest/manifest", b"v1")
    assert first is not None
    assert etag is not None
    store.put_if_match("ingest/manifest", b"v2", first)
    with pytest.raises(ConflictError):
        store.put_if_match("ingest/manifest", b"v3", first)
    assert _hidden_files(root) == []
    assert store.delete_many(["ingest/01J0000000000000000000000A.batch"]) == []
    assert _hidden_files(root) == []
    assert {i.path for i in store.list()} == {"ingest/other", "ingest/manifest"}


def test_file_store_lock_survives_its_file_being_removed_under_waiters(tmp_path: Path) -> None:
    # Writers race on one object while each release removes the lock file: every
    # compare-and-swap must still see exactly one winner per round.
    import threading

    store = FileStore(tmp_path / "root")
    store.put_if_absent("counter", b"0")
    wins: list[int] = []

    def worker() -> None:
        for _ in range(100):
            while True:
                got = store.get("counter")
                assert got.etag is not None
                value = int(got.data)
                try:
                    store.put_if_match("counter", str(value + 1).encode(), got.etag)
                except ConflictError:
                    continue
                wins.append(value)
                break

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert int(store.get("counter").data) == 400
    assert sorted(wins) == list(range(400))  # no two writers ever won from the same value
    assert _hidden_files(tmp_path / "root") == []


def test_a_query_or_fragment_in_a_store_url_is_refused_not_cut_off(
    any_store_target: StoreTarget,
) -> None:
    """``s3://b/q?x`` and ``s3://b/q#y`` were both opened at ``s3://b/q``: two queues meant to
    be apart were silently one (and ``file:///…/q?x`` was the directory ``q``)."""
    url, options = any_store_target.url, dict(any_store_target.options)
    for tail in ("?x", "#y", "?"):
        with pytest.raises(ConfigError) as info:
            open_store(f"{url}/q{tail}", options)
        assert info.value.key == "store"
        assert "%3F" in str(info.value)
    # Written as %3F and %23 they belong to the root: three roots, three places.
    roots = {root: open_store(f"{url}/{root}", options) for root in ("q", "q%3Fx", "q%23y")}
    for root, store in roots.items():
        store.put("k", root.encode())
    assert {root: store.get("k").data for root, store in roots.items()} == {
        root: root.encode() for root in roots
    }


def test_location_names_where_the_objects_are_and_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
    secret = "s3cr3t-value-never-shown"

    def s3(endpoint: str, key: str = secret) -> ObjectStore:
        return open_store(
            "s3://bucket/root",
            {
                "aws_endpoint": endpoint,
                "aws_access_key_id": "id",
                "aws_secret_access_key": key,
                "aws_region": "us-east-1",
            },
        )

    one = s3("http://127.0.0.1:9000")
    assert one.location() == s3("http://127.0.0.1:9000", key="another").location()
    assert one.location() != s3("http://127.0.0.1:9001").location()
    assert secret not in one.location()
    assert "bucket" in one.location()
    # A memory store lives in one process: its location is that store object's.
    assert open_store("memory://a").location() == open_store("memory://a").location()
    assert open_store("memory://a").location() != open_store("memory://b").location()
    # A directory is where it resolves to, however the URL spells it.
    (tmp_path / "q").mkdir()
    assert (
        open_store(f"file://{tmp_path}/q").location()
        == open_store(f"file://{tmp_path}/x/../q").location()
    )
