"""Run a validated case on any implementation, by name.

TensorFlow implementations run in this process (TensorFlow is imported on
first use, never at import time, so spawned torch workers that re-import the
parent's main module do not pay for it); torch implementations run in the
shared DDP worker pool. Only plain data crosses: the case payload in,
numpy trajectories out.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.contract.errors import CaseError

__all__ = ["IMPLS", "RunError", "run_impl", "parse_impls", "tf_device_count", "set_pool_timeout"]

IMPLS = ("tf.towers", "tf.single", "tf.v1", "tf.mirrored", "torch.ddp", "torch.single")
_POOL_TIMEOUT: float | None = None


class RunError(RuntimeError):
    """An implementation failed while running a valid case (e.g. a DDP rank died)."""


def set_pool_timeout(seconds: float | None) -> None:
    """Per-job timeout for torch runs (None: the pool's default)."""
    global _POOL_TIMEOUT
    _POOL_TIMEOUT = seconds


def parse_impls(text: str, field: str = "--impls") -> list[str]:
    """``"tf.towers,torch.ddp"`` -> ``["tf.towers", "torch.ddp"]``, each name checked."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise CaseError(field, "a comma-separated list of implementations (" + ", ".join(IMPLS) + ")", text)
    for n in names:
        if n not in IMPLS:
            raise CaseError(field, "implementation names among " + ", ".join(IMPLS), n)
    if len(set(names)) != len(names):
        raise CaseError(field, "each implementation once", text)
    return names


_BENIGN = ("All log messages before absl::InitializeLog()", "oneDNN custom operations are on",
           "This TensorFlow binary is optimized", "rebuild TensorFlow with the appropriate compiler flags")


def _tf():
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
    return len(_tf().available_devices())


def run_impl(case: Case, impl: str, *, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Run ``case`` on ``impl`` and return its trajectory.

    Raises:
        CaseError: the case cannot run here (e.g. more devices than can be made).
        RunError: the implementation failed (the message names the rank or op).
    """
    if impl not in IMPLS:
        raise CaseError("--impl", "one of " + ", ".join(IMPLS), impl)
    n = case.devices
    if impl.startswith("tf."):
        tfpar = _tf()
        have = len(tfpar.available_devices())
        if impl != "tf.single" and n > have:  # tf.towers, tf.v1, tf.mirrored: one device per tower
            raise CaseError("parallel.devices", f"at most {have} (the tower devices this process has; set TFPAR_DEVICES before start-up for more)", n)
        for j, (_, _, device) in enumerate(case.spec["model"].get("placement", [])):
            if device >= have:
                raise CaseError(f"model.placement[{j}][2]", f"a device index below {have} (the devices this process has)", device)
        try:
            return tfpar.run_case(case.payload(), impl, progress=progress)
        except tfpar.Unsupported as e:  # a valid case this implementation does not implement
            raise CaseError(e.field, e.expected) from None
        except Exception as e:  # a TensorFlow failure on a valid case: one line, not a traceback
            raise RunError(f"{impl} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    from torchref.pool import MAX_SIZE, PoolError, RankFailed
    from torchref.run import run_case

    if impl == "torch.ddp" and n > MAX_SIZE:
        raise CaseError("parallel.devices", f"at most {MAX_SIZE} ranks", n)
    try:
        traj = run_case(case.payload(), impl, timeout=_POOL_TIMEOUT)
    except RankFailed as e:  # one line: the rank, how it failed, and the remote error's last line
        last = next((line.strip() for line in reversed(e.detail.splitlines()) if line.strip()), "")
        raise RunError(f"{impl} failed: rank {e.rank} {e.how}{e.when}" + (f": {last}" if last else "")) from e
    except PoolError as e:
        raise RunError(f"{impl} failed: {e}") from e
    if progress:
        progress(case.spec["steps"])
    return traj
