"""Test plumbing (not part of the package): multi-process workers, the training-equivalence harness and the
optimizer checks. ``tests/`` is on ``sys.path`` under pytest; the equivalence CLI runs as
``PYTHONPATH=python:tests python -m helpers.equivalence``."""


class Injected(Exception):
    """An arbitrary exception class (no moe_graph code knows it): raised on one rank by the collective-failure
    tests (a collective load or save must fail on every rank, naming it, whatever was raised)."""
