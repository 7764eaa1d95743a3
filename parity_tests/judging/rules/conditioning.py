"""The conditioning check (``"float64 conditioning floor"``): a float64 divergence held against how far one float64
ulp of the inputs moves each run.

The float64 bound assumes a stable run: rounding carried from step to step without growing
(``bounds``: ``gap <= 2 u D sqrt(n) T``). An ill-conditioned run (Adam with ``beta2 = 0`` dividing
by a gradient element that cancels to ``1e-10``, a chaotic learning rate) amplifies the last bit
of a sum into the leading digits, and two correct implementations part by as much. Each side that
can run again does so in float64 from initial weights and inputs moved by one float64 ulp (a
built-in also adding its sums in another order): :meth:`Conditioning.needs`, made by the session
only after the float64 divergence that asks for them. Its spread ``s`` is what one rounding of every
input becomes, so the run's own ``D sqrt(n)`` roundings a step over ``T`` steps can become
``2 D sqrt(n) T s`` (the float64 bound's envelope, ``D = 20``, ``n = 1e4``, with ``u`` replaced by the
measured ``s``: :data:`CONDITIONING_ROUNDINGS`). A stable run spreads by about ``1e-16`` and the
bound stays far below any divergence, which then stands. Where the gap is within it the float64
runs cannot tell a difference from amplified rounding: the pair is ``inconclusive``, and the detail
says to judge it with ``--lockstep`` (every step from the same state).

Whether a side reproduces itself at all (a one-ulp rerun of a program with an order left to thread
timing measures the race, not rounding) is the session's next question
(``session.judge_pair._Judged.unreproduced``, which asks for repeats of its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.judging.bounds import FLOAT64_RTOL
from parity_tests.judging.run_kinds import MOVED64, Variant
from parity_tests.judging.verdict import RULE_CONDITIONING, RULE_FLOAT64, Verdict

__all__ = ["CONDITIONING_ROUNDINGS", "Conditioning"]

#: roundings a step of the float64 bound's envelope holds (``D sqrt(n)``, ``bounds``): how far one rounding
#: of every input, measured, can grow in a step
CONDITIONING_ROUNDINGS = 20 * 100


class Conditioning:
    """The check of a float64 divergence: is the pair's float64 run well enough conditioned to tell (module docstring)."""

    name = RULE_CONDITIONING
    #: the run of each side it judges from, beside the pair's float64 run: that run from weights and inputs moved by
    #: one float64 ulp (made after the divergence that asks for it)
    needs: tuple[Variant, ...] = (MOVED64,)

    def applies(self, verdict: Verdict) -> bool:
        """A divergence found by the float64 bound (what the check may turn into ``inconclusive``)."""
        return verdict.status == "divergence" and verdict.rule == RULE_FLOAT64

    def judge(self, verdict: Verdict, runs: tuple[Mapping[str, Any], Mapping[str, Any]],
              moved: tuple[Mapping[str, Any], Mapping[str, Any]], steps: int) -> tuple[Verdict, float]:
        """``(checked, spread)``: the pair's float64 runs judged against each side's one-ulp rerun, the float64 bound's
        envelope over ``steps`` steps with the measured spread for ``u``; ``spread`` the greater side's."""
        from parity_tests.judging.perturbation import judge_perturbation  # (imports this package)

        checked = judge_perturbation(runs[0], runs[1], a32p=moved[0], b32p=moved[1], rule=RULE_CONDITIONING,
                                     perturbed="float64 reruns from weights and inputs moved by one float64 ulp",
                                     dtype=np.float64, abs_floor=FLOAT64_RTOL, factor=2 * CONDITIONING_ROUNDINGS * steps,
                                     known_differences=verdict.known_differences)
        return checked, max(checked.floor_a or 0.0, checked.floor_b or 0.0)

    @staticmethod
    def well_conditioned(spread: float) -> str:
        """The report's line where the divergence stands."""
        return (f"the float64 runs are well conditioned here: one float64 ulp of the inputs moves them by at most"
                f" {spread:.2g}, which rounding cannot amplify to the gap")

    @staticmethod
    def inconclusive(verdict: Verdict, checked: Verdict, spread: float) -> tuple[Verdict, str]:
        """The verdict and the report's line where the gap is within what amplified rounding can make."""
        return dataclasses.replace(checked, status="inconclusive", detail=(
            f"inconclusive: ill-conditioned float64 runs: one float64 ulp of the weights and inputs moves each run by"
            f" up to {spread:.2g}, and the run's own rounding can grow as far as the two runs are apart (judge it"
            f" with --lockstep, every step from the same state); {checked.detail}; by the float64 bound:"
            f" {verdict.detail.splitlines()[0]}")), "ill-conditioned: the float64 rule cannot separate the gap from rounding"
