"""The ``tfpar`` pytest plugin (entry point ``pytest11``: loaded by any pytest run where tfpar is installed).

It is inert until asked: loading it changes nothing of a user's session (no Hypothesis profile is
loaded, no option or hook acts by itself). It provides:

* ``tfpar_pool``: a session-scoped fixture, the warm DDP worker pool
  (:func:`torchref.pool.get_pool` with 8 ranks), shut down at the end of the
  session. Tests that run torch implementations or torch plugins many times
  ask for it once so the ranks start once; without it the pool still starts
  on first use and closes at exit.
* the Hypothesis profiles ``tfpar-dev``, ``tfpar-ci`` and ``tfpar-thorough``, registered, never
  loaded (:mod:`parity_tests.testing.profiles`): ``pytest --hypothesis-profile tfpar-ci`` chooses one.

Importing this module imports neither TensorFlow nor torch: the fixture imports
:mod:`torchref.pool` when a test first asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from parity_tests.testing import profiles  # noqa: F401  (registers the tfpar-* profiles; loads none)

POOL_SIZE = 8


@pytest.fixture(scope="session")
def tfpar_pool() -> Iterator[Any]:
    """The shared warm DDP pool (``torchref.pool.get_pool(8)``), shut down at the end of the session.

    Without torch installed: one line naming the extra (``FrameworkMissing``), not an ImportError.
    """
    from parity_tests.running.frameworks import require

    require("torch", "the tfpar_pool fixture", "tfpar_pool")
    from torchref.pool import get_pool, shutdown_pool

    pool = get_pool(POOL_SIZE)
    try:
        yield pool
    finally:
        shutdown_pool()

