"""The perturbation floor (``"float32 perturbation floor"``): a float32 pair judged without float64 runs.

Each side rerun with its numbers moved by one ulp; the rule is ``judging.perturbation.judge_perturbation``
(its derivation there and in docs/tolerance.md).
"""

from __future__ import annotations

from parity_tests.judging.rules.context import PairRuns, Planned
from parity_tests.judging.run_kinds import PERTURBED_RUN, Variant, as_given
from parity_tests.judging.verdict import Verdict

__all__ = ["Perturbation"]


class Perturbation:
    """The rule of a pair whose floor is measured by perturbed reruns (a side runs float32 only; ``rule``)."""

    name = "float32 perturbation floor"

    def needs(self, p: Planned) -> tuple[tuple[Variant, ...], tuple[Variant, ...]] | None:
        """Each side's run as given and, where it can be run again, its rerun from numbers moved by one ulp."""
        if p.rule != "perturbation":
            return None
        return tuple((as_given(p.dtype),) + ((PERTURBED_RUN,) if c.rerunnable else ()) for c in (p.a, p.b))

    def applies(self, pair: PairRuns) -> bool:
        return pair.rule == "perturbation"

    def judge(self, pair: PairRuns) -> Verdict:
        # judging.perturbation imports judging.rules (the floor it shares): imported here, once both are loaded
        from parity_tests.judging.perturbation import judge_perturbation

        return judge_perturbation(pair.a.run, pair.b.run, a32p=pair.a.perturbed, b32p=pair.b.perturbed,
                                  known_differences=pair.known, **(pair.perturbation or {}))
