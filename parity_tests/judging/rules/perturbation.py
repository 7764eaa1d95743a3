"""The perturbation floor (``"float32 perturbation floor"``): a float32 pair judged without float64 runs.

Each side rerun with its numbers moved by one ulp; the rule is ``judging.perturbation.judge_perturbation``
(its derivation there and in docs/tolerance.md).
"""

from __future__ import annotations

from parity_tests.judging.rules.context import PairRuns
from parity_tests.judging.verdict import Verdict

__all__ = ["Perturbation"]


class Perturbation:
    """The rule of a pair whose floor is measured by perturbed reruns (a side runs float32 only; ``rule``)."""

    name = "float32 perturbation floor"

    def applies(self, pair: PairRuns) -> bool:
        return pair.rule == "perturbation"

    def judge(self, pair: PairRuns) -> Verdict:
        # judging.perturbation imports judging.rules (the floor it shares): imported here, once both are loaded
        from parity_tests.judging.perturbation import judge_perturbation

        return judge_perturbation(pair.a.run, pair.b.run, a32p=pair.a.perturbed, b32p=pair.b.perturbed,
                                  known_differences=pair.known, **(pair.perturbation or {}))
