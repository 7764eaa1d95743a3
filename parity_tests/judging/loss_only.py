"""Would the loss have shown it? A divergence judged the way people check a run: the logged loss alone.

Most checks of a port or a multi-device run compare the loss curves, at a tolerance such as
``numpy.testing.assert_allclose(rtol=1e-3)`` (Keras 3's own numerical tests use ``atol=1e-3``). This
module says, for a pair the tool found apart, whether that check would have flagged it within the
run's steps, and where it would not, why:

* **Adam's scale invariance.** The bug scales the gradient by a constant (``factor``) and the optimizer
  normalises it away: Adam's step ``m_hat / (sqrt(v_hat) + eps)`` is unchanged when ``g`` becomes ``c g``,
  up to ``eps``, so the parameters, and the loss after them, move by ``eps``-sized amounts only.
* **A clip that never acts.** (named by the caller's explanation; here the growth and the size tell it)
* **Too few steps.** The loss gap grows step by step but stays under the tolerance in the run's steps:
  the geometric growth of its last steps, extrapolated, says about when it would cross.
* **The loss comes first.** A bug that changes the update of step k shows in the loss of step k+1
  at the earliest (a step's loss is computed before its update): at the run's last step, never.

The check: step k is flagged when ``|b_k - a_k| > atol + rtol |a_k|`` (``assert_allclose``'s rule, the
reference ``a`` as the desired value), with ``rtol = atol = 1e-3`` by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["RTOL", "ATOL", "loss_only", "attach"]

RTOL = 1e-3
ATOL = 1e-3
_ADAPTIVE = ("adam", "adamw", "amsgrad", "rmsprop", "adagrad")


def _growth(rel: np.ndarray) -> float | None:
    """The geometric growth per step of the last steps' relative gaps (>1 when growing), where it grows."""
    if len(rel) < 2 or not (rel[-2] > 0 and np.isfinite(rel[-1])) or rel[-1] <= rel[-2]:
        return None
    return float(rel[-1] / rel[-2])  # the last two steps: the earliest gaps are often rounding, not the bug


def loss_only(a: Any, b: Any, *, where: Mapping[str, Any] | None = None, spec: Mapping[str, Any] | None = None,
              rtol: float = RTOL, atol: float = ATOL) -> dict[str, Any]:
    """Whether comparing only the logged losses ``a`` (reference) and ``b`` (``[steps]``) flags the pair.

    Args:
        a, b: the two sides' logged losses, step by step, in the case dtype.
        where: the pair's localisation (its ``stage``, ``first_bad_step`` and ``factor`` give the reasons).
        spec: the case (its optimizer and step count).
    Returns:
        ``{"detectable": bool, "first_step": k or None, "max_relative_gap": g, "rtol": ..., "atol": ...,
        "why_not": [reason, ...], "text": "one line"}``.
    """
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, flagged below as any NaN is
        diff = np.abs(b - a)
    rel = diff / np.maximum(np.abs(a), np.finfo(np.float64).tiny)
    over = np.flatnonzero(~(diff <= atol + rtol * np.abs(a)))  # NaN counts as flagged
    worst = float(np.nanmax(rel)) if n else 0.0
    out: dict[str, Any] = {"detectable": bool(len(over)), "first_step": int(over[0]) + 1 if len(over) else None,
                           "max_relative_gap": worst, "rtol": rtol, "atol": atol, "why_not": []}
    if len(over):
        out["text"] = (f"the logged loss alone would have flagged it at step {out['first_step']} (|gap| > {atol:g} +"
                       f" {rtol:g} |loss|; greatest relative gap {worst:.3g})")
        return out
    why: list[str] = []
    where = where or {}
    factor = where.get("factor") or {}
    opt = ((spec or {}).get("optimizer") or {}).get("name")
    if factor and opt in _ADAPTIVE and where.get("stage") in ("device_grads", "combined_grads", "clip", "loss"):
        clip = (((spec or {}).get("parallel") or {}).get("clip") or {}).get("global_norm")
        why.append(f"{opt}'s step is invariant to a constant gradient scale up to epsilon: the gradients are"
                   f" {factor.get('text', 'scaled')}, the updates barely move"
                   + (f" (except where the global-norm clip at {clip:g} acts on one side only: there the invariance"
                      " breaks and the gap grows)" if clip else ""))
    step, steps = where.get("first_bad_step"), n
    if step and step >= steps and where.get("stage") in ("update", "state"):
        why.append(f"the bug acts on the update of step {step}, the run's last: a step's loss is logged before its"
                   " update")
    g = _growth(rel)
    if g is not None and worst > 0:
        more = max(1, math.ceil(math.log(rtol / worst) / math.log(g) - 1e-9)) if g > 1 and worst < rtol else None
        why.append(f"too few steps: the loss gap grows about {g:.3g}x a step (to {worst:.3g} at step {n})"
                   + (f"; at that rate it passes {rtol:g} after about {more} more step(s)" if more else ""))
    if not why:
        why.append(f"the loss gap stays at most {worst:.3g}, under the tolerance, and does not grow")
    out["why_not"] = why
    out["text"] = f"the logged loss alone would not have flagged it in {n} steps (greatest relative gap {worst:.3g}): " \
                  + "; ".join(why)
    return out


def attach(where: Mapping[str, Any], a: Mapping[str, Any], b: Mapping[str, Any],
           spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """``where`` (a localisation) with ``"loss_only"`` added (:func:`loss_only` of the two sides' ``loss``)."""
    if "loss" not in a or "loss" not in b:
        return dict(where)
    return {**where, "loss_only": loss_only(np.asarray(a["loss"]), np.asarray(b["loss"]), where=where, spec=spec)}
