"""Each plugin run in a long-lived pool rank starts as a fresh rank would, and leaves nothing behind.

The pool's ranks (``torchref.pool``) live for the whole session: starting one costs
seconds (torch, the process group), so a plugin run cannot get a process of its own
the way a TensorFlow plugin run does (``parity_tests.running.tf_worker``). Instead
:func:`fresh_run` puts back, before the run and again after it, everything a
training program sets process-wide:

* random state: torch's generator seeded with the case seed (as the tool always did),
  numpy's and Python's global generators seeded with it too;
* ``torch.get_default_dtype()`` (float32), grad mode on, anomaly detection off;
* the determinism settings of :func:`torchref.determinism.configure` (one intra-op
  thread, ``use_deterministic_algorithms(True)``; off for a run whose plugin says
  ``deterministic=False``), ``torch.backends.cudnn`` ``deterministic``/``benchmark`` and
  the float32 matmul precision, as they were when the rank started;
* the process groups the run created (``dist.new_group``) are destroyed after it: the
  pool's own groups stay;
* the user's modules the run imported (its plugin file, the sibling modules it imports:
  anything that is neither a library nor the tool) are dropped from ``sys.modules``, so the
  next run imports them afresh, module-level state included; libraries (torch,
  torchvision, numpy) stay imported, which is what makes a warm rank cheap.

``tests/test_fresh_runs.py`` runs plugins that set each kind of state and check, at
their start, that none is left from the run before.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .determinism import configure

__all__ = ["fresh_run", "job_world", "PRISTINE"]


def _settings() -> dict[str, Any]:
    return {
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }


#: the settings as this rank has them before any run (taken at import: the forkserver's, which every rank inherits)
PRISTINE = _settings()


def _reset(seed: int, deterministic: bool) -> None:
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    configure()
    if not deterministic:
        torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision(PRISTINE["matmul_precision"])
    torch.backends.cudnn.deterministic = PRISTINE["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = PRISTINE["cudnn_benchmark"]
    torch.backends.cudnn.allow_tf32 = PRISTINE["cudnn_tf32"]
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _groups() -> set[Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return set()
    return set(dist.distributed_c10d._world.pg_map)  # noqa: SLF001  (every group this process belongs to)


def _user_module(module: Any) -> bool:
    from parity_tests.protocol.frames import is_library_file, is_tool_file

    path = getattr(module, "__file__", None)
    return bool(path) and not is_library_file(path) and not is_tool_file(path)


@contextlib.contextmanager
def fresh_run(seed: int, *, deterministic: bool = True) -> Iterator[None]:
    """Run the body in a rank set as a fresh one, and clean up what it set (module docstring)."""
    import torch.distributed as dist

    modules = set(sys.modules)
    groups = _groups()
    _reset(seed, deterministic)
    try:
        yield
    finally:
        for pg in _groups() - groups:  # created by the run: a later run would find them (and their threads)
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)
        for name in set(sys.modules) - modules:
            if _user_module(sys.modules.get(name)):
                del sys.modules[name]
        _reset(seed, True)


@contextlib.contextmanager
def job_world(group: Any) -> Iterator[None]:
    """Make ``group`` (the job's ranks) the default process group for the body; ``None``: no process group.

    A DDP program is written for a world of its own: ``DistributedDataParallel(model)``,
    ``dist.all_reduce(t)``, ``dist.barrier()``, ``DistributedSampler(dataset)`` all use the default
    group, and ``dist.get_world_size()`` / ``dist.get_rank()`` read it. The pool's default group
    holds all its ranks, which may be more than the case's N (a pool of 8 serving a 2-device case),
    so for the run the job's own group stands in for it (its ranks are 0..N-1, the same numbers as
    in the pool). A ``single`` plugin runs as one process without a process group
    (``dist.is_initialized()`` is false).

    The program's own set-up and tear-down stay as written: ``dist.init_process_group`` does
    nothing when a group is there (the tool's), and ``dist.destroy_process_group()`` of the
    default group or of the job's does nothing (the tool owns them); a group the program made
    itself is destroyed as asked.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    saved = c10d._world.default_pg  # noqa: SLF001
    init, destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            init(*args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD or group is saved or group is current:
            return
        destroy(group)

    current = group
    c10d._update_default_pg(group)  # noqa: SLF001
    dist.init_process_group = c10d.init_process_group = init_process_group
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group = c10d.init_process_group = init
        dist.destroy_process_group = c10d.destroy_process_group = destroy
        c10d._update_default_pg(saved)  # noqa: SLF001
