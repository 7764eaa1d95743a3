"""The one recorder of a built-in engine's trajectory.

Every built-in engine, TensorFlow's and torch's, records its run through a
:class:`Recorder`: made from the initial values, told each step's loss, gradients,
parameters and state as the engine's loop has them, and finished into a
:class:`~parity_tests.protocol.trajectory.Trajectory` with the contract's keys and
shapes::

    loss          [T]            the loss each step reported
    param/<name>  [T+1, ...]     initial values, then after each step
    grad/<name>   [T, ...]       the gradient each step applied (where the engine records one)
    state/<name>  [T+1, ...]     non-trainable state (batch-norm moving statistics)
    device/...    the captured step's per-device values; opt/...  the optimizer state (lockstep)

Rows go into :class:`~parity_tests.protocol.rows.RowList`s, which move to a file
once an array grows past the spill threshold, so a large model's history is never
held whole. The recorder stores the arrays it is given, as given (an engine passes
copies): where in its loop an engine takes each value stays the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from parity_tests.protocol.rows import RowList, finish, spill_arrays
from parity_tests.protocol.trajectory import Trajectory

__all__ = ["Recorder"]


def _pairs(values: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    return values.items() if isinstance(values, Mapping) else values


class Recorder:
    """One run's trajectory, recorded step by step.

    Args:
        params: initial value of each parameter, by canonical name (row 0 of ``param/<name>``): a mapping,
            or ``(name, value)`` pairs, taken one at a time.
        states: initial value of each non-trainable state (row 0 of ``state/<name>``), the same way.
        grads: whether the engine records the applied gradient (``grad/<name>``); the engines
            in which every device applies its own updates (parameter averaging, async) do not.
    """

    def __init__(self, params: Mapping[str, Any] | Iterable[tuple[str, Any]],
                 states: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None, *, grads: bool = True) -> None:
        self._losses: list[Any] = []
        # pairs are taken one at a time: an engine that hands over a generator of copies never holds a
        # second copy of the whole model (row 0 of a large model spills as it arrives)
        self._params = {k: RowList([v]) for k, v in _pairs(params)}
        self._states = {k: RowList([v]) for k, v in _pairs(states or {})}
        self._grads = {k: RowList() for k in self._params} if grads else None
        self._extra: dict[str, Any] = {}
        self._findings: list[str] = []

    def loss(self, value: Any) -> None:
        """The loss step ``t`` reported (a scalar)."""
        self._losses.append(value)

    def param(self, name: str, value: np.ndarray) -> None:
        """Parameter ``name`` after step ``t``."""
        self._params[name].append(value)

    def params(self, values: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]) -> None:
        """Every parameter after step ``t``."""
        for name, value in (values.items() if isinstance(values, Mapping) else values):
            self._params[name].append(value)

    def grad(self, name: str, value: np.ndarray) -> None:
        """The gradient of ``name`` that step ``t`` applied."""
        assert self._grads is not None, "a recorder made with grads=False"
        self._grads[name].append(value)

    def grads(self, values: Mapping[str, np.ndarray]) -> None:
        """Every gradient step ``t`` applied."""
        for name, value in values.items():
            self.grad(name, value)

    def states(self, values: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]) -> None:
        """Every non-trainable state after step ``t``."""
        for name, value in (values.items() if isinstance(values, Mapping) else values):
            self._states[name].append(value)

    def add(self, arrays: Mapping[str, Any]) -> None:
        """Arrays beside the history: ``device/...`` (a captured step), ``opt/...`` (optimizer state).

        A captured step's arrays go to spill files past the threshold, as rows do
        (:func:`~parity_tests.protocol.rows.spill_arrays`): N + 2 copies of a large model.
        """
        device = {k: v for k, v in arrays.items() if k.startswith("device/")}
        self._extra.update(arrays)
        self._extra.update(spill_arrays(device) if device else {})

    def finding(self, line: str) -> None:
        """Something the run found of itself (replicas out of sync): the judge makes it a divergence."""
        self._findings.append(line)

    def finish(self) -> Trajectory:
        """The trajectory: ``loss``, ``param/``, ``grad/``, ``state/`` (in that order), then the extras."""
        traj = Trajectory({"loss": np.asarray(self._losses)})
        traj.update({f"param/{k}": finish(v) for k, v in self._params.items()})
        traj.update({f"grad/{k}": finish(v) for k, v in (self._grads or {}).items()})
        traj.update({f"state/{k}": finish(v) for k, v in self._states.items()})
        traj.update(self._extra)
        traj.findings.extend(self._findings)
        return traj
