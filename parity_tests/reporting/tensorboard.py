"""Parity curves in TensorBoard: ``tfpar compare CASE --tensorboard DIR``.

Written with TensorFlow's own summary writer (``tf.summary``), one run per
folder, so a user who already watches training in TensorBoard sees::

    DIR/<implementation>/              loss        the step's combined loss, steps 1..S
    DIR/<reference> vs <impl>/         gap/<name>  the relative gap of each parameter (and state) row, 0..S
                                                   (of the arrays the verdict judged: a side the judge ran
                                                   with Keras' float32-rounded hyperparameters, if mapped)
                                       gap/bound   the bound the verdict applied at that row
                                       gap/loss    the loss's relative gap, steps 1..S (when recorded by both)

The gap is the tolerance model's: ``||A - B||_inf / max(||A||_inf, ||B||_inf, SCALE_FLOOR)``
per array and row (:func:`parity_tests.judging.localise.row_gaps`). The folder is written under a temporary name and renamed
into place, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.judging.localise import row_gaps

__all__ = ["write_tensorboard", "run_folder"]


def run_folder(name: str) -> str:
    """A folder name TensorBoard shows as the run: ``my_ddp.py:train`` -> ``my_ddp.py_train``."""
    return re.sub(r"[^A-Za-z0-9_.@ -]+", "_", name).strip(" .") or "run"


def _scalars(tag: str, values: Any, first_step: int) -> None:
    """One scalar per step into the default writer (steps first_step, first_step + 1, ...)."""
    import tensorflow as tf

    for i, v in enumerate(np.asarray(values, np.float64)):
        tf.summary.scalar(tag, float(v), step=first_step + i)


def write_tensorboard(result: Any, out: str | Path) -> Path:
    """Write the event files of a :class:`~parity_tests.session.comparison.CaseResult` into ``out``.

    Returns the folder. Runs of the case dtype only (the float64 companions of a
    float32 case are the floor's means, not what the user runs).
    """
    from parity_tests.running.backends import tf_module

    tf_module()  # TensorFlow started the tool's way (quiet, devices configured)
    import tensorflow as tf

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # named before it exists and made inside the try: a signal just after mkdir still finds it to remove
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    try:
        tmp.mkdir()
        d = result.case.spec["dtype"]
        trajs = {impl: result.trajectories.get(f"{impl}@{d}") for impl in result.impls}
        for impl, traj in trajs.items():
            if traj is None:
                continue
            writer = tf.summary.create_file_writer(str(tmp / run_folder(impl)))
            with writer.as_default():
                _scalars("loss", traj["loss"], 1)
            writer.close()
        for pair in result.pairs:
            # what the verdict judged: a built-in's runs with a predicted difference mapped away, where it did
            judged = pair.judged or ((pair.reference, ""), (pair.impl, ""))
            a, b = (result.trajectories.get(f"{name}@{d}{suffix}") for name, suffix in judged)
            if a is None or b is None:
                continue
            writer = tf.summary.create_file_writer(str(tmp / run_folder(f"{pair.reference} vs {pair.impl}")))
            with writer.as_default():
                for key in sorted(set(a) & set(b)):
                    if key.startswith(("param/", "state/")):
                        _scalars(f"gap/{key.partition('/')[2]}", row_gaps(a[key], b[key]), 0)
                rows = len(a["loss"]) + 1
                bound = pair.verdict.per_step_bound
                _scalars("gap/bound", bound if bound is not None else np.full(rows, pair.verdict.bound), 0)
                _scalars("gap/loss", row_gaps(a["loss"], b["loss"]), 1)
            writer.close()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
