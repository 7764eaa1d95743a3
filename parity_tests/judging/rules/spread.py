"""The spread check (``"run-to-run spread"``): a plugin that cannot run deterministically is judged against its own
run-to-run spread.

A plugin declared ``deterministic=False`` (``@tfpar.plugin.tensorflow(deterministic=False)``,
``@torchref.plugin.distributed(deterministic=False)``) runs without the frameworks' op
determinism: two of its runs of the same case may differ (a reduction whose order depends on
thread timing, an op without a deterministic kernel, a nondeterministic input pipeline). A gap
to the other side that is no larger than what the plugin does to itself from one run to the
next says nothing about the implementations. So, where the pair's verdict is a divergence and a
side is nondeterministic, that side is run :data:`SPREAD_RERUNS` more times on the case the
deciding rule judged, and::

    spread_X[k] = max over j <= k, over pairs (i, i') of X's runs of gap_j(X_i, X_i')
    bound'[k]   = max(bound[k], SPREAD_FACTOR * max(spread_A[k], spread_B[k]))

with ``gap`` the rule's per-step normwise relative gap (``compare.relative_gap`` of every
``param/``, ``state/`` array over ``max(||X_i||, ||X_i'||, SCALE_FLOOR)``; the loss channel
alike, on the loss). A deterministic side has spread 0. The pair is at parity ("within the
run-to-run spread") when every step's gap is within ``bound'``, and stays a divergence,
with the spreads named, when it is not.

Why three runs (the judged one and :data:`SPREAD_RERUNS` = 2 more): one rerun can repeat the
judged run's order by chance (a two-thread reduction has few orders: if each run takes one
of two with even odds, one rerun repeats the first with probability 1/2) and would measure
no spread at all; two reruns give three pairs and make that 1/4. More would cost a full run
each, and only where the verdict without them is a divergence (a wider bound cannot turn
parity into anything else, so a pair at parity runs nothing more).

Why ``SPREAD_FACTOR = 2``: the gap between the sides is at most the semantic gap plus each
side's own deviation from a typical run, ``gap(A, B) <= sem + dev_A + dev_B <= sem + 2 max(dev)``
(triangle inequality, as for the float32 rule's factor), and the measured spread between two
runs of a side is the size of such a deviation.

Only the pair's status, rule and detail change; the figures of the rule that ran are kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity_tests.judging.bounds import SCALE_FLOOR
from parity_tests.judging.compare import relative_gap
from parity_tests.judging.run_kinds import Variant, repeat
from parity_tests.judging.verdict import Verdict

__all__ = ["SPREAD_RERUNS", "SPREAD_FACTOR", "RULE_SPREAD", "Spread", "spread_rows", "within_spread"]

SPREAD_RERUNS = 2  #: more runs of a nondeterministic side (module docstring: three in all)
SPREAD_FACTOR = 2.0  #: the spread's factor in the bound (module docstring)
RULE_SPREAD = "run-to-run spread"




class Spread:
    """The check of a divergence with a nondeterministic side: is the gap beyond its run-to-run spread (module docstring)."""

    name = RULE_SPREAD

    @staticmethod
    def needs(dtype: str) -> tuple[Variant, ...]:
        """The runs of a nondeterministic side it judges from, beside the judged one: :data:`SPREAD_RERUNS` repeats of
        the case in the dtype the deciding rule judged (made after the divergence that asks for them)."""
        return tuple(repeat(dtype, i) for i in range(SPREAD_RERUNS))

    @staticmethod
    def applies(verdict: Verdict) -> bool:
        """A divergence (a wider bound cannot turn parity into anything else)."""
        return verdict.diverged


def _norm_rows(a: Any) -> np.ndarray:
    arr = np.asarray(a, np.float64)
    return np.abs(arr.reshape(len(arr), -1)).max(axis=1) if arr.size else np.zeros(len(arr))


def spread_rows(runs: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray | None]:
    """``(params [steps+1], loss [steps] or None)``: the running maximum over steps of the greatest
    pairwise gap among ``runs`` (module docstring); zeros for one run."""
    keys = sorted(k for k in runs[0] if k.startswith(("param/", "state/")))
    rows = len(np.asarray(runs[0][keys[0]])) if keys else 0
    params = np.zeros(rows)
    loss = np.zeros(len(np.asarray(runs[0]["loss"]))) if "loss" in runs[0] else None
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            a, b = runs[i], runs[j]
            for k in keys:
                scale = np.maximum(np.maximum(_norm_rows(a[k]), _norm_rows(b[k])), SCALE_FLOOR)
                params = np.fmax(params, relative_gap(a[k], b[k], scale=scale))
            if loss is not None and "loss" in b:
                la, lb = np.asarray(a["loss"], np.float64), np.asarray(b["loss"], np.float64)
                scale = np.maximum(np.maximum(np.abs(la), np.abs(lb)), SCALE_FLOOR)
                loss = np.fmax(loss, np.abs(la - lb) / scale)
    return np.maximum.accumulate(params) if rows else params, \
        (np.maximum.accumulate(loss) if loss is not None and len(loss) else loss)


def _over(gap: np.ndarray | None, bound: np.ndarray | float | None, floor: np.ndarray | None) -> bool:
    if gap is None or bound is None:
        return False
    g = np.asarray(gap, np.float64)
    b = np.broadcast_to(np.asarray(bound, np.float64), g.shape)
    f = np.zeros_like(g) if floor is None else np.broadcast_to(np.asarray(floor, np.float64)[: len(g)], g.shape)
    with np.errstate(invalid="ignore"):
        return bool(np.any(~(g <= np.fmax(b, SPREAD_FACTOR * f))))  # a NaN gap is never within


def within_spread(verdict: Verdict, spread_a: tuple[np.ndarray, np.ndarray | None],
                  spread_b: tuple[np.ndarray, np.ndarray | None], runs: str) -> Verdict:
    """``verdict`` judged again with each step's bound widened by the two sides' spreads (module docstring).

    ``runs``: says whose spread was measured and how (for the detail).
    """
    if not verdict.diverged or verdict.rule in ("non-finite values", "structure"):
        return verdict
    params = np.fmax(spread_a[0], spread_b[0]) if len(spread_a[0]) == len(spread_b[0]) else spread_a[0]
    losses = [s[1] for s in (spread_a, spread_b) if s[1] is not None]
    loss = np.fmax(*losses) if len(losses) == 2 and len(losses[0]) == len(losses[1]) else (losses[0] if losses else None)
    bound = verdict.per_step_bound if verdict.per_step_bound is not None else verdict.bound
    greatest = float(np.nanmax(params, initial=0.0))
    what = f"{runs}: greatest spread {greatest:.3g}" + (f", loss {float(np.nanmax(loss, initial=0.0)):.3g}"
                                                         if loss is not None else "")
    beyond = _over(verdict.per_step_gap, bound, params) or \
        _over(verdict.per_step_loss_gap, verdict.per_step_loss_bound, loss)
    if beyond:
        return dataclasses.replace(verdict, detail=f"beyond the run-to-run spread ({what}, bound x{SPREAD_FACTOR:g});"
                                                   f" {verdict.detail}")
    status = "unexpected_parity" if verdict.status == "expected_difference" else "parity"
    # the pair's gap and bound columns: the parameters' widened bound at the step where the gap comes closest to it
    # (a verdict within the spread must not print a bound its gap exceeds)
    g = np.asarray(verdict.per_step_gap, np.float64) if verdict.per_step_gap is not None else np.zeros(0)
    widened = (np.fmax(np.broadcast_to(np.asarray(bound, np.float64), g.shape), SPREAD_FACTOR * params[: len(g)])
               if len(g) and len(params) >= len(g) else None)
    if widened is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(widened > 0, g / widened, 0.0)
        k = int(np.nanargmax(ratio)) if np.isfinite(ratio).any() else 0
        verdict = dataclasses.replace(verdict, gap=float(g[k]), bound=float(widened[k]), per_step_bound=widened)
    return dataclasses.replace(verdict, status=status, rule=RULE_SPREAD, first_step=None,
                               detail=f"within the run-to-run spread ({what}; gap {verdict.gap:.3g} <="
                                      f" {SPREAD_FACTOR:g} x spread); without it: {verdict.detail}")
