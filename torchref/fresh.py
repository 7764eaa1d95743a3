"""Each plugin run in a long-lived pool rank starts as a fresh rank would, and leaves nothing behind.

The pool's ranks (``torchref.pool``) live for the whole session: starting one costs
seconds (torch, the process group), so a plugin run cannot get a process of its own
the way a TensorFlow plugin run does (``parity_tests.running.tf_worker``). Instead
:func:`fresh_run` puts back, before the run and again after it, everything a
training program sets process-wide:

* random state: torch's generator seeded with the case seed (as the tool always did),
  numpy's and Python's global generators seeded with it too;
* ``torch.get_default_dtype()`` (float32), no default device, grad mode on, anomaly
  detection off, subnormals kept (``set_flush_denormal(False)``), ``set_warn_always``,
  autograd's multithreading and ``torch.utils.deterministic.fill_uninitialized_memory``;
* the determinism settings of :func:`torchref.determinism.configure` (one intra-op
  thread: the tool's own setting, kept on purpose; ``use_deterministic_algorithms(True)``;
  off for a run whose plugin says ``deterministic=False``);
* every float32 precision setting of ``torch.backends`` as the rank started with it: the
  float32 matmul precision, the per-backend ``fp32_precision`` (cuda, cudnn, mkldnn), TF32
  (``cuda.matmul.allow_tf32``, ``cudnn.allow_tf32``), the reduced-precision reductions,
  ``cudnn``/``mkldnn``/``opt_einsum`` on or off, ``cudnn.deterministic``/``benchmark``;
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
import functools
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .determinism import configure

__all__ = ["fresh_run", "job_world", "PRISTINE"]


#: torch.backends' float32 precision settings: the per-backend ``fp32_precision`` of torch 2.9+ and the
#: older flags beside them (``allow_tf32``, reduced-precision reductions, which kernels are on). A
#: program may set any of them (``torch.backends.cuda.matmul.allow_tf32 = True``,
#: ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``: float32 matmuls in bfloat16 on a CPU
#: with AMX); the ones this torch lacks are skipped
_PRECISION = ("fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision", "cudnn.conv.fp32_precision",
              "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision",
              "mkldnn.conv.fp32_precision", "mkldnn.rnn.fp32_precision")
_FLAGS = ("cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
          "cuda.matmul.allow_bf16_reduced_precision_reduction", "cudnn.enabled", "cudnn.deterministic",
          "cudnn.benchmark", "cudnn.allow_tf32", "mkldnn.enabled", "opt_einsum.enabled")


def _owner(path: str) -> tuple[Any, str]:
    *parts, name = path.split(".")
    return functools.reduce(getattr, parts, torch.backends), name


def _present(path: str) -> bool:
    try:
        owner, name = _owner(path)
        getattr(owner, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _settings() -> dict[str, Any]:
    """Every process-wide torch setting :func:`fresh_run` puts back, as this process has it now."""
    out: dict[str, Any] = {"matmul_precision": torch.get_float32_matmul_precision()}
    for path in (*_PRECISION, *_FLAGS):
        if _present(path):
            owner, name = _owner(path)
            out[path] = getattr(owner, name)
    out["warn_always"] = torch.is_warn_always_enabled()
    out["autograd_multithreading"] = torch.autograd.is_multithreading_enabled()
    out["fill_uninitialized_memory"] = torch.utils.deterministic.fill_uninitialized_memory
    return out


#: the settings as this rank has them before any run (taken at import: the forkserver's, which every rank inherits)
PRISTINE = _settings()


def _reset(seed: int, deterministic: bool) -> None:
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)  # a fresh process has none (tensors on the CPU)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    configure()
    if not deterministic:
        torch.use_deterministic_algorithms(False)
    # the older calls first (each sets per-backend precisions of its own), then every fp32_precision as it was
    torch.set_float32_matmul_precision(PRISTINE["matmul_precision"])
    for path in (*_FLAGS, *_PRECISION):
        if path in PRISTINE:
            owner, name = _owner(path)
            setattr(owner, name, PRISTINE[path])
    torch.set_flush_denormal(False)  # no getter: a fresh process keeps subnormals
    torch.set_warn_always(PRISTINE["warn_always"])
    torch.autograd.set_multithreading_enabled(PRISTINE["autograd_multithreading"])
    torch.utils.deterministic.fill_uninitialized_memory = PRISTINE["fill_uninitialized_memory"]
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
