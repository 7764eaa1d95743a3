"""The measure every rule judges with: per-step normwise relative gaps over one shared denominator.

Per step ``k`` (row ``k`` is the value after step ``k``; row 0: the initial values)::

    gap_k(X, Y) = max over arrays p of  ||X_p[k] - Y_p[k]||_inf / d_p[k]
    d_p[k]      = max(||A64_p[k]||_inf, ||B64_p[k]||_inf, SCALE_FLOOR)

with :func:`parity_tests.judging.compare.relative_gap` per array. Every gap of one verdict uses
the same denominator ``d`` (taken from the float64 runs, or from the float32 runs where there are
none), so gaps add up exactly as the triangle inequality says (:mod:`parity_tests.judging.bounds`;
docs/tolerance.md, "What is measured").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from parity_tests.judging.bounds import SCALE_FLOOR
from parity_tests.judging.compare import compare_arrays, key_order, relative_gap, step_of_row
from parity_tests.protocol.rows import row_norms

__all__: list[str] = []  # the judging modules' shared measure; the rules are the public face


def _judged_keys(trajs: Iterable[Mapping[str, Any]], keys: Iterable[str] | None) -> list[str]:
    if keys is not None:
        return sorted({keys} if isinstance(keys, str) else set(keys), key=key_order)
    found: set[str] = set()
    for t in trajs:
        found |= {k for k in t if isinstance(k, str) and k.startswith(("param/", "state/"))}
    return sorted(found, key=key_order)


def _row_norms(traj: Mapping[str, Any], key: str) -> np.ndarray:
    return row_norms(traj[key])


def _scales(
    a64: Mapping[str, Any], b64: Mapping[str, Any], keys: list[str]
) -> dict[str, np.ndarray]:
    """Shared denominators ``d_p[k] = max(||A64_p[k]||, ||B64_p[k]||)`` (floored later)."""
    return {k: np.maximum(_row_norms(a64, k), _row_norms(b64, k)) for k in keys}


def _gaps(
    x: Mapping[str, Any], y: Mapping[str, Any], keys: list[str], scales: dict[str, np.ndarray]
) -> np.ndarray:
    """``[len(keys), rows]`` per-array gaps with the shared denominators."""
    return np.stack(
        [relative_gap(x[k], y[k], scale=scales[k], scale_floor=SCALE_FLOOR) for k in keys]
    )


def _row_max(gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row greatest gap over arrays and the array index that holds it (inf > nan > numbers)."""
    with np.errstate(invalid="ignore"):
        filled = np.where(np.isnan(gaps), -1.0, gaps)
    arg = np.argmax(filled, axis=0)
    best = np.take_along_axis(gaps, arg[None, :], axis=0)[0]
    any_nan = np.isnan(gaps).any(axis=0)
    return np.where(np.isinf(best) | ~any_nan, best, np.nan), arg


def _mismatch_text(
    x: Mapping[str, Any], y: Mapping[str, Any], key: str, row: int, allowed: float
) -> str:
    """The comparator's message at one row, with the rule's absolute allowance there."""
    mm = compare_arrays(
        x[key][row],
        y[key][row],
        rtol=0.0,
        atol=allowed,
        key=key,
        step=step_of_row(key, row),
    )
    return "" if mm is None else "\n" + mm.message()

