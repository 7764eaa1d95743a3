"""Vacuity (``"nothing compared"``): a verdict on runs where nothing was really compared is ``inconclusive``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.judging.bounds import SCALE_FLOOR
from parity_tests.judging.localise import bound_at
from parity_tests.judging.rules.context import PairRuns
from parity_tests.judging.rules.float64_bound import judge_float64
from parity_tests.judging.rules.replicas_in_sync import RULE_REPLICAS
from parity_tests.judging.verdict import RULE_FLOAT32, RULE_FLOAT64, RULE_NONFINITE, Verdict
from parity_tests.protocol.rows import iter_rows

__all__ = ["RULE_VACUOUS", "vacuity", "Vacuity"]

RULE_VACUOUS = "nothing compared"


def _moved(traj: Mapping[str, Any], bound: float) -> bool:
    """Whether any ``param/*`` or ``state/*`` array leaves its row 0 by more than ``bound`` (relative)."""
    for key in traj:
        if not isinstance(key, str) or not key.startswith(("param/", "state/")):
            continue
        rows = iter_rows(traj[key])
        first = None
        for _, chunk in rows:
            chunk = np.asarray(chunk, np.float64)
            if first is None:
                first = chunk[0]
            scale = max(float(np.max(np.abs(first), initial=0.0)), SCALE_FLOOR)
            with np.errstate(invalid="ignore"):
                if np.nanmax(np.abs(chunk - first), initial=0.0) / scale > bound:
                    return True
    return False


def vacuity(a: Mapping[str, Any], b: Mapping[str, Any], verdict: Verdict) -> str | None:
    """Why nothing was really compared between ``a`` and ``b`` (docs/tolerance.md, "The verdict"), or ``None``.

    In order: no steps; a loss non-finite on both sides from the first step; every recorded
    gradient exactly zero at every step; no parameter or state array moving beyond the
    verdict's bound on either side (a learning rate of 0, or too small to move a float32
    number); a loss exactly constant over two or more steps on both sides (a logged constant,
    or a loss that nothing changes). A divergence found in the logged loss alone is no
    comparison of training either where nothing moves (docs/tolerance.md, "The verdict"): the first four
    apply to it too; a constant loss only to a pair that would otherwise pass.
    """
    nonfinite_error = verdict.status == "error" and verdict.rule == RULE_NONFINITE
    if verdict.status not in ("parity", "unexpected_parity", "divergence") and not nonfinite_error:
        return None
    if verdict.status == "divergence" and verdict.rule in (RULE_NONFINITE, RULE_REPLICAS):
        return None
    la, lb = (np.asarray(t.get("loss", np.zeros(0)), np.float64) for t in (a, b))
    if la.size == 0 or lb.size == 0:
        return "no steps were run"
    if not np.isfinite(la[0]) and not np.isfinite(lb[0]):
        return "the loss is not finite from the first step on both sides"
    if nonfinite_error:
        return None
    grads = [t[k] for t in (a, b) for k in t if isinstance(k, str) and k.startswith("grad/")]
    if grads and all(not np.any(np.asarray(chunk)) for g in grads for _, chunk in iter_rows(g)):
        return "every recorded gradient is exactly zero at every step"
    bound = max(bound_at(verdict, 0), 0.0) if np.isfinite(verdict.bound) else 0.0
    if not _moved(a, bound) and not _moved(b, bound):
        return (f"no parameter moves on either side (every step leaves every parameter within {bound:.2g} of its"
                " initial value, relative): a learning rate of 0, or updates too small for the dtype")
    if verdict.status != "divergence" and la.size >= 2 and np.all(la == la[0]) and np.all(lb == lb[0]):
        return f"the loss is the same number ({la[0]:.6g}) at every step on both sides"
    return None



class Vacuity:
    """:func:`vacuity`: the verdict made ``inconclusive``, saying why, where nothing was compared.

    A float32 case at parity by the float32 noise floor whose float32 runs move nothing beyond that floor may
    still have float64 runs that move beyond the float64 bound and agree within it (lr 1e-7: a float64 parameter
    moves by 2.5e-7 of its size, a float32 one by less than its noise). The pair stays ``inconclusive`` (its
    float32 runs compared nothing), and the verdict keeps the float64 runs' own verdict (``float64_runs``: the
    float64 rule on them, set only where they moved): what a stand-in's equivalence is shown by
    (``session.mapping.stand_in_leg``), since a mapping changes what the float64 runs compute.
    """

    name = RULE_VACUOUS

    def judge(self, pair: PairRuns, verdict: Verdict) -> Verdict:
        why = vacuity(pair.a.run, pair.b.run, verdict)
        if why is None:
            return verdict
        out = dataclasses.replace(verdict, status="inconclusive", rule=RULE_VACUOUS,
                                  detail=f"inconclusive: {why}; {verdict.detail}")
        a64, b64 = pair.a.f64, pair.b.f64
        if verdict.status == "parity" and verdict.rule == RULE_FLOAT32 and a64 is not None and b64 is not None:
            v64 = judge_float64(a64, b64, grads=pair.grads, zero=pair.zero)
            if v64.status == "parity" and v64.rule == RULE_FLOAT64 and vacuity(a64, b64, v64) is None:
                out = dataclasses.replace(out, float64_runs=v64)
        return out
