"""Run one validated case on a TensorFlow implementation and record its trajectory.

Input is plain data (the case ``spec`` dict and numpy arrays, as
``parity_tests`` validated them); output is a trajectory: a dict of numpy
arrays in canonical names (``loss``, ``param/<name>``, ``grad/<name>``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from .devices import tower_devices
from .losses import device_loss
from .models import build_variables, forward
from .optimizers import make_optimizer
from .towers import TowerTrainer

__all__ = ["IMPLS", "run_case"]

IMPLS = ("tf.towers", "tf.single")


def _record(trainer: TowerTrainer, steps: int, batches: Callable[[int], tuple[np.ndarray, np.ndarray]],
            progress: Callable[[int], None] | None) -> dict[str, np.ndarray]:
    params = {k: [v] for k, v in trainer.values().items()}
    grads: dict[str, list[np.ndarray]] = {k: [] for k in params}
    losses = []
    for k in range(steps):
        loss, g = trainer.step(*batches(k))
        losses.append(loss)
        for name, value in trainer.values().items():
            params[name].append(value)
            grads[name].append(g[name])
        if progress:
            progress(k + 1)
    traj = {"loss": np.asarray(losses)}
    traj.update({f"param/{k}": np.stack(v) for k, v in params.items()})
    traj.update({f"grad/{k}": np.stack(v) for k, v in grads.items()})
    return traj


def run_case(payload: Mapping[str, Any], impl: str = "tf.towers", *,
             progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Train as the case says and return the trajectory.

    Args:
        payload: ``{"spec": dict, "x": [rows, ...], "y": [rows, ...], "init": {name: array}}``.
        impl: ``tf.towers`` (N towers, N = ``parallel.devices``) or ``tf.single``
            (one device, the whole global batch).
        progress: called with the number of steps done.
    Returns:
        ``{"loss": [steps], "param/<name>": [steps+1, ...], "grad/<name>": [steps, ...]}``,
        arrays in the case dtype.
    """
    spec = payload["spec"]
    dtype = tf.float64 if spec["dtype"] == "float64" else tf.float32
    np_dtype = np.float64 if spec["dtype"] == "float64" else np.float32
    par = spec["parallel"]
    n = par["devices"] if impl == "tf.towers" else 1
    if impl not in IMPLS:
        raise ValueError(f"unknown TensorFlow implementation {impl!r}")
    devices = tower_devices(n)
    model = spec["model"]
    variables = build_variables(payload["init"], dtype, device=devices[0])

    def loss_fn(params, x, y):
        return device_loss(model["loss"], model["reduction"], forward(model["layers"], params, x), y)

    trainer = TowerTrainer(
        loss_fn, variables, make_optimizer(spec["optimizer"]), devices,
        combine=par["combine"], shard=par["shard"], weighting=par["weighting"],
    )
    batch = spec["data"]["global_batch"]
    x = np.asarray(payload["x"], np_dtype)
    y = payload["y"]
    y = y.astype(np.int64) if model["loss"] == "softmax_ce" else np.asarray(y, np_dtype)

    def batches(k: int):
        return x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]

    return _record(trainer, spec["steps"], batches, progress)
