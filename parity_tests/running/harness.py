"""Run a validated case on any implementation, by name (resolved by :mod:`.registry`).

TensorFlow implementations and TensorFlow plugins run in this process
(TensorFlow is imported on first use, never at import time, so spawned torch
workers that re-import the parent's main module do not pay for it); torch
implementations and torch plugins run in the shared DDP worker pool. Only
plain data crosses: the case payload in, numpy trajectories out.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.contract.errors import CaseError
from parity_tests.running import registry

__all__ = ["IMPLS", "RunError", "run_impl", "parse_impls", "tf_device_count", "set_pool_timeout", "check_tf_devices",
           "run_torch_job", "tf_module", "check_dtypes"]

#: the built-in implementations (the registry lists every name: :func:`registry.names`)
IMPLS = ("tf.towers", "tf.single", "tf.v1", "tf.mirrored", "torch.ddp", "torch.single")
_POOL_TIMEOUT: float | None = None


class RunError(RuntimeError):
    """An implementation failed while running a valid case (e.g. a DDP rank died)."""


def set_pool_timeout(seconds: float | None) -> None:
    """Per-job timeout for torch runs (None: the pool's default)."""
    global _POOL_TIMEOUT
    _POOL_TIMEOUT = seconds


def parse_impls(text: str, field: str = "--impls") -> list[str]:
    """``"tf.towers,my_towers.py:train"`` -> ``["tf.towers", "my_towers.py:train"]``, each name resolved.

    Names are split at commas; a plugin or recorded path may not contain one.
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise CaseError(field, "a comma-separated list of implementations (" + registry.describe_names() + ")", text)
    for n in names:
        registry.resolve(n, field)
    if len(set(names)) != len(names):
        raise CaseError(field, "each implementation once", text)
    return names


_BENIGN = ("All log messages before absl::InitializeLog()", "oneDNN custom operations are on",
           "This TensorFlow binary is optimized", "rebuild TensorFlow with the appropriate compiler flags")


def tf_module() -> Any:
    """Import ``tfpar`` (and TensorFlow) once, without TensorFlow's start-up chatter.

    TensorFlow 2.21 logs through absl before ``TF_CPP_MIN_LOG_LEVEL`` is read, so
    the C++ stderr is captured during the import and replayed without the known
    informational lines (anything else is shown as it was).
    """
    if "tfpar" in sys.modules:
        return sys.modules["tfpar"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            import tfpar

            tfpar.available_devices()  # the first op logs too
            # every case builds its own trainer, so each traces its step once by design:
            # TensorFlow's retracing advice is noise here
            import tensorflow as tf

            tf.get_logger().setLevel("ERROR")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if line.strip() and not any(b in line for b in _BENIGN):
                    print(line, file=sys.stderr)
    return tfpar


def tf_device_count() -> int:
    """How many tower devices this process has (configures TensorFlow's devices)."""
    return len(tf_module().available_devices())


def check_tf_devices(case: Case, impl: str, *, towers: bool = True) -> Any:
    """``tfpar`` with the case's devices checked: N towers (``towers``) and every placement fit this process."""
    tfpar = tf_module()
    have = len(tfpar.available_devices())
    n = case.devices
    if towers and n > have:  # one device per tower
        raise CaseError("parallel.devices", f"at most {have} (the tower devices this process has; set TFPAR_DEVICES before start-up for more)", n)
    for j, (_, _, device) in enumerate(case.spec["model"].get("placement", [])):
        if device >= have:
            raise CaseError(f"model.placement[{j}][2]", f"a device index below {have} (the devices this process has)", device)
    return tfpar


def run_torch_job(impl: str, fn: Any, job: Any, world_size: int, *,
                  on_failure: Any = None) -> list[Any]:
    """Run ``fn(ctx, job)`` on ranks 0..world_size-1 of the shared pool; failures become one line.

    ``on_failure(detail) -> Exception | None`` may turn a rank's traceback text into a more
    specific error (what a plugin raised, or bad input it met) before the generic one.

    Raises:
        RunError: a rank raised, died or hung (named, with the remote error's last line).
    """
    from torchref.pool import PoolError, RankFailed, get_pool

    shared = {} if _POOL_TIMEOUT is None else {"timeout": _POOL_TIMEOUT}
    pool = get_pool(world_size, **shared)  # reused when large enough, restarted larger when not
    try:
        return pool.run(fn, job, world_size, timeout=_POOL_TIMEOUT)
    except RankFailed as e:  # one line: the rank, how it failed, and the remote error's last line
        specific = on_failure(e.detail) if on_failure else None
        if specific is not None:
            raise specific from e
        last = next((line.strip() for line in reversed(e.detail.splitlines()) if line.strip()), "")
        raise RunError(f"{impl} failed: rank {e.rank} {e.how}{e.when}" + (f": {last}" if last else "")) from e
    except PoolError as e:
        raise RunError(f"{impl} failed: {e}") from e


def check_dtypes(case: Case, impls: list[str], field: str = "--impls") -> None:
    """Refuse, before anything runs, an implementation that does not declare the case's dtype."""
    dtype = case.spec["dtype"]
    for name in impls:
        found = registry.resolve(name, field)
        if dtype not in found.dtypes:
            raise CaseError("dtype", f"one of {', '.join(found.dtypes)} for {name} (the dtypes it declares)", dtype)


def run_impl(case: Case, impl: str, *, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Run ``case`` on the implementation named ``impl`` and return its trajectory.

    Raises:
        CaseError: an unknown name, a plugin that cannot be loaded or recorded badly, a dtype
            the implementation does not declare, or a case it cannot run here.
        RunError: the implementation failed (the message names the rank, or the step a plugin was on).
    """
    check_dtypes(case, [impl], "--impl")
    return registry.resolve(impl, "--impl").run(case, progress)
