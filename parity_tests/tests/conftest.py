"""Shared fixtures: one DDP pool for the whole session, TensorFlow devices configured once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from parity_tests import profiles  # noqa: E402,F401  (registers hypothesis profiles)


@pytest.fixture(scope="session")
def pool():
    """The shared 8-rank pool (started on first use, closed at the end of the session)."""
    from torchref.pool import get_pool, shutdown_pool

    p = get_pool(8, timeout=120.0)
    yield p
    shutdown_pool()
