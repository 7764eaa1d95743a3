"""The update's sensitivity to its gradient, measured from a side's run and its perturbed rerun: how much of the two
sides' parameter gap their gradients' rounding-sized gap carries through an ill-conditioned update (rule 3).

Why (the error-rate hunt's pair 251, docs/error-rates.md): Adam with ``beta2 = 0`` updates by
``u = alpha_t m / (|g| + eps)``, nearly ``sign(g)``, and where ``|g|`` is a few ``eps`` its slope
``du/dg = alpha_t ((1 - beta1) / (|g| + eps) - m sign(g) / (|g| + eps)**2)`` is large: 1.58e3 on that
pair's ``2.kernel[0, 3]`` at step 2 (``alpha_2 = 5.26``, ``m = -6.3e-3`` carried from a step-1 gradient 20
times larger; measured from the runs below: 1.57e3 and 1.39e3), where ``g = -3.4e-3`` is a cancelled sum
(``h_1 d_1 + h_2 d_2``, terms of 0.46: its float32 rounding is ``~1e-7``, 2e-5 of ``g``). One element's
gradient rounding, times 1.6e3, is then the whole parameter gap of its array, and each side's
one-ulp floor is a *single draw* of that one element's rounding: six reruns of each side (seeds
1000-1005) spread ``2.kernel`` by 4.6e-5 to 4.7e-4 (side A) and 2.8e-5 to 4.4e-4 (side B), the hunt's
rerun drew 1.4e-4 and 5.2e-5, while the two sides sit 2.7e-4 and 1.5e-4 from exact (their float64
runs). The factor 2 of the rule presumes a floor that is the largest of many draws; for a single
draw per side, with every error a normal draw of one size, ``P(|e_A - e_B| > 2 max(|e_A - e_A'|,
|e_B - e_B'|)) = 8.7%`` (and 0.27% for 8 elements of equal weight, under 1e-4 for 32).

What is measured instead, per element, from the runs the rule already has. Step ``k`` moves a
parameter by ``Delta_k = P[k] - P[k-1]``, a function of the gradient applied ``g_k`` (and of the
optimizer's state, its earlier gradients). Each side's run ``X`` and its rerun ``X'`` apply gradients
that differ by rounding, ``dg_X = g_X - g_X'``, and move by ``dDelta_X = Delta_X - Delta_X'``: their
ratio is the update's slope where it is used, a secant of the size rounding moves it,

    J_X[k] = |dDelta_X[k]| / |dg_X[k]|        (0 where dg_X[k] = 0: nothing measured)
    J[k]   = max(J_A[k], J_B[k])              (the same function on both sides: the case's optimizer)

(a bug reproduces in its side's rerun, so ``J`` is the slope of that side's own update, buggy or
not). The two sides' gradients differ by ``dg[k] = g_A[k] - g_B[k]``; to first order that moves their
updates apart by ``J[k] |dg[k]|``, and the parameters after step ``k`` carry every step's share:

    E[k] = E[k-1] + J[k] |dg[k]|   where the gradients' gap is rounding (below), else E[k-1];  E[0] = 0

and the parameter channel judges ``(|A[k] - B[k]| - E[k])+``, element by element, against the
rule's bound. This is the loss channel's carried term one stage earlier (``loss_channel._carried``:
the loss accepts ``S x pgap`` of a parameter gap the parameter channel accepts); here the parameters
accept what a gradient gap carries, and only a gradient gap *accepted as rounding*: per array and
step, ``gap_k(g_A, g_B) <= 2 max(gfloor_A[k], gfloor_B[k]) + 4 u`` with ``gfloor_X[k] = max_{j<=k}
gap_j(g_X, g_X')`` (rule 3's own bound on the gradients, against ``max(|g_A|, |g_B|)`` of that step: a
gradient's floor is the largest over every element's rounding, with no update between, so a stable
sample). A bug in the gradient (a loss scaled twice by ``1/N``, a missed all-reduce) parts the gradients
far beyond that and carries nothing; a bug in the update (a learning rate off by ``1e-3``) meets equal
gradients at step 1, where ``E[1] = J[1] |dg[1]|`` is ``J`` times the gradients' own rounding, far below
the bug. Not for an unrecorded gradient (``E = 0``: the rule as before), nor a borrowed floor (a side
without its own rerun measures no slope), nor row-by-row arrays (large models: ``E = 0``).

Limits, said where they bite: a secant measured over one rounding-sized move is noisy where ``dg_X``
is a few ulps and ``dDelta_X`` also holds the update's own rounding or the state's earlier gradients:
``J`` then reads high, by the ratio of two rounding draws of that element, and the bound widens at that
element only (every other element still judges a bug that moves them all).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT32_FACTOR

__all__ = ["update_slope", "carried_by_gradients", "gradients_accepted"]


def _plain(traj: Mapping[str, Any], key: str) -> np.ndarray | None:
    """``traj[key]`` as float64 when it is an in-memory array (not a row-by-row ``RowArray``), else ``None``."""
    v = traj.get(key)
    if v is None or not isinstance(v, np.ndarray):
        return None
    return np.asarray(v, dtype=np.float64)


def update_slope(params: np.ndarray, grads: np.ndarray, params_p: np.ndarray, grads_p: np.ndarray) -> np.ndarray:
    """``J[k] = |dDelta[k]| / |dg[k]|`` per element, ``[steps, ...]``: the update's secant slope against its gradient.

    ``params``/``params_p`` ``[steps + 1, ...]`` (the initial row first) of a run and its rerun,
    ``grads``/``grads_p`` ``[steps, ...]`` the gradients they applied. 0 where the two gradients are
    equal (nothing measured) or a value is not finite.
    """
    du = np.diff(params, axis=0) - np.diff(params_p, axis=0)
    dg = grads - grads_p
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(dg != 0, np.abs(du) / np.abs(dg), 0.0)
    return np.where(np.isfinite(j), j, 0.0)


def _rel(x: np.ndarray, y: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-row ``max |x - y| / scale`` (``scale`` 0: 0)."""
    d = np.abs(x - y).reshape(x.shape[0], -1).max(axis=1, initial=0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, d / np.where(scale > 0, scale, 1.0), 0.0)


def gradients_accepted(ga: np.ndarray, gb: np.ndarray, gap_: np.ndarray | None, gbp: np.ndarray | None,
                       factor: float = FLOAT32_FACTOR, abs_floor: float = FLOAT32_ABS_FLOOR) -> np.ndarray:
    """``[steps]`` bool: the two sides' gradients of one array part by no more than rule 3 accepts as rounding.

    ``gap_k(g_A, g_B) <= factor * max(gfloor_A[k], gfloor_B[k]) + abs_floor`` with each side's floor
    ``gfloor_X[k] = max_{j<=k} gap_j(g_X, g_X')`` (a side without its own rerun, ``None``, takes the
    other's), every gap against ``max(||g_A[k]||_inf, ||g_B[k]||_inf)``. False where a value is not finite.
    """
    rows = ga.shape[0]
    flat = lambda g: np.abs(g).reshape(rows, -1).max(axis=1, initial=0.0)  # noqa: E731
    scale = np.maximum(flat(ga), flat(gb))
    floors = [np.fmax.accumulate(_rel(g, p, scale)) for g, p in ((ga, gap_), (gb, gbp)) if p is not None]
    floor = np.max(floors, axis=0) if floors else np.zeros(rows)
    with np.errstate(invalid="ignore"):
        ok = _rel(ga, gb, scale) <= factor * floor + abs_floor
    return ok & np.isfinite(scale)


def carried_by_gradients(
    a32: Mapping[str, Any],
    b32: Mapping[str, Any],
    a32p: Mapping[str, Any] | None,
    b32p: Mapping[str, Any] | None,
    keys: list[str],
    factor: float = FLOAT32_FACTOR,
    abs_floor: float = FLOAT32_ABS_FLOOR,
) -> dict[str, np.ndarray]:
    """``{param key: E}``, ``E`` ``[steps + 1, ...]`` the part of ``|A - B|`` the gradients' accepted gap carries.

    ``E[k] = E[k-1] + J[k] |g_A[k] - g_B[k]|`` at the steps where :func:`gradients_accepted`, else
    ``E[k-1]``, with ``J = max(J_A, J_B)`` (:func:`update_slope`, from each side's own rerun:
    ``a32p``/``b32p``, ``None`` for a side that has none). Only ``param/NAME`` keys with ``grad/NAME``
    recorded, in memory, in every run given and with ``steps + 1`` parameter rows; other keys are left
    out (nothing carried). Module docstring: the derivation.
    """
    out: dict[str, np.ndarray] = {}
    for key in keys:
        if not key.startswith("param/"):
            continue
        gkey = "grad/" + key.removeprefix("param/")
        pa, pb, ga, gb = _plain(a32, key), _plain(b32, key), _plain(a32, gkey), _plain(b32, gkey)
        if any(v is None for v in (pa, pb, ga, gb)):
            continue
        if pa.shape != pb.shape or ga.shape != gb.shape or pa.shape[0] != ga.shape[0] + 1 or pa.shape[1:] != ga.shape[1:]:
            continue
        slopes, reruns = [], {}
        for side, rerun, p, g in (("A", a32p, pa, ga), ("B", b32p, pb, gb)):
            if rerun is None:
                continue
            pp, gp = _plain(rerun, key), _plain(rerun, gkey)
            if pp is None or gp is None or pp.shape != p.shape or gp.shape != g.shape:
                continue
            slopes.append(update_slope(p, g, pp, gp))
            reruns[side] = gp
        if not slopes:
            continue
        slope = np.max(slopes, axis=0)
        ok = gradients_accepted(ga, gb, reruns.get("A"), reruns.get("B"), factor, abs_floor)
        with np.errstate(invalid="ignore"):
            step = np.where(ok.reshape((-1,) + (1,) * (ga.ndim - 1)), slope * np.abs(ga - gb), 0.0)
        step = np.where(np.isfinite(step), step, 0.0)
        carried = np.concatenate([np.zeros((1,) + ga.shape[1:]), np.cumsum(step, axis=0)])
        if carried.any():
            out[key] = carried
    return out
