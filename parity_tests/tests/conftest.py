"""Shared fixtures: one DDP pool for the whole session, TensorFlow devices configured once."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from parity_tests.testing import profiles  # noqa: E402,F401  (registers hypothesis profiles)


@pytest.fixture(scope="session")
def pool():
    """The shared 8-rank pool (started on first use, closed at the end of the session)."""
    from torchref.pool import get_pool, shutdown_pool

    p = get_pool(8, timeout=120.0)
    p.start()  # the ranks' start-up is the fixture's, not the first example's that uses it
    yield p
    shutdown_pool()


def pytest_sessionfinish(session, exitstatus):
    """After the suite: the shared pool is shut down and no worker process is left (counted)."""
    import psutil

    from torchref.pool import shutdown_pool, stop_forkserver

    shutdown_pool()
    stop_forkserver()  # the server the ranks fork from is a child too
    me = psutil.Process()
    left = []
    for _ in range(50):  # workers get a moment to exit after the stop message
        left = [p for p in me.children(recursive=True)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(p.cmdline())]
        if not left:
            break
        import time

        time.sleep(0.1)
    if left:
        print(f"\nworker processes left behind after the test session: {[(p.pid, p.name()) for p in left]}")
        session.exitstatus = 1
    else:
        print("\nno worker process left behind after the test session")
