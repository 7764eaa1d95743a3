"""Where two runs first part: the ``localisation`` of a verdict (CONTRACT §6), from what both recorded.

A step runs ``inputs -> forward -> loss -> device_grads -> combined_grads ->
clip -> update -> state``, and an implementation reports some of it: the
parameters before step 1 (row 0) and after each step, the step's combined
loss (computed before the update), optionally the combined gradient it
applied, and its non-trainable state. Reading those channels step by step
against the verdict's own bounds gives the first bad step and the earliest
stage that explains it:

==================  ==========================================================
stage               when (at the first step k where any channel breaks)
==================  ==========================================================
``inputs``          the parameters differ before step 1: the runs did not start
                    from the same weights (loading, layouts)
``loss``            the loss of step k differs and so does what follows from it
                    (the gradient, or the parameters when no gradient was recorded)
``combined_grads``  the parameters agree before step k, the loss agrees, the
                    gradient applied at step k differs
``update``          the gradient applied agrees (or was not recorded and the loss
                    agrees), the parameters after step k differ: the optimizer's
                    step; also DDP replicas that stopped being identical
``state``           only the non-trainable state differs (moving statistics)
``record``          only the reported loss differs, while the gradients and the
                    parameters agree at every step: what was logged, not what
                    was computed
==================  ==========================================================

The per-device stages (``forward``, ``device_grads``, ``clip``) need values the
implementations do not report today; until they do, ``device`` is set only for
a replica finding (the rank) and the explanation says which channels were
compared.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.judging.compare import relative_gap
from parity_tests.judging.tolerance import SCALE_FLOOR

__all__ = ["STAGES", "localise", "row_gaps"]

STAGES = ("inputs", "forward", "loss", "device_grads", "combined_grads", "clip", "update", "state", "record")
_REPLICA = re.compile(r"replicas diverged (?:at run\.begin\(\)|at step (\d+)): rank (\d+), parameter (\S+)")


def row_gaps(a: Any, b: Any) -> np.ndarray:
    """``[rows]``: ``||A_k - B_k||_inf / max(||A_k||_inf, ||B_k||_inf, SCALE_FLOOR)``, the tolerance model's gap.

    :func:`~parity_tests.judging.compare.relative_gap` with the judge's shared denominator,
    so a row is over its bound here exactly when the verdict counts it over. ``inf`` for
    arrays of different shapes; ``nan`` where both sides are non-finite alike.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return np.full(min(len(a), len(b)), np.inf)
    with np.errstate(invalid="ignore"):
        norms = [np.abs(x.reshape(len(x), -1)).max(axis=1, initial=0.0) for x in (a, b)]
    return relative_gap(a, b, scale=np.maximum(*norms), scale_floor=SCALE_FLOOR)


def _channel(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str) -> dict[str, np.ndarray]:
    """The row gaps of every ``prefix`` array both sides recorded (computed once per array)."""
    return {key[len(prefix):]: row_gaps(a[key], b[key]) for key in sorted(set(a) & set(b)) if key.startswith(prefix)}


def _worst(gaps: Mapping[str, np.ndarray], row: int) -> tuple[float, str | None]:
    """The greatest gap among ``gaps`` at ``row``, and its name (NaN rows: alike non-finite, never the worst)."""
    best, name = 0.0, None
    for key, g in gaps.items():
        if row < len(g) and not np.isnan(g[row]) and (name is None or g[row] > best):
            best, name = float(g[row]), key
    return best, name


def _bound_at(verdict: Any, row: int) -> float:
    per = getattr(verdict, "per_step_bound", None)
    if per is not None and row < len(per) and np.isfinite(per[row]):
        return float(per[row])
    return float(verdict.bound)


def _loss_at(verdict: Any, a: Mapping[str, Any], b: Mapping[str, Any], step: int) -> tuple[float, float] | None:
    """(gap, bound) of the loss at ``step`` (1-based), when the verdict judged the loss channel."""
    gaps, bounds = getattr(verdict, "per_step_loss_gap", None), getattr(verdict, "per_step_loss_bound", None)
    if gaps is None or bounds is None or step - 1 >= len(gaps):
        return None
    return float(gaps[step - 1]), float(bounds[step - 1])


def _result(step: int | None, stage: str | None, device: int | None, name: str | None, gap: float, bound: float,
            explanation: str) -> dict[str, Any]:
    finite = lambda v: float(v) if np.isfinite(v) else None  # noqa: E731  (JSON has no inf)
    return {"first_bad_step": step, "stage": stage, "device": device, "name": name,
            "gap": finite(gap), "bound": finite(bound), "explanation": explanation}


def localise(a: Mapping[str, Any], b: Mapping[str, Any], verdict: Any) -> dict[str, Any]:
    """The CONTRACT §6 ``localisation`` of ``verdict`` between trajectories ``a`` (reference) and ``b``.

    Args:
        a, b: the judged trajectories (the case dtype); ``findings`` on either are read too.
        verdict: the pair's :class:`~parity_tests.judging.tolerance.Verdict` (its bounds are used).
    Returns:
        ``{"first_bad_step", "stage", "device", "name", "gap", "bound", "explanation"}``;
        ``first_bad_step`` and ``stage`` are ``None`` when no channel is over its bound.
    """
    for finding in [*getattr(a, "findings", ()), *getattr(b, "findings", ())]:
        m = _REPLICA.search(finding)
        if m:
            step = int(m.group(1) or 0)
            return _result(step, "update", int(m.group(2)), m.group(3), float("nan"), 0.0,
                           f"step {step}: {finding}")
    steps = len(a.get("loss", ())) if "loss" in a else 0
    params, grads, states = (_channel(a, b, prefix) for prefix in ("param/", "grad/", "state/"))
    has_grads = bool(grads)
    g0, n0 = _worst(params, 0)
    if g0 > _bound_at(verdict, 0):
        return _result(0, "inputs", None, n0, g0, _bound_at(verdict, 0),
                       f"before step 1: the initial parameters differ ({n0}, gap {g0:.3g}): the runs did not start from"
                       " the same weights (a loading mistake, or a torch layout recorded without run.to_tf)")
    later_bad = False
    first: dict[str, Any] | None = None
    for k in range(1, steps + 1):
        bound = _bound_at(verdict, k)
        loss = _loss_at(verdict, a, b, k)
        loss_bad = loss is not None and loss[0] > loss[1]
        gg, gn = _worst(grads, k - 1)
        grads_bad = has_grads and gg > bound
        pg, pn = _worst(params, k)
        params_bad = pg > bound
        sg, sn = _worst(states, k)
        state_bad = sg > bound
        if first is not None:
            later_bad = later_bad or grads_bad or params_bad or state_bad
            continue
        if not (loss_bad or grads_bad or params_bad or state_bad):
            continue
        agree = f"step {k}: the parameters agree before it"
        if loss_bad and (grads_bad or (params_bad and not has_grads)):
            first = _result(k, "loss", None, None, loss[0], loss[1],
                            f"{agree}; the loss differs (gap {loss[0]:.3g} > {loss[1]:.3g}) and so does "
                            + (f"the combined gradient ({gn})" if grads_bad else f"the update ({pn}; no gradient recorded)")
                            + ": the per-device losses or the way they are combined")
        elif grads_bad:
            first = _result(k, "combined_grads", None, gn, gg, bound,
                            f"{agree} and so does the loss; the combined gradient applied differs ({gn}, gap {gg:.3g})"
                            ": the per-device gradients or their combination (weighting, sum vs mean, clipping)")
        elif params_bad:
            how = "the gradient applied agrees" if has_grads else "the loss agrees (no gradient recorded)"
            first = _result(k, "update", None, pn, pg, bound,
                            f"{agree}; {how}; the parameters after it differ ({pn}, gap {pg:.3g}): the optimizer's"
                            " step (its rule, hyperparameters, slots or learning-rate schedule)")
        elif state_bad:
            first = _result(k, "state", None, sn, sg, bound,
                            f"{agree}; only the non-trainable state differs ({sn}, gap {sg:.3g}): moving statistics")
        else:
            first = _result(k, "loss", None, None, loss[0], loss[1], "")  # loss only: decided after the loop
    if first is None:
        return _result(None, None, None, None, float(verdict.gap), float(verdict.bound),
                       "no recorded channel exceeds its bound" + (" (theory predicted a difference that did not appear)"
                                                                   if verdict.status == "unexpected_parity" else ""))
    if first["explanation"] == "":
        k = first["first_bad_step"]
        if later_bad:
            first["explanation"] = (f"step {k}: only the loss differs at first (gap {first['gap']:.3g}), the"
                                    " parameters later: the per-device losses or their combination")
        else:
            first["stage"] = "record"
            first["explanation"] = (f"step {k}: the reported loss differs (gap {first['gap']:.3g}) while the gradients"
                                    " and parameters agree at every step: what was logged, not what was computed"
                                    " (e.g. one tower's loss, or a loss not averaged over ranks)")
    return first
