"""Test plumbing (not part of the package): multi-process workers, the training-equivalence harness and the
optimizer checks. ``tests/`` is on ``sys.path`` under pytest; the equivalence CLI runs as
``PYTHONPATH=python:tests python -m helpers.equivalence``."""
