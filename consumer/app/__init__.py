"""The consumer's operator application, built on the library :mod:`millpond.consumer`.

- ``millpond consume``: the long-running service (:mod:`~millpond.consumer.app.service`:
  ``ConsumerService``), its command line (:mod:`~millpond.consumer.app.command`), its metrics
  (``_metrics``: the queue sampler, a timing sink wrapper) and the report it writes for
  ``millpond status`` (``_report``);
- ``millpond status`` (:mod:`~millpond.consumer.app.status`, ``--watch`` in ``_watch``, the
  read-only sink progress reader ``_sink_progress``);
- ``millpond doctor`` (:mod:`~millpond.consumer.app.doctor`: the core's store checks and the
  sink check);
- ``millpond quarantine`` and ``millpond replay`` (:mod:`~millpond.consumer.app.quarantine`,
  :mod:`~millpond.consumer.app.replay`).

The application imports the library (``Consumer``, the read-ahead, ``ConsumedBatch``,
``take_over``) and the sinks; neither imports the application (an import contract in
``pyproject.toml``). The CLI imports each command's module here by name only when it runs.
"""
