"""Run one validated case on a torch implementation, in the shared worker pool.

``torch.ddp`` runs ``train_rank`` on N ranks of the pool; ``torch.single``
runs ``train_single`` on one rank (so the calling process never needs to run
torch itself, and every torch run has the same thread and determinism settings).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .engines import SPECS
from .jobs import job_ref
from .pool import DDPPool, get_pool

__all__ = ["IMPLS", "run_case", "job_function"]

#: the torch engines (their declarations: :mod:`torchref.engines`)
IMPLS = tuple(s.name for s in SPECS)

#: the pool job that trains a payload as an implementation says (the launcher's name for it)
job_function = job_ref


def run_case(payload: dict[str, Any], impl: str = "torch.ddp", *, pool: DDPPool | None = None,
             timeout: float | None = None) -> dict[str, np.ndarray]:
    """Train as the case says and return rank 0's trajectory (numpy arrays, canonical names).

    Args:
        payload: ``{"spec", "x", "y", "init"}`` as validated by ``parity_tests``.
        impl: ``torch.ddp`` or ``torch.single``.
        pool: the worker pool (default: the process-wide shared pool, grown to
            at least the case's device count when it is smaller).
        timeout: per-job timeout in seconds (default: the pool's). A shared pool
            created by this call also uses it as its collective timeout, so a
            hung rank fails within it.
    """
    job = job_ref(payload, impl)  # refuses an unknown implementation
    n = payload["spec"]["parallel"]["devices"] if impl == "torch.ddp" else 1
    # the shared pool is reused when it is large enough, and restarted larger when not
    pool = pool or get_pool(n, **({} if timeout is None else {"timeout": timeout}))
    return pool.run(job, payload, n, timeout=timeout)[0]
