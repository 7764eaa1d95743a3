"""Which run is which: a typed key per run a comparison makes (:class:`RunKey`: implementation, variant, mapping).

The variants (which computation of the case a run makes) are the judge's (``judging.run_kinds``: the rules
declare the runs they need by them); this module adds the implementation and the mapping.

Inside the session every run is named by a :class:`RunKey`; its legacy text
(``"tf.towers@float32+perturbed+mapped:1a2b3c4d"``), the key of
``CaseResult.trajectories`` that reports, saved files and tests read, is made by
:attr:`RunKey.text` alone, where a run is stored for output or shown as progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parity_tests.judging.run_kinds import (
    AGAIN64,
    FLOAT64,
    GRADS64,
    KINDS,
    MOVED64,
    MOVED64_AGAIN,
    PERTURBED_RUN,
    ROUNDED64,
    RULE64,
    STEP1,
    Variant,
    as_given,
    bf16_reruns,
    capture,
    repeat,
)

__all__ = ["Variant", "RunKey", "FLOAT64", "PERTURBED_RUN", "STEP1", "ROUNDED64", "GRADS64", "RULE64", "BF16_RERUNS_RUN",
           "BF16_RERUNS64_RUN", "bf16_reruns", "as_given", "repeat", "MOVED64", "MOVED64_AGAIN", "AGAIN64", "capture", "KINDS",
           "capture_run"]


def _bf16() -> tuple[tuple[Variant, ...], tuple[Variant, ...]]:
    from parity_tests.judging.bfloat16 import BF16_RERUNS

    return bf16_reruns(BF16_RERUNS)


#: a mixed_bfloat16 case's perturbed reruns (judging.bfloat16: ``BF16_RERUNS`` of them), and each one's float64 run
BF16_RERUNS_RUN, BF16_RERUNS64_RUN = _bf16()


@dataclass(frozen=True)
class RunKey:
    """One run: ``impl`` in ``variant``, made with the mapping whose key suffix is ``mapping`` (``""``: none).

    ``mapping`` is ``SideMapping.key`` or ``ExactScale.key``: one per mapping, since pairs may map
    the same side differently.
    """

    impl: str
    variant: Variant
    mapping: str = ""

    @property
    def text(self) -> str:
        """The legacy trajectory key, ``impl@variant[mapping]``: the one place it is made."""
        return f"{self.impl}@{self.variant.text}{self.mapping}"

    def __str__(self) -> str:
        return self.text


def capture_run(impl: str, step: int, case: Any) -> RunKey:
    """The key of ``impl``'s run recording step ``step``'s per-device values of ``case`` (a ``contract.case.Case``).

    A capture's identity is the case it captures (its dtype, optimizer, parallel section and loss
    semantics, and the case's class: a program rerun with Keras' loss scale exact,
    ``loss_scale.ExactScaleCase``, has its plain run's spec and is another computation), not a
    mapping's key: ``lockstep``'s cases are its own start states, and a pair's float64 run that
    captured its step 1 in place (``EngineSpec.captures_in_place``) is found by it.
    """
    spec, kind = case.spec, type(case).__name__
    return RunKey(impl, capture(step), f"{impl}|{kind}|{spec['dtype']}"
                                       f"|{sorted((k, str(v)) for k, v in spec['optimizer'].items())}"
                                       f"|{sorted((k, str(v)) for k, v in spec['parallel'].items())}"
                                       f"|{spec['model'].get('loss_semantics')}")
