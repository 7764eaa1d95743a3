"""Plumbing shared by the framework-difference measurements (issue 27's table).

Every measurement runs TensorFlow and torch in separate processes: they are never imported in
the same interpreter (the project's rule, ``tfpar/`` vs ``torchref/``). :func:`on_side` runs one
top-level function of the calling script in a fresh process started with the ``spawn`` method
(so nothing of the parent's imports leaks in) and returns its result, which must be plain data
(numpy arrays, numbers, strings, dicts and lists of them).

Each script prints its figures as readable lines and ends with one ``RESULT {json}`` line that
``run_all.py`` collects into the table (:func:`result`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["on_side", "result", "max_abs", "versions_tf", "versions_torch", "tf_logical_cpus"]

# quiet TensorFlow's C++ start-up banner in the children
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def on_side(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh spawned process (one framework per process).

    ``fn`` must be a module-level function of an importable module or of the running script;
    its arguments and result cross the process boundary by pickle (plain data only).
    """
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args, kwargs)


def max_abs(a: Any, b: Any) -> float:
    """``max |a - b|`` over all elements, in float64 (``nan`` when either holds a NaN)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)))


def versions_tf() -> dict[str, str]:
    """TensorFlow and Keras versions of this interpreter (call on the TensorFlow side)."""
    import keras
    import tensorflow as tf

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def versions_torch() -> dict[str, str]:
    """torch's version (call on the torch side)."""
    import torch

    return {"torch": torch.__version__}


def tf_logical_cpus(n: int) -> list[str]:
    """Split the host CPU into ``n`` logical devices (before TensorFlow starts) and name them.

    ``MirroredStrategy(devices=...)`` over these is the project's way of running real
    tf.distribute replicas without accelerators.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    )
    return [f"/cpu:{i}" for i in range(n)]


def result(row: str, held: bool | str, gap: str, condition: str, mapping: str, **extra: Any) -> None:
    """Print the closing ``RESULT`` line: the row, whether the issue's claim held, the measured
    gap (as text, with its unit), when the difference vanishes, and the mapping that removes it."""
    line = {"row": row, "held": held, "gap": gap, "condition": condition, "mapping": mapping}
    line.update(extra)
    print("RESULT " + json.dumps(line, default=str))
