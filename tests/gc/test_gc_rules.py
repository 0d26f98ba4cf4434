"""The RFC's deletion rules as a pure function: each rule alone, its boundaries, and a property."""

from __future__ import annotations

from gc_support import T0, ulid_at
from hypothesis import given, settings
from hypothesis import strategies as st

from millpond.common.ulids import parse_batch_name, ulid_time_ms
from millpond.formats.manifest import Footer, Manifest, ManifestEntry
from millpond.queue.gc_rules import KeepReason, plan_collection
from millpond.storage.store import ObjectInfo

GRACE = 10_000


def _manifest(*locations: str) -> Manifest:
    entries = tuple(ManifestEntry(sequence=i, location=loc) for i, loc in enumerate(locations))
    footer = Footer(entry_count=len(entries), next_sequence=len(entries), epoch=1)
    return Manifest(footer=footer, entries=entries)


def _objects(*paths: str) -> list[ObjectInfo]:
    return [ObjectInfo(path=p, size=1) for p in paths]


def _plan(
    objects: list[ObjectInfo], manifest: Manifest, now_ms: int
) -> tuple[set[str], dict[KeepReason, int]]:
    plan = plan_collection(
        objects, manifest, data_path_prefix="ingest", now_ms=now_ms, grace_period_ms=GRACE
    )
    return set(plan.delete), dict(plan.kept)


def test_each_rule_keeps_what_it_protects() -> None:
    old = f"ingest/{ulid_at(T0)}.batch"
    referenced = f"ingest/{ulid_at(T0 + 55_000)}.batch"
    head = f"ingest/{ulid_at(T0 + 50_000)}.batch"
    newer_than_head = f"ingest/{ulid_at(T0 + 60_000)}.batch"
    in_grace = f"ingest/{ulid_at(T0 + 45_000)}.batch"
    objects = _objects(
        old,
        referenced,
        head,
        newer_than_head,
        in_grace,
        "ingest/manifest",
        "ingest/notes.txt",
        f"ingest/{ulid_at(T0).lower()}.batch",
        f"ingest/{ulid_at(T0)}.batch.tmp",
        f"ingest/nested/{ulid_at(T0)}.batch",
        f"other/{ulid_at(T0)}.batch",
        f"{ulid_at(T0)}.batch",
    )
    deleted, kept = _plan(objects, _manifest(referenced, head), now_ms=T0 + 50_000)
    assert deleted == {old}
    assert kept == {
        KeepReason.REFERENCED: 2,
        KeepReason.NOT_OLDER_THAN_QUEUE: 1,
        KeepReason.IN_GRACE_PERIOD: 1,
        KeepReason.NOT_A_BATCH: 4,
        KeepReason.OUTSIDE_PREFIX: 3,
    }


def test_boundaries_are_strict() -> None:
    floor = f"ingest/{ulid_at(T0 + 20_000)}.batch"
    at_floor = f"ingest/{ulid_at(T0 + 20_000)}.batch"
    at_grace = f"ingest/{ulid_at(T0)}.batch"
    just_past_grace = f"ingest/{ulid_at(T0 - 1)}.batch"
    deleted, kept = _plan(
        _objects(at_floor, at_grace, just_past_grace), _manifest(floor), now_ms=T0 + GRACE
    )
    assert deleted == {just_past_grace}
    assert kept == {KeepReason.NOT_OLDER_THAN_QUEUE: 1, KeepReason.IN_GRACE_PERIOD: 1}


def test_empty_manifest_drops_only_the_queue_floor_rule() -> None:
    old = f"ingest/{ulid_at(T0)}.batch"
    young = f"ingest/{ulid_at(T0 + 5_000)}.batch"
    deleted, kept = _plan(_objects(old, young), _manifest(), now_ms=T0 + GRACE + 1)
    assert deleted == {old}
    assert kept == {KeepReason.IN_GRACE_PERIOD: 1}


def test_queue_floor_is_the_oldest_name_not_the_first_entry() -> None:
    # Producers mint names before their CAS wins: the first entry may be the younger one.
    first = f"ingest/{ulid_at(T0 + 30_000)}.batch"
    older_second = f"ingest/{ulid_at(T0 + 10_000)}.batch"
    between = f"ingest/{ulid_at(T0 + 20_000)}.batch"
    deleted, kept = _plan(_objects(between), _manifest(first, older_second), now_ms=T0 + 10**6)
    assert deleted == set()
    assert kept == {KeepReason.NOT_OLDER_THAN_QUEUE: 1}


def test_entries_without_ulid_names_block_deletion() -> None:
    old = f"ingest/{ulid_at(T0)}.batch"
    deleted, kept = _plan(_objects(old), _manifest("elsewhere/odd-name"), now_ms=T0 + 10**6)
    assert deleted == set()
    assert kept == {KeepReason.NOT_OLDER_THAN_QUEUE: 1}


def test_empty_prefix_means_the_store_root() -> None:
    old = f"{ulid_at(T0)}.batch"
    plan = plan_collection(
        _objects(old, f"sub/{ulid_at(T0)}.batch"),
        _manifest(),
        data_path_prefix="",
        now_ms=T0 + 10**6,
        grace_period_ms=GRACE,
    )
    assert plan.delete == (old,)


_times = st.integers(min_value=T0, max_value=T0 + 100_000)


@settings(max_examples=200, deadline=None)
@given(
    objects=st.lists(st.tuples(_times, st.sampled_from(["ingest", "ingest/n", "x"])), max_size=30),
    referenced=st.lists(st.integers(min_value=0, max_value=29), max_size=10),
    extra_entries=st.lists(_times, max_size=5),
    now=st.integers(min_value=T0, max_value=T0 + 200_000),
)
def test_deletes_exactly_what_all_rules_allow(
    objects: list[tuple[int, str]], referenced: list[int], extra_entries: list[int], now: int
) -> None:
    paths = [f"{folder}/{ulid_at(ms)}.batch" for ms, folder in objects]
    entry_locations = [paths[i] for i in sorted(set(referenced)) if i < len(paths)]
    entry_locations += [f"ingest/{ulid_at(ms)}.batch" for ms in extra_entries]
    manifest = _manifest(*entry_locations)
    deleted, _ = _plan(_objects(*paths), manifest, now_ms=now)
    floor = min(
        (ulid_time_ms(parse_batch_name(loc.rpartition("/")[2]) or "") for loc in entry_locations),
        default=None,
    )
    expected = {
        path
        for path in paths
        if path.rpartition("/")[0] == "ingest"
        and path not in entry_locations
        and (floor is None or ulid_time_ms(path[7:33]) < floor)
        and now - ulid_time_ms(path[7:33]) > GRACE
    }
    assert deleted == expected
