"""Shared fixtures: one DDP pool for the whole session, TensorFlow devices configured once."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# A CUDA build of torch brings triton; triton 3.8 (torch 2.14.1's) loaded into a process that already
# holds TensorFlow 2.21 segfaults in its extension module, while the other order works (docs/versions.md,
# the newest cell). The tool never has both in one process (its main process never imports torch); the
# tests that run torch's optimizers in process (test_optimizers) do, so triton, where it is, comes first.
if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: E402,F401

from parity_tests.running import registry  # noqa: E402
from parity_tests.testing import profiles  # noqa: E402

# this repository's choice (the installed plugin loads no profile): HYPOTHESIS_PROFILE=ci (make test)
# or =tfpar-ci, default tfpar-dev; Hypothesis' own --hypothesis-profile, applied after this, wins
profiles.load()

# the built-ins declare themselves (parity_tests.protocol.engine) on the registry's first use: tests that
# ask theory directly, without running anything, need their declarations too
registry.builtin_names()


@pytest.fixture(scope="session")
def pool():
    """The shared 8-rank pool (started on first use, closed at the end of the session)."""
    from torchref.pool import get_pool, shutdown_pool

    p = get_pool(8, timeout=120.0)
    p.start()  # the ranks' start-up is the fixture's, not the first example's that uses it
    yield p
    shutdown_pool()
    p.close()  # itself too: a test may have swapped it out of the shared place (idempotent)


@pytest.fixture(autouse=True)
def _no_trace_reuse_under_monkeypatch(request):
    """A test that asks for ``monkeypatch`` runs with ``tfpar.reuse`` off and leaves its cache empty.

    Such a test may patch what a trace reads (a seeded bug in ``tfpar.models``): a trainer reused
    from before would run without the patch, and one given back would carry the patch into
    later tests of the worker. Other tests keep reusing trainers across tests.
    """
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    import sys

    def clear() -> None:
        reuse = sys.modules.get("tfpar.reuse")  # not imported: no trainer to drop (and no TensorFlow to load)
        if reuse is not None:
            reuse.CACHE.clear()

    clear()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TFPAR_TRACE_CACHE", "0")
        yield
    clear()


#: The test files that take longest, longest first (their test time under ``make test``, three
#: pytest-xdist workers, 2026-11-23, late: 126, 111, 81, 78, 55, 36, 35, 35, 34, 31, 30, 29, 28,
#: 23, 23, 23, 21, 21, 18, 17, 16, 16, 16 s; from ``--junitxml``, summed by file; the files after
#: test_optimizers from a later run's completion times, 19 s for test_towers down to 4 s: the
#: last file of that run's slowest worker was test_towers, 15 s after the other two finished).
#: ``make test`` hands whole files to the workers in collection order (``--dist loadfile
#: --no-loadscope-reorder``), so the heaviest go first and the last file a worker takes is a
#: short one (longest-processing-time-first). Without ``--no-loadscope-reorder`` xdist 3.8
#: sorts the files by their number of tests instead, which undid this order until 2026-11-23
#: (test_optimizers' 256 quick tests went first, test_byo_examples' 18 slow ones near the end).
#: A stale list costs time, never a check: every test still runs.
HEAVIEST_FIRST = ("test_mirrored", "test_launch", "test_pool", "test_v1", "test_real_examples", "test_properties", "test_cli",
                  "test_capture_builtins", "test_interrupt", "test_param_mean", "test_pipeline", "test_async",
                  "test_lockstep", "test_multiworker", "test_layers", "test_placement", "test_pytest_plugin",
                  "test_plugins", "test_matrix", "test_towers", "test_reuse", "test_mutants", "test_error_rates", "test_byo_examples",
                  "test_layering", "test_optimizers", "test_sample_weights", "test_rows", "test_clipping", "test_ddp",
                  "test_losses", "test_mixed_precision", "test_layer_hooks", "test_capture", "test_perturbation",
                  "test_docs", "test_optimizer_ranges", "test_large_world")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files :data:`HEAVIEST_FIRST`, then the rest as collected (a stable sort: each
    file's tests keep their order). Every xdist worker sorts alike, as xdist requires."""
    def rank(item: pytest.Item) -> int:
        stem = item.path.stem
        return HEAVIEST_FIRST.index(stem) if stem in HEAVIEST_FIRST else len(HEAVIEST_FIRST)

    items.sort(key=rank)


def pytest_sessionfinish(session, exitstatus):
    """After the suite: the shared pool is shut down and no worker process is left (counted)."""
    from parity_tests.tests.processes import (
        EXIT_DEADLINE,
        children,
        cmdline,
        is_resource_tracker,
        wait_until,
    )
    from torchref.pool import shutdown_pool, stop_forkserver

    shutdown_pool()
    stop_forkserver()  # the server the ranks fork from is a child too
    if "parity_tests.running.tf_worker" in sys.modules:  # the server TensorFlow plugins run from
        sys.modules["parity_tests.running.tf_worker"].shutdown_worker()
    left: list = []

    def none_left() -> bool:  # workers exit once they read the stop message: a poll, not a fixed wait
        nonlocal left
        left = [p for p in children(os.getpid()) if not is_resource_tracker(p)]
        return not left

    wait_until(none_left, EXIT_DEADLINE)
    if left:
        print(f"\nworker processes left behind after the test session: {[(p.pid, cmdline(p)[:80]) for p in left]}")
        session.exitstatus = 1
    else:
        print("\nno worker process left behind after the test session")
