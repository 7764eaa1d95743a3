"""The bfloat16 rule (``"bfloat16 computation"``): a mixed_bfloat16 pair held against float64.

Its derivation and the sides' ``judging.bfloat16.Side`` are in ``judging.bfloat16`` (docs/mixed-precision.md).
The pair's ``perturbation["loss"]`` (``False`` where ``theory.reported_loss_differs``) is about the mixed runs'
loss only: the float64 runs' loss is judged by the float64 rule either way.
"""

from __future__ import annotations

from parity_tests.contract.case import MIXED_BFLOAT16
from parity_tests.judging.rules.context import PairRuns, Planned
from parity_tests.judging.run_kinds import (
    FLOAT64,
    GRADS64,
    ROUNDED64,
    Variant,
    as_given,
    bf16_reruns,
)
from parity_tests.judging.verdict import Verdict

__all__ = ["BFloat16"]


class BFloat16:
    """The rule of a mixed_bfloat16 pair whose sides ran float64 and their reruns (the session hands both sides)."""

    name = "bfloat16 computation"

    def needs(self, p: Planned) -> tuple[tuple[Variant, ...], tuple[Variant, ...]] | None:
        """Each side's mixed run, its float64 run and the float64 run from bfloat16-rounded inputs and weights,
        the float64 run rounding its gradients as its mixed recipe does (where it can: ``Can.grads_bf16``), its
        reruns from moved numbers and each one's float64 run: what the side declares it can run of them.

        A side without its float64 run or its reruns is judged by the perturbation rule after this one
        (``applies`` then fails): its needs (the run and the first rerun) are among these.
        """
        if p.dtype != MIXED_BFLOAT16:
            return None
        from parity_tests.judging.bfloat16 import (
            BF16_RERUNS,  # (imports this package's float64 rule)
        )

        reruns, reruns64 = bf16_reruns(BF16_RERUNS)
        return tuple((as_given(p.dtype),) + ((FLOAT64, ROUNDED64) if c.float64 else ())
                     + ((GRADS64,) if c.float64 and c.grads_bf16 else ()) + (reruns if c.rerunnable else ())
                     + (reruns64 if c.rerunnable and c.float64 else ()) for c in (p.a, p.b))

    def applies(self, pair: PairRuns) -> bool:
        return pair.bfloat16 is not None

    def judge(self, pair: PairRuns) -> Verdict:
        # judging.bfloat16 imports the float64 rule of this package: imported here, once both are loaded
        from parity_tests.judging.bfloat16 import judge_bfloat16

        return judge_bfloat16(*pair.bfloat16, known_differences=pair.known, loss=(pair.perturbation or {}).get("loss"),
                              grads=pair.grads)
