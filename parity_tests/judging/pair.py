"""One pair's verdict with every guard, and what theory's prediction makes of it.

The free comparison (``session.comparison.compare_case``) and lockstep (``session.lockstep``) both judge
a pair through :func:`judge_sides` (a rule, then every guard) and settle theory's prediction
through :func:`resolve`, so neither can pass what the other fails.

:func:`judge_sides` applies, in order:

1. the rule the pair is judged by (``rules``/``perturbation``: float64 bound, float32 noise floor or
   perturbation floor), with no expectation attached;
2. the non-finite guard: a NaN or Inf anywhere (loss and gradients included) is never
   parity: one side is a divergence, both alike is no verdict (``error``);
3. the findings guard: a run that found a divergence within itself (DDP replicas out of
   sync) makes every pair it is in a divergence;
4. the vacuity guard (:func:`vacuity`): a pair in which nothing was really compared is
   ``inconclusive`` (docs/tolerance.md, "The verdict"), never parity.

:func:`resolve` then applies the prediction (``theory.predict``): a divergence is an
``expected_difference`` only where a predicted difference explains the whole gap. Where a
side the tool controls can be mapped onto the other (``theory.mapping_changes``), the pair
is judged again with the difference mapped away (the *residual*): it must be parity. Where
nothing can be mapped, the first stage at which the two runs part must not come before the
earliest stage theory predicts, nor be the logged loss alone (``record``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity_tests.judging.localise import STAGES
from parity_tests.judging.rules import (
    CHECKS,
    RULE_REPLICAS,
    RULE_VACUOUS,
    RULES,
    PairRuns,
    Side,
    vacuity,
)
from parity_tests.judging.theory import Prediction
from parity_tests.judging.verdict import Verdict
from parity_tests.judging.zero_gradient import ZeroGradients

__all__ = ["Side", "judge_sides", "vacuity", "resolve", "Resolution", "RULE_REPLICAS", "RULE_VACUOUS",
           "with_findings", "OK_STATUSES"]

#: ``tfpar compare`` exits 0 when every pair has one of these (docs/tolerance.md, "The verdict")
OK_STATUSES = ("parity", "expected_difference")


def with_findings(src: Mapping[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """``out`` carrying ``src``'s ``findings`` and ``meta`` (a copy of a trajectory must not drop what the run
    found, nor what it read of itself: ``precision_leak`` asks a float64 run's ``meta`` for float32 constants)."""
    from parity_tests.protocol.trajectory import Trajectory

    found = list(getattr(src, "findings", ()))
    meta = dict(getattr(src, "meta", None) or {})
    if not found and not meta:
        return out
    t = Trajectory(out)
    t.findings.extend(found)
    t.meta.update(meta)
    return t


def judge_sides(dtype: str, a: Side, b: Side, *, rule: str, known: Iterable[str] = (),
                grads: Iterable[Mapping[str, Any]] = (), perturbation: Mapping[str, Any] | None = None,
                bfloat16: tuple[Any, Any] | None = None, zero: ZeroGradients | None = None) -> Verdict:
    """The verdict on ``b`` against ``a`` by ``rule``, with every guard (module docstring); no expectation.

    Args:
        dtype: the case dtype.
        a, b: the reference's and the judged implementation's runs.
        rule: ``float64`` (float64 cases, and float32 cases whose sides both run float64) or
            ``perturbation`` (a side that runs only float32, and mixed_bfloat16).
        known: documented differences to name in the verdict.
        grads: other runs of the case whose gradients may bound the loss's sensitivity
            (``loss_channel.loss_sensitivity``).
        perturbation: keyword arguments of ``perturbation.judge_perturbation`` (``rule``, ``perturbed``, ``loss``).
        bfloat16: for a mixed_bfloat16 pair whose sides ran float64 and their reruns, the two
            ``judging.bfloat16.Side``: judged by ``judge_bfloat16`` (``perturbation``'s ``loss`` applies).
        zero: the case's parameters whose exact gradient is zero (``zero_gradient.zero_gradients``), judged
            against their rounding drift by the float64 rule.
    """
    known = tuple(known)
    if any(np.size(s.run.get("loss", ())) == 0 for s in (a, b)):
        nan = float("nan")
        return Verdict("inconclusive", RULE_VACUOUS, nan, nan, None, None, np.zeros(0), None,
                       "inconclusive: no steps were run", known)
    pair = PairRuns(dtype, a, b, rule, known, tuple(grads), perturbation, bfloat16, zero)
    v = next(r for r in RULES if r.applies(pair)).judge(pair)  # the first rule that applies (judging.rules)
    for check in CHECKS:
        v = check.judge(pair, v)
    return v


@dataclass(frozen=True)
class Resolution:
    """What :func:`resolve` made of a pair: the final verdict and what the report says beside it."""

    verdict: Verdict
    residual: Verdict | None = None  #: the pair judged with the predicted differences mapped away
    notes: tuple[str, ...] = ()  #: lines for the report (why a prediction was dropped, ...)
    explained: bool = False  #: a divergence fully explained by theory (the residual is parity)
    #: the residual decided ``verdict``: its figures judge the mapped runs, except under ``unexpected_parity``,
    #: where they are the pair's own as it ran (the residual's are in the detail)
    from_residual: bool = False


def _earliest(pred: Prediction) -> str | None:
    stages = [d.first_visible for d in pred.differences if d.expected]
    return min(stages, key=STAGES.index) if stages else None


def _named(pred: Prediction) -> str:
    return "; ".join(d.text.split(":", 1)[0] for d in pred.differences if d.expected)


def _figures(v: Verdict) -> str:
    if v.status == "parity":
        return f"parity, gap {v.gap:.3g} <= {v.bound:.3g}"
    first = v.detail.splitlines()[0] if v.detail else ""
    return f"{v.status} ({v.rule}), gap {v.gap:.3g} against {v.bound:.3g}: {first}"


def resolve(v: Verdict, pred: Prediction, *, residual: Verdict | None = None, stage: str | None = None,
            mapping: str | None = None) -> Resolution:
    """Apply theory's prediction to the pair's verdict ``v`` (judged with nothing mapped).

    Args:
        v: :func:`judge_sides`'s verdict on the pair as it ran.
        pred: ``theory.predict`` for the pair at the case's values.
        residual: :func:`judge_sides`'s verdict with every expected difference (and every
            known one that has a mapping) mapped away on a side the tool controls, or
            ``None`` where no such side can take them all.
        stage: the first stage where the runs part (``localise``), when ``v`` is not parity.
        mapping: what was mapped, one line (for the detail).
    Returns:
        the final verdict: ``expected_difference`` where the prediction explains the whole gap
        (the residual is parity, or, without a residual, the runs part no earlier than theory
        says); ``divergence`` naming both where it does not; ``unexpected_parity`` where a
        predicted difference that must show did not; ``parity`` where the prediction is below
        the bound at these values.
    """
    known = pred.known + pred.expected
    v = dataclasses.replace(v, known_differences=known)
    expected = [d for d in pred.differences if d.expected]
    if v.status in ("error", "inconclusive"):
        return Resolution(v, residual)
    if v.status == "divergence" and v.rule == RULE_REPLICAS:
        # the replicas of one job differ from each other: no difference between two frameworks (theory's
        # subject) makes one program disagree with itself, so nothing predicted can explain it, whatever
        # the residual says (a mapped run is another program's)
        return Resolution(v, residual, notes=(
            f"not explained by theory: one job's replicas differ, which no predicted difference ({_named(pred)})"
            " between the frameworks makes",) if expected or pred.known else ())
    mapped = f" ({mapping})" if mapping else ""
    # a certain difference shows in the logged loss (or, for the moving statistics, the state): only
    # where the verdict judged the loss is its absence a finding, with or without a mapping
    loss_judged = v.per_step_loss_bound is not None and bool(np.isfinite(v.per_step_loss_bound).any())
    must_show = bool(expected) and all(d.certain and (loss_judged or d.stage == "state") for d in expected)
    if v.status == "parity" and must_show:
        return Resolution(dataclasses.replace(v, status="unexpected_parity", detail=(
            f"a difference was predicted ({_named(pred)}) but none was found. {v.detail}")), residual)
    if residual is not None:
        residual = dataclasses.replace(residual, known_differences=known)
        # nothing left to compare once the difference is mapped away (e.g. a learning rate of 0 where only the
        # logged loss differed): nothing is left unexplained either
        if residual.status in ("parity", "inconclusive"):
            if not expected:  # known differences only: the mapped verdict is the verdict (the unmapped gap beside it)
                return Resolution(residual, residual, explained=v.status != "parity", from_residual=True)
            if v.status == "divergence":
                return Resolution(dataclasses.replace(v, status="expected_difference", detail=(
                    f"as predicted ({_named(pred)}), a difference was found; with it mapped{mapped}: "
                    f"{_figures(residual)}. {v.detail}")), residual, explained=True)
            return Resolution(v, residual, notes=(
                f"predicted ({_named(pred)}) but below the bound at these values: the pair is at parity with and"
                f" without the mapping{mapped}",))
        if v.status == "parity" and expected:
            # the pair's own figures (its gap, bound, rule): the runs that part are the mapped ones (a
            # built-in run with the other convention, or a stand-in), whose gap is in the detail and the
            # residual, never in the pair's gap column
            return Resolution(dataclasses.replace(v, status="unexpected_parity", detail=(
                f"a difference was predicted ({_named(pred)}) but none was found (gap {v.gap:.3g} <= {v.bound:.3g}),"
                f" and with it mapped{mapped} the pair parts: {_figures(residual)}")), residual, from_residual=True)
        why = (f"theory predicted {_named(pred)}" if expected else f"theory names {'; '.join(pred.known)}")
        return Resolution(dataclasses.replace(residual, status="divergence" if residual.status != "error" else "error",
                                              detail=f"{why}, but with it mapped{mapped} the pair still parts: "
                                                     f"{residual.detail}"), residual, from_residual=True)
    if not expected:
        if v.status == "divergence" and pred.known:
            first, _, rest = v.detail.partition("\n")
            v = dataclasses.replace(v, detail=first + f" (known differences attached: {'; '.join(pred.known)})"
                                    + (("\n" + rest) if rest else ""))
        return Resolution(v)
    earliest = _earliest(pred)
    if v.status == "parity":
        return Resolution(v, notes=(
            f"predicted ({_named(pred)}) where the values make it large enough; at these values it stays within the"
            " bound (no side the tool controls could map it to measure it)",))
    # a divergence, nothing mapped: the stage is the only check that it is the predicted one
    unjudged = (*v.unjudged, "whether the predicted difference explains the whole gap (no side the tool controls"
                             " can map it away)")
    if stage == "record" or (stage is not None and earliest is not None and stage in STAGES
                             and STAGES.index(stage) < STAGES.index(earliest)):
        where = ("only the logged loss differs while the computation agrees" if stage == "record"
                 else f"it appeared first at {stage}")
        return Resolution(dataclasses.replace(v, status="divergence", unjudged=unjudged, detail=(
            f"not the predicted difference: theory predicted {_named(pred)} first at {earliest}, but {where}. "
            f"{v.detail}")))
    return Resolution(dataclasses.replace(v, status="expected_difference", unjudged=unjudged, detail=(
        f"as predicted ({_named(pred)}), a difference was found"
        + (f", first at {stage}" if stage else "") + f". {v.detail}")), explained=True)

