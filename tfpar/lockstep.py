"""Lockstep runs on the tower engine: one step from each of a list of start states, in one trainer.

``parity_tests.session.lockstep`` judges every step from the reference's state after the
step before. A one-step run per step would build (and trace) a new trainer each time
(about 0.2 s on the 2-core machine, against about 5 ms for a step); here one trainer is
built and, before each step ``k``, its variables, non-trainable state and optimizer are set
to start state ``k``. With no start states (a *chain*) the trainer simply runs on, exporting
its optimizer state after every step: that is the reference's own lockstep sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from parity_tests.protocol.optimizer_state import flat_state

from .optimizers import export_state, load_state

__all__ = ["run_steps"]


def run_steps(trainer: Any, state: Mapping[str, tf.Variable], batches: Callable[[int], tuple],
              payload: Mapping[str, Any], record: Callable[..., dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One step from each start state of ``payload["lockstep"]["starts"]`` (``None``: run on, a chain).

    Args:
        trainer: a :class:`tfpar.TowerTrainer` (its optimizer built).
        state: the non-trainable state variables by canonical name.
        batches: ``batches(k)`` the inputs of step ``k`` (from 0) of the case.
        payload: the case payload; ``payload["lockstep"]["starts"][k]`` is
            ``{"init": {name: array}, "opt": {"step": t, "slots": ...} | None}`` (``None``: fresh).
        record: ``tfpar.run._record`` (``record(trainer, 1, batches, None, state)`` runs one step).
    Returns:
        ``lockstep/<key>`` ``[steps, ...]``: step ``k``'s one-step trajectory (``loss`` [1],
        ``param/<name>`` [2, ...], ``grad/<name>`` [1, ...], ``state/<name>`` [2, ...]) and its
        optimizer state after the step (``opt/step``, ``opt/<slot>/<name>``), stacked over ``k``;
        with ``payload["capture"] = k`` also step ``k``'s per-device values, ``device/...`` as a free
        run records them (``TowerTrainer.step(capture=True)``; lockstep's stage chain at its first bad step).
    """
    spec = payload["spec"]
    opt_spec = spec["optimizer"]
    starts = payload["lockstep"].get("starts")
    fresh = export_state(trainer.optimizer, trainer.names, opt_spec)  # step 0 (slots at their initial values)
    rows = []
    captured: dict[str, np.ndarray] = {}
    for k in range(spec["steps"]):
        if starts is not None:
            init = starts[k]["init"]
            for name, v in zip(trainer.names, trainer.variables, strict=True):
                v.assign(tf.cast(init[name], v.dtype))
            for name, v in state.items():
                v.assign(tf.cast(init[name], v.dtype))
            load_state(trainer.optimizer, trainer.names, opt_spec, starts[k]["opt"] or fresh)
        capture = 1 if payload.get("capture") == k + 1 else None
        traj = dict(record(trainer, 1, lambda _i, k=k: batches(k), None, state, capture=capture))
        if capture:  # kept apart: only this step has them (not stacked with the other steps' rows)
            captured = {key: traj.pop(key) for key in list(traj) if key.startswith("device/")}
            captured["device/step"] = np.asarray(k + 1)
            trainer.captured = None
        traj.update(flat_state(export_state(trainer.optimizer, trainer.names, opt_spec)))
        rows.append(traj)
    out = {f"lockstep/{key}": np.stack([np.asarray(r[key]) for r in rows]) for key in rows[0]}
    out.update(captured)
    return out
