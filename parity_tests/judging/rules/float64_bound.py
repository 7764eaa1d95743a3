"""The float64 bound (``"float64 bound"``): two float64 runs of one update rule differ by rounding alone.

Divergence when ``gap_k(A64, B64) > FLOAT64_RTOL`` at any step (``judging.bounds``; docs/tolerance.md).
The old module ``judging.rules`` (now this package) explains both float rules in full.
"""


from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT64_RTOL, SCALE_FLOOR
from parity_tests.judging.compare import describe_key, describe_step, step_of_row
from parity_tests.judging.gaps import _gaps, _judged_keys, _mismatch_text, _row_max, _scales
from parity_tests.judging.guards import (
    _check_dtype,
    _first_nonfinite_row,
    _nonfinite_verdict,
    _structure,
)
from parity_tests.judging.loss_channel import (
    _judges_loss,
    _loss_channel64,
    _loss_structure,
    _with_loss,
)
from parity_tests.judging.rules.context import PairRuns, Planned
from parity_tests.judging.run_kinds import FLOAT64, Variant
from parity_tests.judging.verdict import (
    RULE_FLOAT64,
    RULE_STRUCTURE,
    Verdict,
    _error,
    _finished,
    _known,
)
from parity_tests.judging.zero_gradient import Check, ZeroGradients

__all__ = ["judge_float64", "Float64Bound"]


def _without_zero(zero: ZeroGradients | None, a64: Mapping[str, Any], b64: Mapping[str, Any],
                  judged: list[str]) -> tuple[Check | None, list[str]]:
    """The zero-gradient parameters judged on their own (:mod:`parity_tests.judging.zero_gradient`), and the rest."""
    found = zero.check(a64, b64, judged) if zero is not None else None
    rest = [k for k in judged if found is None or k not in found.exempt]
    return (found, rest) if rest else (None, judged)


def _with_zero(v: Verdict, found: Check | None, label: str) -> Verdict:
    """``v`` with the zero-gradient parameters' lines, or a divergence at the first that parts beyond its bound."""
    if found is None:
        return v
    lines = "\n" + "\n".join(found.lines)
    if found.over is None or v.status == "divergence":
        return replace(v, detail=v.detail + lines)
    key, step, gap, bound = found.over
    name = key.split("/", 1)[1]
    detail = (f"{label}: {describe_key(key)} parts by {gap:.2e} > {bound:.2e}, the most rounding can move it at step"
              f" {step} ({name}'s exact gradient is zero: its drift is each side's rounding, bounded through the"
              f" optimizer's rule)" + lines)
    return replace(v, status="divergence", gap=gap, bound=bound, detail=detail, step=step, key=key, first_step=step)


def _judge64(
    a64: Mapping[str, Any], b64: Mapping[str, Any], keys: list[str], label: str = "float64"
) -> Verdict:
    """The float64 rule (structure already checked), before expectations are applied."""
    scales = _scales(a64, b64, keys)
    per_step, arg = _row_max(_gaps(a64, b64, keys, scales))
    rows = per_step.shape[0]
    stop = _first_nonfinite_row((a64, b64), keys, rows)
    head = per_step[:stop]
    bound = FLOAT64_RTOL
    worst = int(np.argmax(head)) if stop else 0
    gap = float(head[worst]) if stop else 0.0
    common: dict[str, Any] = {
        "floor_a": None,
        "floor_b": None,
        "per_step_gap": per_step,
        "per_step_floor": None,
    }
    over = np.flatnonzero(head > bound)
    if over.size:
        first = int(over[0])
        first_key, worst_key = keys[int(arg[first])], keys[int(arg[worst])]
        allowed = bound * max(float(scales[first_key][first]), SCALE_FLOOR)
        first_step, worst_step = step_of_row(first_key, first), step_of_row(worst_key, worst)
        detail = (
            f"{label}: relative gap {per_step[first]:.2e} > bound {bound:.2g} first at "
            f"{describe_step(first_key, first_step)} ({describe_key(first_key)}); greatest "
            f"{gap:.2e} at step {worst_step} ({describe_key(worst_key)})"
            + _mismatch_text(a64, b64, first_key, first, allowed)
        )
        return Verdict(
            "divergence",
            RULE_FLOAT64,
            gap,
            bound,
            detail=detail,
            step=worst_step,
            key=worst_key,
            first_step=first_step,
            **common,
        )
    if stop < rows:
        status, rule, g, detail, step = _nonfinite_verdict(a64, b64, keys, label, stop, gap, bound)
        first_step = step if status == "divergence" else None
        return Verdict(
            status, rule, g, bound, detail=detail, step=step, first_step=first_step, **common
        )
    key = keys[int(arg[worst])]
    step = step_of_row(key, worst)
    detail = (
        f"{label}: greatest relative gap {gap:.2e} <= bound {bound:.2g} "
        f"(at {describe_step(key, step)}, {describe_key(key)})"
    )
    return Verdict("parity", RULE_FLOAT64, gap, bound, detail=detail, step=step, key=key, **common)


def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"factor must be a real number, got {factor!r}")
    if not (math.isfinite(float(factor)) and factor > 0):
        raise ValueError(f"factor must be finite and > 0, got {factor!r}")
    return float(factor)


def judge_float64(
    a64: Mapping[str, Any],
    b64: Mapping[str, Any],
    *,
    expect_difference: bool = False,
    known_differences: Iterable[str] = (),
    keys: Iterable[str] | None = None,
    loss: bool | None = None,
    grads: Iterable[Mapping[str, Any]] = (),
    zero: ZeroGradients | None = None,
) -> Verdict:
    """Judge two float64 trajectories of one case by the float64 rule.

    ``gap_k = max_p ||A_p[k] - B_p[k]||_inf / max(||A_p[k]||_inf, ||B_p[k]||_inf, SCALE_FLOOR)``;
    divergence when ``gap_k > FLOAT64_RTOL`` at any step ``k``, or when the loss of a step
    ``k`` breaks its bound ``FLOAT64_RTOL + S[k] * pgap[k-1]`` (:func:`loss_sensitivity`).

    Args:
        a64, b64: float64 trajectories (the judged arrays must be float64).
        expect_difference: theory predicts a difference: a divergence becomes
            ``"expected_difference"``, parity ``"unexpected_parity"``.
        known_differences: names of documented differences, carried into the verdict.
        keys: arrays to judge; by default every ``param/*`` and ``state/*`` key.
        loss: judge the ``loss`` channel too; by default when ``keys`` is not given
            and both runs hold a loss.
        grads: other runs of the same case whose recorded ``grad/*`` may bound the loss's
            sensitivity where neither side records one (:func:`loss_sensitivity`).
        zero: the case's parameters whose exact gradient is zero (``zero_gradient.zero_gradients``):
            each judged against the drift rounding can make through the optimizer, not the bound.

    Returns:
        A :class:`Verdict`. Missing arrays or different shapes give status ``"error"``
        (rule ``"structure"``); NaN/Inf on one side only is a divergence, on both
        sides alike an error (rule ``"non-finite values"``), unless the gap already
        exceeded the bound at an earlier step.

    Raises:
        ValueError: a judged array is not float64.
    """
    known = _known(known_differences)
    judged = _judged_keys((a64, b64), keys)
    with_loss = _judges_loss((a64, b64), keys, loss)
    problem = _structure([("float64 runs A64 vs B64", a64, b64)], judged)
    problem = problem or (_loss_structure((a64, b64)) if with_loss else None)
    if problem:
        return _error(RULE_STRUCTURE, problem, known)
    _check_dtype(a64, judged, np.float64, "A")
    _check_dtype(b64, judged, np.float64, "B")
    found, judged = _without_zero(zero, a64, b64, judged)
    v = _judge64(a64, b64, judged)
    if with_loss:
        v = _with_loss(v, _loss_channel64(a64, b64, judged, "float64", tuple(grads)))
    return _finished(_with_zero(v, found, "float64"), expect_difference, known)




class Float64Bound:
    """The rule of a float64 case: :func:`judge_float64` on the two sides' float64 runs (or the runs as given)."""

    name = "float64 bound"

    def needs(self, p: Planned) -> tuple[tuple[Variant, ...], tuple[Variant, ...]] | None:
        """Each side's float64 run (the case as given), where the case is float64."""
        return ((FLOAT64,), (FLOAT64,)) if p.dtype == "float64" else None

    def applies(self, pair: PairRuns) -> bool:
        return pair.dtype == "float64"

    def judge(self, pair: PairRuns) -> Verdict:
        a, b = pair.a, pair.b
        return judge_float64(a.f64 if a.f64 is not None else a.run, b.f64 if b.f64 is not None else b.run,
                             known_differences=pair.known, grads=pair.grads, zero=pair.zero)
