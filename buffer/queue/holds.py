"""Holds: locations not (yet) in the manifest that garbage collection must keep anyway.

A writer that will append locations later, and must be able to append the *same* locations
after a crash, writes a hold first: ``{data_path_prefix}/_millpond/holds/{name}``, a JSON object
whose ``"locations"`` list names them (other keys are the writer's own). The Spark driver keeps
each stream's pending micro-batch there, so a driver that restarts long after a commit began can
still append exactly those objects — the sink recognises a location it has already written,
but not a new one.

Collectors read every hold after listing the batch objects and *before* reading the manifest: a
writer appends first and removes (or replaces) its hold after, so any location a hold stops
naming is already in the manifest by the time a pass reads it.

Holds sit in a nested prefix the RFC's collectors never list; an RFC peer's collector does not
know about them (docs/guarantees.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from millpond.errors import FormatError, NotFoundError
from millpond.queue.claim import internal_path
from millpond.storage.store import ObjectStore

__all__ = ["HOLDS", "encode_hold", "held_locations", "hold_path", "locations_of"]

HOLDS = "holds"


def hold_path(data_path_prefix: str, name: str) -> str:
    """Where the hold ``name`` of the queue under ``data_path_prefix`` lives."""
    return internal_path(data_path_prefix, f"{HOLDS}/{name}")


def encode_hold(locations: Iterable[str], extra: Mapping[str, Any] | None = None) -> bytes:
    """A hold's bytes: ``extra``'s keys plus ``"locations"``."""
    record = dict(extra or {})
    record["locations"] = list(locations)
    return json.dumps(record, separators=(",", ":")).encode()


def locations_of(data: bytes, *, name: str) -> list[str]:
    """The locations a hold names.

    Raises:
        FormatError: not a hold.
    """
    try:
        locations = json.loads(data)["locations"]
    except (ValueError, KeyError, TypeError) as err:
        raise FormatError(f"{name}: not a millpond hold: {err}", field="locations") from err
    if not isinstance(locations, list) or not all(isinstance(x, str) for x in locations):
        raise FormatError(f"{name}: locations: expected a list of paths", field="locations")
    return locations


def held_locations(store: ObjectStore, data_path_prefix: str) -> set[str]:
    """Every location any hold of the queue names.

    Raises:
        FormatError: a hold is corrupt (a collector then deletes nothing).
        StorageError: the store failed.
    """
    held: set[str] = set()
    for info in store.list(internal_path(data_path_prefix, HOLDS)):
        try:
            data = store.get(info.path).data
        except NotFoundError:
            continue  # removed since the listing: its locations are in the manifest by now
        held.update(locations_of(data, name=f"{store.url}/{info.path}"))
    return held
