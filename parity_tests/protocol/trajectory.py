"""Trajectory files (``trajectory.npz``): plain arrays, no pickles, written atomically.

Keys: ``loss`` ``[steps]``; ``param/<name>`` ``[steps+1, *shape]``;
``grad/<name>`` ``[steps, *shape]``; ``state/<name>`` ``[steps+1, *shape]``.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.protocol.atomic import atomic_write_npz
from parity_tests.protocol.errors import CaseError

__all__ = ["Finding", "finding_data", "Trajectory", "save_trajectory", "load_trajectory", "check_trajectory", "key_order", "step_of_row"]

_PREFIXES = ("param/", "grad/", "state/")


class Finding(str):
    """One line of :attr:`Trajectory.findings` (what a person reads), with what it found as data.

    ``data``: JSON-able facts the judge reads instead of the line, e.g. DDP replicas out of sync
    (``running.plugins.replica_divergence``): ``{"kind": "replicas", "step": k, "rank": r, "name": n,
    "norms": [[rank, |g|], ...] or None}`` (``step`` 0 is ``run.begin()``). A plain ``str`` finding
    has none (``data == {}``). A finding stays a ``str`` wherever one is expected; a manifest keeps
    the line under ``findings`` and the data beside it (``finding_data``), and pickling keeps both.
    """

    data: dict[str, Any]

    def __new__(cls, line: str, data: dict[str, Any] | None = None) -> Finding:
        out = super().__new__(cls, line)
        out.data = dict(data or {})
        return out


def finding_data(found: Any) -> dict[str, Any]:
    """``found``'s data (:class:`Finding`), ``{}`` for a plain line."""
    return dict(getattr(found, "data", None) or {})


class Trajectory(dict):
    """A trajectory (``{key: array}``) with what the run found out about itself.

    ``findings``: lines a person reads, each a divergence within one implementation that
    no comparison with another would show (e.g. DDP replicas that stopped being bitwise
    identical). The judge turns any finding into a divergence of every pair it is in.
    ``meta``: what the run saw of itself that is not an array (``keras_optimizers``: every
    Keras optimizer a TensorFlow plugin made, with its learning rate's dtype; ``keras_loss_scales``: the factor
    Keras scaled a distributed loss by; ``keras_float32_constants``: every regularizer factor Keras held rounded
    to float32 in a float64 computation (``tfpar.keras_seen``); ``float32_losses``: every float64 loss a
    ``tf.compat.v1.losses`` function reduced in float32 (``tfpar.v1_losses_seen``); ``torch_optimizers``: every
    torch optimizer a torch plugin made, ``torchref.torch_seen``).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.findings: list[str] = []
        self.meta: dict = {}


def check_trajectory(traj: dict[str, np.ndarray], steps: int | None = None) -> None:
    """Assert the contract's keys and shapes (``steps`` from ``loss`` if not given)."""
    if "loss" not in traj:
        raise ValueError("trajectory has no 'loss' array")
    steps = len(traj["loss"]) if steps is None else steps
    if traj["loss"].shape != (steps,):
        raise ValueError(f"loss has shape {traj['loss'].shape}, expected ({steps},)")
    for k, v in traj.items():
        if k == "loss":
            continue
        if not k.startswith(_PREFIXES):
            raise ValueError(f"unexpected trajectory key {k!r}")
        rows = steps if k.startswith("grad/") else steps + 1
        if v.shape[0] != rows:
            raise ValueError(f"{k} has {v.shape[0]} rows, expected {rows}")


def save_trajectory(path: str | os.PathLike, traj: dict[str, np.ndarray]) -> Path:
    """Write ``traj`` to ``path`` (``.npz``) atomically."""
    check_trajectory(traj)
    return atomic_write_npz(path, traj)


def load_trajectory(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a trajectory file (``allow_pickle=False``); bad files raise :class:`CaseError`."""
    p = Path(path)
    try:
        with np.load(p, allow_pickle=False) as z:
            traj = {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CaseError(str(p), f"a trajectory .npz file ({type(e).__name__})") from None
    try:
        check_trajectory(traj)
    except ValueError as e:
        raise CaseError(str(p), f"a trajectory in the contract's format ({e})") from None
    return traj


# ---------------------------------------------------------------- the keys, in reading order

_GROUP_RANK = {"loss": 0, "grad": 1, "param": 2, "state": 3}
_OTHER_RANK = 4


def _group(key: str) -> str | None:
    if key == "loss":
        return "loss"
    head, sep, _ = key.partition("/")
    return head if sep and head in ("grad", "param", "state") else None

def step_of_row(key: str, row: int) -> int:
    """The step a row of ``key`` belongs to, as a person reads it.

    ``loss`` and ``grad/*`` row ``k`` is step ``k + 1``; ``param/*``, ``state/*``
    (and any other key) row ``k`` is "after step ``k``", row 0 being the initial values.
    """
    return row + 1 if _group(key) in ("loss", "grad") else row

def _natural(text: str) -> tuple[Any, ...]:
    # "10.kernel" sorts after "2.kernel": layer indices compare as numbers.
    return tuple(
        (0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t
    )

def key_order(key: str) -> tuple[Any, ...]:
    """Sort key: ``loss``, ``grad/*``, ``param/*``, ``state/*``, others; names naturally."""
    return (_GROUP_RANK.get(_group(key) or "", _OTHER_RANK), _natural(key))
