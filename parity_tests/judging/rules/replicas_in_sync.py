"""Replicas in sync (``"replicas in sync"``): a run that found a divergence within itself is never at parity."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from parity_tests.judging.rules.context import PairRuns
from parity_tests.judging.verdict import Verdict

__all__ = ["RULE_REPLICAS", "ReplicasInSync"]

RULE_REPLICAS = "replicas in sync"


def _findings_guard(verdict: Verdict, a: Mapping[str, Any], b: Mapping[str, Any]) -> Verdict:
    """A run that found a divergence within itself (DDP replicas out of sync) is never at parity."""
    found = [*getattr(a, "findings", ()), *getattr(b, "findings", ())]
    if not found:
        return verdict
    return dataclasses.replace(verdict, status="divergence", rule=RULE_REPLICAS,
                               detail="; ".join(found) + f"; between the implementations: {verdict.detail}")



class ReplicasInSync:
    """:func:`_findings_guard`: what each side's run found of itself (DDP replicas out of sync, ``findings``)."""

    name = RULE_REPLICAS

    def judge(self, pair: PairRuns, verdict: Verdict) -> Verdict:
        return _findings_guard(verdict, pair.a.run, pair.b.run)
