"""A run's recorded history stacked into the contract's trajectory arrays.

Every TensorFlow runner collects one list per array while it trains and ends
with :func:`stack_trajectory`, so the keys and shapes are the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from parity_tests.protocol.rows import finish

__all__ = ["stack_trajectory"]


def stack_trajectory(losses: Sequence[float], params: Mapping[str, Sequence[np.ndarray]],
                     grads: Mapping[str, Sequence[np.ndarray]] | None = None,
                     states: Mapping[str, Sequence[np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """``{"loss": [T], "param/<name>": [T+1, ...], "grad/<name>": [T, ...], "state/<name>": [T+1, ...]}``.

    Args:
        losses: the T steps' losses.
        params: per parameter, its T+1 values (initial, then after each step).
        grads: per parameter, the T gradients applied (``None``: none recorded).
        states: per non-trainable state (batch-norm moving statistics), its T+1 values.

    Each history is a list of arrays or a :class:`parity_tests.protocol.rows.RowList`
    (which may have moved its rows to a file: the value is then a ``RowArray``).
    """
    traj = {"loss": np.asarray(losses)}
    traj.update({f"param/{k}": finish(v) for k, v in params.items()})
    traj.update({f"grad/{k}": finish(v) for k, v in (grads or {}).items()})
    traj.update({f"state/{k}": finish(v) for k, v in (states or {}).items()})
    return traj
