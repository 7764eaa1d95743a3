"""The bfloat16 rule (``"bfloat16 computation"``): a mixed_bfloat16 pair held against float64.

Its derivation and the sides' ``judging.bfloat16.Side`` are in ``judging.bfloat16`` (docs/mixed-precision.md).
"""

from __future__ import annotations

from parity_tests.judging.rules.context import PairRuns
from parity_tests.judging.verdict import Verdict

__all__ = ["BFloat16"]


class BFloat16:
    """The rule of a mixed_bfloat16 pair whose sides ran float64 and their reruns (the session hands both sides)."""

    name = "bfloat16 computation"

    def applies(self, pair: PairRuns) -> bool:
        return pair.bfloat16 is not None

    def judge(self, pair: PairRuns) -> Verdict:
        # judging.bfloat16 imports the float64 rule of this package: imported here, once both are loaded
        from parity_tests.judging.bfloat16 import judge_bfloat16

        return judge_bfloat16(*pair.bfloat16, known_differences=pair.known, loss=(pair.perturbation or {}).get("loss"))
