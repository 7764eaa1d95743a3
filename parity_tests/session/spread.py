"""A plugin that cannot run deterministically, judged against its own run-to-run spread: which plugin is one
(:func:`nondeterministic`, from its declaration) and the check on a pair (:func:`judge_with_spread`); the check's
derivation, its runs and its judgement are ``judging.rules.spread``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from parity_tests.judging.rules.spread import (
    RULE_SPREAD,
    SPREAD_FACTOR,
    SPREAD_RERUNS,
    spread_rows,
    within_spread,
)
from parity_tests.judging.verdict import Verdict

__all__ = ["SPREAD_RERUNS", "SPREAD_FACTOR", "RULE_SPREAD", "nondeterministic", "spread_rows", "within_spread",
           "judge_with_spread"]


def nondeterministic(impl: str) -> bool:
    """Whether ``impl`` is a plugin declared ``deterministic=False``."""
    from parity_tests.protocol.errors import CaseError
    from parity_tests.running import registry

    try:
        target = registry.resolve(impl).plugin
    except CaseError:
        return False
    return target is not None and not getattr(target, "deterministic", True)


def judge_with_spread(verdict: Verdict, pair: tuple[str, str], judged: tuple[Mapping[str, Any], Mapping[str, Any]],
                      rerun: Callable[[str, int], Mapping[str, Any]],
                      own: tuple[bool, bool] = (True, True)) -> Verdict:
    """For a pair whose side(s) are nondeterministic and whose verdict is a divergence: the verdict within the spread.

    Args:
        pair: ``(reference, impl)``; judged: their runs the verdict judged.
        rerun: ``rerun(impl, i)`` the ``i``-th more run of ``impl`` on the judged case (the judge caches them).
        own: whether each side's judged run is that implementation's own run of the case (not a mapped run of
            it, whose reruns are not made): only such a side has a spread.
    """
    sides = [o and nondeterministic(x) for x, o in zip(pair, own, strict=True)]
    if not verdict.diverged or not any(sides):
        return verdict
    spreads, named = [], []
    for name, run, nd in zip(pair, judged, sides, strict=True):
        if not nd:
            spreads.append((np.zeros(0), None))
            continue
        spreads.append(spread_rows([run, *(rerun(name, i) for i in range(SPREAD_RERUNS))]))
        named.append(name)
    zero = next(s for s in spreads if len(s[0]))
    spreads = [s if len(s[0]) else (np.zeros_like(zero[0]), None) for s in spreads]
    return within_spread(verdict, spreads[0], spreads[1], f"{' and '.join(named)} run {SPREAD_RERUNS + 1} times")
