"""Millpond benchmarks: ``python -m bench [NAME ...] [--quick]`` (``make bench``).

Every ``bench/bench_*.py`` module is one benchmark exposing ``run(quick: bool) -> dict``. The
dict carries at least ``name``, ``ratio``, ``target``, ``figures`` and ``baseline``: the ratio is
the measured figure over a baseline measured side by side in the same run on the same server
(DESIGN.md "Performance"), because these machines are noisy. See ``bench/common.py`` for the
result shape and the plotting conventions.
"""
