"""The guards every rule applies before and beside its bound: structure, dtypes, non-finite values.

* **Structure** (rule ``"structure"``): every judged array on both sides, real numbers, one
  shape with a row axis, one step axis for all; otherwise the verdict is ``error`` and names
  the first pair of runs that does not fit.
* **Dtypes**: a rule judges the dtype it was derived for; another one is a caller's mistake
  (``ValueError``).
* **Non-finite values** (rule ``"non-finite values"``): from the first row with a NaN or Inf
  the bound cannot decide. On one side only, or unlike on the two, it is a divergence; alike
  on both sides, an error (docs/tolerance.md, "The verdict"). A divergence found at an
  earlier step is reported by its own rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from parity_tests.judging.compare import (
    compare_trajectories,
    describe_key,
    describe_step,
    is_real,
    key_order,
    step_of_row,
)
from parity_tests.judging.verdict import RULE_NONFINITE
from parity_tests.protocol.rows import array_dtype, iter_pairs, nonfinite_rows

__all__: list[str] = []  # the judging modules' shared guards; the rules are the public face


def _check_dtype(traj: Mapping[str, Any], keys: list[str], dtype: type, side: str) -> None:
    for key in keys:
        got = array_dtype(traj[key])
        if got != dtype:
            raise ValueError(
                f"side {side}, {key}: expected {np.dtype(dtype).name} values, got {got} "
                f"(judge float32 runs with judge_float32, float64 runs with judge_float64)"
            )


def _structure(
    pairs: list[tuple[str, Mapping[str, Any], Mapping[str, Any]]], keys: list[str]
) -> str | None:
    """A message naming the first pair whose keys or shapes disagree (``None`` if all fit)."""
    if all(_fits(x, y, keys) for _, x, y in pairs):
        return None  # the common case, decided from shapes alone (reads no array)
    for name, x, y in pairs:
        cmp = compare_trajectories(x, y, rtol=0.0, atol=0.0, keys=keys, equal_nan=True)
        if cmp.missing_in_a or cmp.missing_in_b or cmp.shape_mismatches or not cmp.compared:
            lines = [
                ln
                for ln in cmp.message().splitlines()
                if not ln.startswith(("step ", "Greatest", "Non-finite"))
            ]
            return f"{name}: " + "; ".join(lines or ["no param/* or state/* arrays to judge"])
        rows = {np.shape(x[k])[0] for k in keys}
        if len(rows) > 1 or len({step_of_row(k, 0) for k in keys}) > 1:
            return (
                f"{name}: the judged arrays do not share one step axis (rows {sorted(rows)}); "
                "judge param/state arrays and loss/grad arrays separately"
            )
    return None


def _fits(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> bool:
    """Every key on both sides, real numbers, one shape with a row axis, and one step axis for all."""
    if not keys or any(k not in x or k not in y for k in keys):
        return False
    shapes = [(np.shape(x[k]), np.shape(y[k])) for k in keys]
    if any(a != b or len(a) == 0 for a, b in shapes):
        return False
    if not all(is_real(array_dtype(t[k])) for t in (x, y) for k in keys):
        return False
    return len({a[0] for a, _ in shapes}) == 1 and len({step_of_row(k, 0) for k in keys}) == 1


def _first_nonfinite_row(trajs: Iterable[Mapping[str, Any]], keys: list[str], rows: int) -> int:
    stop = rows
    for t in trajs:
        for k in keys:
            bad = nonfinite_rows(t[k])
            if bad.any():
                stop = min(stop, int(np.argmax(bad)))
    return stop


def _alike_nonfinite(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> bool:
    """Both sides non-finite at exactly the same places with the same values."""
    for k in keys:
        for _, xa, ya in iter_pairs(x[k], y[k]):
            a = np.asarray(xa, dtype=np.float64)
            b = np.asarray(ya, dtype=np.float64)
            fa, fb = np.isfinite(a), np.isfinite(b)
            same = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
            if not ((fa & fb) | same).all():
                return False
    return True


def _nonfinite_verdict(
    x: Mapping[str, Any],
    y: Mapping[str, Any],
    keys: list[str],
    label: str,
    stop: int,
    gap_before: float,
    bound: float,
) -> tuple[str, str, float, str, int]:
    """Status, rule, gap, detail and step once NaN/Inf appear at row ``stop`` (no divergence before)."""
    where = (
        compare_trajectories(x, y, rtol=0.0, atol=0.0, keys=keys, equal_nan=True).first_nonfinite
        or "non-finite values"
    )
    step = step_of_row(keys[0], stop)
    if _alike_nonfinite(x, y, keys):
        before = (
            f"before step {step} the greatest relative gap is {gap_before:.2e}, bound {bound:.2g}"
            if stop
            else "no finite step to judge"
        )
        detail = f"{label}: {where}; no parity verdict on non-finite values ({before})"
        return "error", RULE_NONFINITE, gap_before, detail, step
    return (
        "divergence",
        RULE_NONFINITE,
        math.inf,
        f"{label}: {where}; {_first_unlike(x, y, keys)}",
        step,
    )


def _first_unlike(x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str]) -> str:
    """The first element (step, then key order) where the two sides' NaN/Inf disagree."""
    best: tuple[Any, ...] | None = None
    for k in keys:
        for start, xa, ya in iter_pairs(x[k], y[k]):
            a = np.asarray(xa, dtype=np.float64)
            b = np.asarray(ya, dtype=np.float64)
            fa, fb = np.isfinite(a), np.isfinite(b)
            same = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
            unlike = ~((fa & fb) | same)
            if unlike.any():
                pos = tuple(int(i) for i in np.argwhere(unlike)[0])
                place = (step_of_row(k, start + pos[0]), key_order(k))
                if best is None or place < best[0]:
                    best = (place, k, (start + pos[0], *pos[1:]), float(a[pos]), float(b[pos]))
                break  # the first unlike row of this key: later chunks are later steps
    if best is None:
        return "the non-finite values agree"
    (step, _), key, pos, va, vb = best
    index = pos[1:]
    shown = "(" + ", ".join(map(str, index)) + ("," if len(index) == 1 else "") + ")"
    return (
        f"first disagreement at {describe_step(key, step)}, {describe_key(key)}, index {shown}: "
        f"side A {va:.6g}, side B {vb:.6g}"
    )

