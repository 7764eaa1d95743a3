"""The non-finite checks (``"non-finite values"``): no NaN or Inf passes as parity, and two runs that both leave
the numbers get no verdict on which left first."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from parity_tests.judging.compare import compare_trajectories, first_nonfinite
from parity_tests.judging.rules.context import PairRuns
from parity_tests.judging.verdict import RULE_NONFINITE, Verdict

__all__ = ["NonFinite", "BothNonFinite"]


def _nonfinite_guard(verdict: Verdict, a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """Never let a NaN or Inf anywhere (loss and gradients included) pass as parity.

    The tolerance model judges parameters and the loss; a run whose gradients overflow
    while its parameters are still finite has not trained as intended. One side
    non-finite is a divergence; both, at the same place, is no verdict (``error``).
    """
    if verdict.status not in ("parity", "unexpected_parity"):
        return verdict
    fa, fb = first_nonfinite(a, "A"), first_nonfinite(b, "B")
    if fa is None and fb is None:
        return verdict
    where = compare_trajectories(a, b, rtol=0.0, atol=0.0, equal_nan=True).first_nonfinite or (fa or fb)
    status = "error" if fa and fb else "divergence"
    return dataclasses.replace(verdict, status=status, rule=RULE_NONFINITE,
                               detail=f"{where}; the values before that point: {verdict.detail}")


def _both_nonfinite(verdict: Verdict, a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """Both runs non-finite, not alike: no verdict (``error``), not a divergence.

    A rule calls a NaN on one side where the other is still finite a divergence. When the other
    side turns non-finite too, later or elsewhere (Adam with ``epsilon = 0`` divides ``0 / 0``
    wherever a gradient element is exactly zero, and which elements round to exactly zero is
    rounding), the runs have both left the numbers: which one left first is not a verdict on
    the update rule.
    """
    if verdict.rule != RULE_NONFINITE or verdict.status != "divergence":
        return verdict
    fa, fb = first_nonfinite(a, "A"), first_nonfinite(b, "B")
    if fa is None or fb is None:
        return verdict
    return dataclasses.replace(verdict, status="error", detail=f"both runs become non-finite ({fa}; {fb}): no verdict"
                                                              f" on non-finite values; {verdict.detail}")



class NonFinite:
    """:func:`_nonfinite_guard` on the pair's runs as given."""

    name = "non-finite values"

    def judge(self, pair: PairRuns, verdict: Verdict) -> Verdict:
        return _nonfinite_guard(verdict, pair.a.run, pair.b.run)


class BothNonFinite:
    """:func:`_both_nonfinite` on the pair's runs as given."""

    name = "both non-finite"

    def judge(self, pair: PairRuns, verdict: Verdict) -> Verdict:
        return _both_nonfinite(verdict, pair.a.run, pair.b.run)
