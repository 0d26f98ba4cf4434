"""The byte layouts, as pure functions over bytes: no IO, no clock.

* :mod:`millpond.formats.manifest` — the queue manifest, version 1 (OpenData RFC 0001);
* :mod:`millpond.formats.batch` — the data batch, version 1 (OpenData RFC 0001);
* :mod:`millpond.formats.wal` — the local write-ahead log's files, records and sidecar (Quiver);
* :mod:`millpond.formats.arrow` — Arrow IPC entries and the schema unification of ``to_arrow()``.

Nothing here imports any other part of millpond except :mod:`millpond.errors`.
"""
