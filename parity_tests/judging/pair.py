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
    judge_float64,
    vacuity,
)
from parity_tests.judging.theory import Difference, Prediction
from parity_tests.judging.verdict import RULE_FLOAT64, Verdict
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
    if bfloat16 is not None:  # the float64 runs the mixed pair was held against, with their loss (resolve reads it)
        v = dataclasses.replace(v, float64_runs=float64_runs(pair))
    return v


def float64_runs(pair: PairRuns) -> Verdict:
    """The float64 rule on the two float64 runs a mixed pair is held against (``pair.bfloat16``), the loss judged.

    The bfloat16 rule judges those runs' parameters, state and loss against the float64 bound (their loss also
    where the two frameworks' *mixed* losses are different quantities and go unjudged,
    ``theory.reported_loss_differs``: a bfloat16 rounding of the logits, which the float64 runs do not have).
    Here the float64 loss is judged as in a float64 case (``FLOAT64_RTOL`` at step 1, where both start from
    the same parameters; the parameters' gap carried after it): what :func:`resolve` reads to tell whether a
    difference theory says changes step 1's logged loss in exact arithmetic is there (``Verdict.float64_runs``).
    """
    a, b = pair.bfloat16
    return judge_float64(a.float64, b.float64, loss=True, grads=pair.grads, zero=pair.zero)


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


def _own_loss_judged(v: Verdict) -> bool:
    """Whether the verdict's own loss channel judged the logged loss (at some step)."""
    return v.per_step_loss_bound is not None and bool(np.isfinite(v.per_step_loss_bound).any())


def _float64_loss_judged(v: Verdict) -> bool:
    """Whether the float64 runs the rule held the pair against (``Verdict.float64_runs``: the bfloat16 rule) agree,
    their loss judged at every step.

    The float64 runs compute each side's program with every op in float64: a difference of the formulas (how the
    shards are weighted, what the loss divides by) is in them at its full size, and their loss bound is
    ``FLOAT64_RTOL`` (1e-10) at step 1 (both start from the same parameters), where the mixed pair's own loss may
    not be judged at all (``theory.reported_loss_differs``).
    """
    f = v.float64_runs
    return (f is not None and f.status == "parity" and f.per_step_loss_bound is not None
            and bool(np.isfinite(f.per_step_loss_bound).all()))


def _must_show(v: Verdict, expected: list[Difference]) -> list[Difference]:
    """Those of ``expected`` (theory's expected differences) a pair at parity cannot lack: its ``unexpected_parity``
    (none: the parity stands).

    A certain difference changes what is logged at step 1 in exact arithmetic (``Difference.certain``): the loss,
    or for the moving statistics the state. Its absence is a finding where that channel was judged
    (:func:`_own_loss_judged`, :func:`_float64_loss_judged`; the state always is) and nothing else predicted can
    cancel it there: every expected difference certain too, or every other one first visible after the loss
    (``first_visible``: a clipping threshold that may not be reached, an optimizer formula), which cannot touch
    step 1's loss, computed from the initial parameters before any gradient is combined, clipped or applied.
    """
    own, ran64 = _own_loss_judged(v), _float64_loss_judged(v)
    # the float64 runs hold a difference of the formulas, never one of the bfloat16 roundings (``only_in``)
    shows = [d for d in expected if d.certain and (own or (ran64 and d.only_in is None) or d.stage == "state")]
    rest = [d for d in expected if not any(d is s for s in shows)]
    if not rest:
        return shows
    in_loss = any(d.stage != "state" for d in shows)
    after = all(STAGES.index(d.first_visible) > STAGES.index("loss") for d in rest)
    return shows if in_loss and after else []


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

    A verdict of the float64 rule judged float64 runs, which compute no bfloat16: a difference of
    the bfloat16 roundings alone (``Difference.only_in``: Keras' bias gradient summed in bfloat16)
    explains none of their gap, and is set aside before the rest is applied (seed 1's 1168-1170: a
    mutant summing where the case means, 1.16 apart in float64, passed as that prediction).
    """
    unseen = [d for d in pred.differences if d.expected and d.only_in is not None and v.rule == RULE_FLOAT64]
    if not unseen:
        return _resolve(v, pred, residual, stage, mapping)
    kept = tuple(d for d in pred.differences if not any(d is u for u in unseen))
    res = _resolve(v, dataclasses.replace(pred, expected=tuple(d.text for d in kept if d.expected), differences=kept),
                   residual, stage, mapping)
    known = pred.known + pred.expected  # theory's every word stays named beside the verdict
    why = (f"not explained by {'; '.join(d.text.split(':', 1)[0] for d in unseen)}: "
           f"{'it exists' if len(unseen) == 1 else 'each exists'} only in {unseen[0].only_in} arithmetic, and the"
           " float64 runs, which compute none, part")
    out = dataclasses.replace(res.verdict, known_differences=known)
    if out.status == "divergence":  # said in its line; beside any other status, in a note
        return dataclasses.replace(res, verdict=dataclasses.replace(out, detail=f"{why}. {out.detail}"))
    return dataclasses.replace(res, verdict=out, notes=(*res.notes, why))


def _resolve(v: Verdict, pred: Prediction, residual: Verdict | None, stage: str | None,
             mapping: str | None) -> Resolution:
    """:func:`resolve` with the prediction that applies to ``v``'s runs."""
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
    must_show = _must_show(v, expected)
    if v.status == "parity" and must_show:
        f = v.float64_runs
        where = (f" The float64 runs agree, their loss included ({f.detail.splitlines()[0]})."
                 if f is not None and f.status == "parity" else "")
        names = "; ".join(d.text.split(":", 1)[0] for d in must_show)
        return Resolution(dataclasses.replace(v, status="unexpected_parity", detail=(
            f"a difference was predicted ({names}) but none was found.{where} {v.detail}")), residual)
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
    # a known difference of the pair acting at an earlier stage may show there first (the where-line's
    # ``judge_pair._against_theory`` says so too: GPT-2's float64 GELU constants in the forward pass; torch's
    # clip_grad_norm_ + 1e-6 at the clip, before Adam's epsilon placement at the update)
    known = _known_at(pred, stage)
    if stage == "record" or (stage is not None and earliest is not None and stage in STAGES and known is None
                             and STAGES.index(stage) < STAGES.index(earliest)):
        where = ("only the logged loss differs while the computation agrees" if stage == "record"
                 else f"it appeared first at {stage}")
        return Resolution(dataclasses.replace(v, status="divergence", unjudged=unjudged, detail=(
            f"not the predicted difference: theory predicted {_named(pred)} first at {earliest}, but {where}. "
            f"{v.detail}")))
    acts = (f", where the known difference '{known}' acts" if known is not None and earliest is not None
            and stage in STAGES and STAGES.index(stage) < STAGES.index(earliest) else "")
    return Resolution(dataclasses.replace(v, status="expected_difference", unjudged=unjudged, detail=(
        f"as predicted ({_named(pred)}), a difference was found"
        + (f", first at {stage}{acts}" if stage else "") + f". {v.detail}")), explained=True)


def _known_at(pred: Prediction, stage: str | None) -> str | None:
    """The name of a known (not expected) difference of ``pred`` that acts at ``stage`` (its stage, or the earliest
    its recorded channels may show it), or ``None``."""
    if stage is None:
        return None
    return next((d.text.split(":")[0] for d in pred.differences
                 if not d.expected and stage in (d.stage, d.first_visible)), None)

