"""Pool jobs named without importing torch: what the parent process sends the ranks.

The parent of a :class:`torchref.pool.DDPPool` (``tfpar``, which imports TensorFlow) never
needs torch itself: a job goes to the ranks as a :class:`JobRef` (module and function name,
imported by the rank, where the forkserver already imported it), and what comes back is
numpy. Importing torch in the parent cost about 2.4 s of a cold ``tfpar compare`` on the
2-core machine, spent before TensorFlow's own import could start.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.protocol.payload import check_payload
from parity_tests.protocol.rows import Keeper, RowList

__all__ = ["JobRef", "job_ref", "merge_captures", "PRELOAD"]

#: the modules the pool's forkserver imports once, so a rank's first job imports nothing
PRELOAD = ("torchref.determinism", "torchref.ddp", "torchref.averaging", "torchref.async_", "torchref.plugin")

_COMBINE_JOBS = {"param_mean": ("torchref.averaging", "train_rank_param_mean"),
                 "async": ("torchref.async_", "train_rank_async")}


@dataclass(frozen=True)
class JobRef:
    """``fn(ctx, payload)`` named by ``module`` and ``name``; calling it imports the module (in the rank)."""

    module: str
    name: str

    def __call__(self, ctx: Any, payload: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(ctx, payload)


def job_ref(payload: dict[str, Any], impl: str = "torch.ddp") -> JobRef:
    """The pool job that trains ``payload`` as ``impl`` says (rank 0 returns the trajectory).

    ``torch.single``: ``torchref.ddp.train_single`` on one rank; ``torch.ddp``:
    ``torchref.ddp.train_rank`` on N ranks, or for the ``param_mean`` and ``async``
    combine rules (no DDP: every rank applies its own updates) ``torchref.averaging``'s
    and ``torchref.async_``'s.
    """
    if impl not in ("torch.single", "torch.ddp"):
        raise ValueError(f"unknown torch implementation {impl!r}")
    check_payload(payload, impl)  # every key declared (parity_tests.protocol.payload)
    if impl == "torch.single":
        return JobRef("torchref.ddp", "train_single")
    return JobRef(*_COMBINE_JOBS.get(payload["spec"]["parallel"]["combine"], ("torchref.ddp", "train_rank")))


def merge_captures(results: list[Any]) -> dict[str, np.ndarray]:
    """The ``device/...`` arrays of a captured step from every rank's job result (rank order).

    Rank 0's result is its trajectory with ``device/`` entries for itself; the
    others return ``{"device": {...}}``. Rows (inputs, activations) are
    concatenated in rank order, per-rank scalars and gradients stacked.
    """
    traj = dict(results[0])
    mine = {k[len("device/"):]: traj.pop(k) for k in list(traj) if k.startswith("device/")}
    if not mine:
        return traj
    ranks = [mine] + [r["device"] for r in results[1:]]
    step = mine.pop("step")
    for r in ranks[1:]:
        r.pop("step", None)
    out = {"device/step": step, "device/sizes": np.asarray([len(r["x"]) for r in ranks], np.int64)}
    keep = Keeper()  # the joined arrays past the threshold together go to files, each as it is made
    for key in mine:
        vals = [r[key] for r in ranks]
        if key.startswith("combined/"):
            out[f"device/{key}"] = vals[0]
        else:
            joined = _joined(vals, concat=key == "x" or key.startswith("act/"))
            out[f"device/{key}"] = keep(joined) if isinstance(joined, np.ndarray) else joined
    traj.update(out)
    return traj


def _joined(vals: list[Any], *, concat: bool) -> Any:
    """The ranks' arrays concatenated (``concat``) or stacked along a new first axis.

    In memory when they came in memory; when a rank spilled its arrays (a large model's,
    ``protocol.rows.spill_arrays``) they are joined row by row into a
    :class:`~parity_tests.protocol.rows.RowList`, which spills past the threshold as a run's rows do:
    the same bytes, never all the ranks' arrays in memory at once.
    """
    if all(isinstance(v, np.ndarray) for v in vals):
        return np.concatenate(vals, axis=0) if concat else np.stack(vals)
    rows = RowList()
    for v in vals:
        for row in (v if concat else [v]):  # a RowArray yields its rows, read one at a time
            rows.append(np.asarray(row))
    return rows.finish()
