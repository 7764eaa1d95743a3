"""The loss channel: the loss curve judged beside the parameters, with its own bound.

The loss decides too, because a wrong loss curve is what a user publishes. Its gap is
``|L_A[r] - L_B[r]| / max(d_L[r], SCALE_FLOOR)`` with ``d_L[r] = max_X |L_X[r]|`` over the
runs that set the scale (row ``r`` is step ``r + 1``), and its bound is the rule's
(:func:`_loss_channel64`, :func:`_loss_channel_floor`, :func:`_carried`); :func:`_with_loss`
merges it into the parameter channel's verdict. Derivation (docs/tolerance.md, "The loss under
rule 1", and rules 2 and 3):

The loss (float64 bound ``FLOAT64_RTOL + S[k] * pgap[k-1]``):
    The loss of step ``k`` is computed from the parameters of row ``k - 1``, so between
    two sides::

        L_A - L_B = (evalA - L(theta_A)) - (evalB - L(theta_B)) + (L(theta_A) - L(theta_B))

    *Evaluation.* An mse or cross-entropy loss is a non-negatively weighted mean of
    non-negative terms, so its summation has relative error ``<= sqrt(n) * u`` with no
    cancellation (unlike a gradient). Each term is computed from outputs with absolute
    error ``delta <= u * D * sqrt(n) * F`` (``F`` the outputs' size): for cross-entropy
    ``|dl/dz|_1 = 2 (1 - p_y) <= 2 l`` (as ``1 - p <= -log p``), so a term's relative
    error is ``<= 2 delta``; for mse ``|dL| <= 2 sqrt(L) delta`` (Cauchy-Schwarz), which is
    ``<= 20 delta`` of ``max(L, SCALE_FLOOR)``. Both sides together:
    ``2 * (sqrt(n) u + 20 u D sqrt(n) F) <= 1e-10`` for ``F <= 11`` (mse outputs), and
    ``2 * (sqrt(n) u + 2 u D sqrt(n) Z) <= 1e-10`` for logits ``Z <= 110``, with ``D = 20``,
    ``n = 1e4`` as above: ``FLOAT64_RTOL`` covers it within that envelope.
    *Carried.* ``|L(theta_A) - L(theta_B)| <= sum_p ||g_p||_1 ||dtheta_p||_inf`` to first
    order (the second order is ``~1e-20`` relative, inside ``FLOAT64_RTOL``), with ``g`` the
    recorded combined gradient of that step; :func:`loss_sensitivity` turns it into
    ``S[k] * pgap[k-1]`` with the measured parameter gap. Without a recorded gradient
    (``param_mean``, ``async``) the float64 rule cannot bound this part and leaves the
    loss to the other rules (the detail says so). Under clipping the recorded gradient
    is the clipped one, so ``S`` is a lower estimate there; the carried term matters only
    once the parameter gap nears its own bound.
    The float32 and perturbation rules need no such derivation: their loss floors are
    measured like the parameters' (the triangle inequality for the float32 rule holds
    for the loss with its own shared denominator ``d_L = max(|L_A64|, |L_B64|)``, and
    ``FLOAT32_ABS_FLOOR`` absorbs the float64 loss gap while ``(1 + S) * 1e-10`` stays
    below ``2.4e-7``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT64_RTOL, SCALE_FLOOR
from parity_tests.judging.compare import relative_gap
from parity_tests.judging.gaps import _gaps, _mismatch_text, _row_max, _scales
from parity_tests.judging.verdict import (
    RULE_FLOAT64,
    RULE_NONFINITE,
    RULE_STRUCTURE,
    Verdict,
    _first_line_plus,
)
from parity_tests.protocol.rows import iter_rows

__all__ = ["LOSS_KEY", "loss_sensitivity"]

#: The judged loss channel's key (one value per step, row ``r`` is step ``r + 1``).
LOSS_KEY = "loss"


@dataclass(frozen=True)
class _Channel:
    """The loss channel of one rule: per-step gap and bound (row ``r`` is step ``r + 1``)."""

    gap: np.ndarray
    bound: np.ndarray
    rule: str
    label: str
    how: str  # how the bound was formed, for the detail
    mismatch: tuple[Mapping[str, Any], Mapping[str, Any], np.ndarray]  # (x, y, scale) for the message
    #: why a step whose bound is ``inf`` was not judged (the verdict's ``unjudged`` line)
    why: str = "no recorded gradient bounds its sensitivity to the parameters' rounding"


def _judges_loss(trajs: Iterable[Mapping[str, Any]], keys: Iterable[str] | None, loss: bool | None) -> bool:
    """Judge the loss channel: by default whenever no ``keys=`` were given and every run holds a loss."""
    wanted = keys is None if loss is None else bool(loss)
    return wanted and all(LOSS_KEY in t for t in trajs)


def _loss_scale(*trajs: Mapping[str, Any]) -> np.ndarray:
    """``d_L[r] = max_X |L_X[r]|`` over the runs that set the scale (floored in :func:`relative_gap`)."""
    return np.max([np.abs(np.asarray(t[LOSS_KEY], dtype=np.float64)) for t in trajs], axis=0)


def _loss_gap(x: Mapping[str, Any], y: Mapping[str, Any], scale: np.ndarray) -> np.ndarray:
    """``|L_X[r] - L_Y[r]| / max(d_L[r], SCALE_FLOOR)`` (``inf``/``nan`` where non-finite)."""
    return relative_gap(x[LOSS_KEY], y[LOSS_KEY], scale=scale, scale_floor=SCALE_FLOOR)


def _loss_structure(trajs: Iterable[Mapping[str, Any]]) -> str | None:
    shapes = {np.asarray(t[LOSS_KEY]).shape for t in trajs}
    if len(shapes) > 1 or any(len(s) != 1 for s in shapes):
        return f"loss: one value per step on every run expected, got shapes {sorted(shapes)}"
    return None


def loss_sensitivity(
    a: Mapping[str, Any], b: Mapping[str, Any], param_keys: list[str], scales: Mapping[str, np.ndarray],
    *, grads: Iterable[Mapping[str, Any]] = (),
) -> np.ndarray | None:
    """The loss's normwise relative condition number with respect to the parameters, per step.

    ``S[r] = sum_p ||g_p[r]||_1 * max(d_p[r], SCALE_FLOOR) / max(d_L[r], SCALE_FLOOR)``

    with ``g_p[r]`` a combined gradient of step ``r + 1`` (elementwise the largest of those
    recorded), taken at the parameters of row ``r`` from which that step's loss is computed.
    To first order ``|L(theta_A) - L(theta_B)| <= sum_p ||g_p||_1 ||dtheta_p||_inf`` and
    ``||dtheta_p[r]||_inf = gap_p[r] * max(d_p[r], SCALE_FLOOR)``, so a parameter gap ``pgap[r]``
    moves the loss's relative gap by at most ``S[r] * pgap[r]``.

    The gradient comes from whichever of ``a``, ``b`` and ``grads`` recorded it: one side's
    gradient is enough (to first order the two sides' gradients agree where their parameters
    do, and where they do not the parameter channel has already found it), and ``grads`` holds
    a built-in's run of the same case for pairs in which neither side records one (the judge's
    choice: ``judging.pair``). ``None`` when no run holds every gradient (``param_mean``,
    ``async``: no single gradient applies).
    """
    if not param_keys:
        return None
    names = [f"grad/{k.partition('/')[2]}" for k in param_keys]
    steps = np.asarray(a[LOSS_KEY]).shape[0]
    sources = [t for t in (a, b, *grads)
               if all(n in t and np.shape(t[n])[:1] == (steps,) for n in names)]
    if not sources:
        return None
    total = np.zeros(steps)
    for key, name in zip(param_keys, names, strict=True):
        if len({np.shape(t[name]) for t in sources}) > 1:
            return None
        g1 = np.zeros(steps)
        for t in sources:
            for start, xa in iter_rows(t[name]):  # row by row: a large model's gradients stay on disk
                ga = np.abs(np.asarray(xa, dtype=np.float64)).reshape(len(xa), -1).sum(axis=1)
                g1[start:start + len(xa)] = np.maximum(g1[start:start + len(xa)], ga)
        total += g1 * np.maximum(scales[key][:steps], SCALE_FLOOR)
    return total / np.maximum(_loss_scale(a, b), SCALE_FLOOR)


def _steps_text(steps: Iterable[int]) -> str:
    """``[3, 4, 5, 7]`` -> ``"3-5, 7"``."""
    runs: list[list[int]] = []
    for k in sorted(steps):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _loss_channel64(
    a64: Mapping[str, Any], b64: Mapping[str, Any], judged: list[str], label: str,
    grads: Iterable[Mapping[str, Any]] = (),
) -> _Channel:
    """The float64 loss bound, ``bound_L[r] = FLOAT64_RTOL + S[r] * pgap[r]``.

    ``pgap[r]`` is the measured float64 gap of the ``param/*`` arrays at row ``r`` (the
    parameters the loss of step ``r + 1`` is computed from) and ``S`` is
    :func:`loss_sensitivity`; ``FLOAT64_RTOL`` bounds the two sides' own evaluation of
    the loss (module docstring, "The loss"). Where ``pgap[r]`` is exactly 0 (both sides
    hold the same numbers: always before step 1, when they start from the same weights)
    the carried term is exactly 0 and no gradient is needed: the bound is ``FLOAT64_RTOL``.
    At other steps without any recorded gradient the bound is ``inf`` (that step's loss is
    not judged by this rule) and the verdict's ``unjudged`` says which steps.
    """
    scale = _loss_scale(a64, b64)
    gap = _loss_gap(a64, b64, scale)
    steps = gap.shape[0]
    pkeys = [k for k in judged if k.startswith("param/")]
    scales = _scales(a64, b64, pkeys)
    sens = loss_sensitivity(a64, b64, pkeys, scales, grads=grads)
    pgap = _row_max(_gaps(a64, b64, pkeys, scales))[0][:steps] if pkeys else np.zeros(steps)
    same = pgap == 0.0
    with np.errstate(invalid="ignore"):
        if sens is None:
            bound = np.where(same, FLOAT64_RTOL, math.inf)
            unjudged = [r + 1 for r in range(steps) if not same[r]]
            how = (f"bound {FLOAT64_RTOL:.2g} where both sides start the step from the same parameters"
                   + (f"; not judged at step(s) {_steps_text(unjudged)}: the parameters the loss is computed from"
                      " differ by rounding there, and no recorded gradient bounds its sensitivity to them"
                      if unjudged else ""))
        else:
            bound = FLOAT64_RTOL + sens * np.fmax(pgap, 0.0)
            how = f"bound {FLOAT64_RTOL:.2g} + S x (parameter gap of the step before), S up to {np.nanmax(sens):.2g}"
    return _Channel(gap, bound, RULE_FLOAT64, label, how, (a64, b64, scale))


def _loss_channel_floor(
    x: Mapping[str, Any], y: Mapping[str, Any], floor_x: np.ndarray, floor_y: np.ndarray,
    scale: np.ndarray, factor: float, rule: str, label: str, abs_floor: float = FLOAT32_ABS_FLOOR,
) -> _Channel:
    """A floor rule's loss bound: ``factor * max(floor_A[r], floor_B[r]) + abs_floor``."""
    with np.errstate(invalid="ignore"):
        bound = factor * np.fmax(floor_x, floor_y) + abs_floor
    how = (f"loss floors A up to {np.nanmax(floor_x, initial=0.0):.2e}, "
           f"B up to {np.nanmax(floor_y, initial=0.0):.2e}")
    return _Channel(_loss_gap(x, y, scale), bound, rule, label, how, (x, y, scale))


def _earliest_other(v: Verdict) -> int | None:
    """The step at which the parameter channel stopped being at parity (``None``: it never did)."""
    if v.status == "divergence":
        return v.first_step
    if v.status == "error" and v.rule == RULE_NONFINITE:
        return v.step
    return None


def _with_loss(v: Verdict, ch: _Channel | None) -> Verdict:
    """Merge the loss channel into the parameter channel's verdict ``v`` (before expectations).

    The verdict is a divergence when either channel breaks; the channel that breaks first
    names ``key``, ``step``, ``gap`` and ``bound``. At one step the loss comes first: the
    loss of step ``k`` is computed from the parameters of step ``k - 1``, before the update
    that produces the parameters of step ``k``.
    """
    if ch is None or (v.status == "error" and v.rule == RULE_STRUCTURE):
        return v
    figures: dict[str, Any] = {"per_step_loss_gap": ch.gap, "per_step_loss_bound": ch.bound}
    skipped = [r + 1 for r in np.flatnonzero(~np.isfinite(ch.bound))]
    if skipped:
        figures["unjudged"] = (*v.unjudged, f"the loss at step(s) {_steps_text(skipped)} ({ch.why})")
    with np.errstate(invalid="ignore", divide="ignore"):
        over = np.flatnonzero(ch.gap > ch.bound)
        ratio = np.where(np.isnan(ch.gap), -1.0, ch.gap / ch.bound)
    if not over.size:
        judged = np.isfinite(ch.bound)
        if not judged.any():
            return replace(v, detail=_first_line_plus(v.detail, f"; loss {ch.how}"), **figures)
        r = int(np.nanargmax(np.where(judged, ratio, -1.0)))
        note = f"; loss within its bound (tightest at step {r + 1}: {ch.gap[r]:.2e} <= {ch.bound[r]:.2e}; {ch.how})"
        return replace(v, detail=_first_line_plus(v.detail, note), **figures)
    first = int(over[0])
    other = _earliest_other(v)
    if other is not None and other < first + 1:
        note = f"; the loss is also over its bound from step {first + 1}"
        return replace(v, detail=_first_line_plus(v.detail, note), **figures)
    worst = int(np.argmax(ratio))
    x, y, scale = ch.mismatch
    allowed = float(ch.bound[first]) * max(float(scale[first]), SCALE_FLOOR)
    before = v.detail.splitlines()[0] if v.detail else ""
    detail = (
        f"{ch.label}: loss relative gap {ch.gap[first]:.2e} > bound {ch.bound[first]:.2e} first at "
        f"step {first + 1} (loss); greatest gap/bound {ch.gap[worst]:.2e} / {ch.bound[worst]:.2e} at step "
        f"{worst + 1}; {ch.how}; parameters: {before}"
        + _mismatch_text(x, y, LOSS_KEY, first, allowed)
    )
    return replace(v, status="divergence", rule=ch.rule, gap=float(ch.gap[worst]), bound=float(ch.bound[worst]),
                   step=worst + 1, key=LOSS_KEY, first_step=first + 1, detail=detail, **figures)


def _carried(ch: _Channel, a32: Mapping[str, Any], b32: Mapping[str, Any], judged: list[str],
             scales: dict[str, np.ndarray]) -> _Channel:
    """The perturbation rule's loss bound plus the parameters' gap carried into the loss: ``+ S[r] * pgap[r]``.

    The loss of step ``r + 1`` is computed from the parameters of row ``r``; the two sides'
    parameters there differ by ``pgap[r]`` (measured between ``A32`` and ``B32``, and judged
    by the parameter channel), which moves the loss's relative gap by at most ``S[r] * pgap[r]``
    to first order (:func:`loss_sensitivity`; the float64 rule's "carried" term, module
    docstring "The loss"). The sampled loss floors hold each side's own evaluation and its
    own carried spread, not the *other* side's parameters: without this term the loss channel
    would call a divergence what the parameter channel accepts as rounding. Unchanged when a
    side recorded no gradient.
    """
    pkeys = [k for k in judged if k.startswith("param/")]
    sens = loss_sensitivity(a32, b32, pkeys, scales)
    if sens is None:
        return ch
    pgap, _ = _row_max(_gaps(a32, b32, pkeys, scales))
    with np.errstate(invalid="ignore"):
        bound = ch.bound + sens * np.fmax(pgap[: ch.bound.shape[0]], 0.0)
    return replace(ch, bound=bound, how=ch.how + f", + S x (parameter gap of the step before), S up to "
                                                 f"{np.nanmax(sens, initial=0.0):.2g}")

