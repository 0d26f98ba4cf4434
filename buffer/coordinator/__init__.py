"""The optional append coordinator: many writers' entries in one compare-and-swap per round.

One module per side, none imported here (a consumer loads its client without the server):

* :mod:`~millpond.coordinator.wire` — the HTTP wire format: paths, headers, outcomes, encoding;
* :mod:`~millpond.coordinator.rounds` — the server's core, ``AppendCoordinator``: rounds,
  pauses, and the consumers' dequeues written between rounds;
* :mod:`~millpond.coordinator.server` — ``CoordinatorServer``, the rounds over HTTP;
* :mod:`~millpond.coordinator.connection` — a coordinator as its clients reach it;
* :mod:`~millpond.coordinator.client` — the clients, each falling back to its own
  compare-and-swap: ``CoordinatedAppender`` (producers, the Spark driver's commit) and
  ``CoordinatedDequeue`` (consumers);
* :mod:`~millpond.coordinator.hosted` — one coordinator shared by a machine's producers: the
  election file, the hosted server, the appender that follows the host;
* :mod:`~millpond.coordinator.command` — ``millpond coordinator``.
"""
