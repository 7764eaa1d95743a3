"""One pair judged from the runs the session made: its rule, every guard, the mapping's residual, where it parts.

Every run a pair's verdict reads is made by the session's executor (``session.executor``): the runs
every pair needs are planned and made before any pair is judged (``session.plan``: their union, each
once, float64 first). A check whose runs depend on a verdict declares them (``executor.Need``, each
with a ``keys.RunKey`` of its own) only after the verdict that triggers them, and the executor makes
the ones not made yet: the conditioning check's float64 reruns from inputs moved by one ulp and its
repeats (:meth:`_Judged.conditioned`, asked after a float64 divergence), a nondeterministic plugin's
spread reruns (:func:`_within_spread`, after a divergence), the per-device capture runs of a
localisation (``capture.inside_step``, after a break inside a step). Asking after the verdict is
what makes them conditional: a pair at parity makes none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests.contract.case import MIXED_BFLOAT16, Case
from parity_tests.judging.bfloat16 import Side as BF16Side
from parity_tests.judging.factor import attach as attach_factor
from parity_tests.judging.localise import localise, refinable, with_layer
from parity_tests.judging.loss_only import attach as attach_loss_only
from parity_tests.judging.pair import Side, judge_sides
from parity_tests.judging.perturbation import perturb_ulp
from parity_tests.judging.precision_leak import leak_text, not_float64
from parity_tests.judging.predicted_scale import SUM_REDUCTION
from parity_tests.judging.rules import Can, Planned
from parity_tests.judging.rules import needs as rule_needs
from parity_tests.judging.rules.bfloat16_signature import BFloat16Signature, SignatureSide
from parity_tests.judging.rules.conditioning import CONDITIONING_ROUNDINGS, Conditioning
from parity_tests.judging.rules.spread import Spread
from parity_tests.judging.theory import (
    Prediction,
    engine,
    keras_bias_add_layers,
    reported_loss_differs,
    stage_of,
)
from parity_tests.judging.verdict import (
    RULE_BF16_PERTURBATION,
    RULE_FLOAT64,
    Verdict,
)
from parity_tests.judging.zero_gradient import zero_gradients
from parity_tests.running import registry
from parity_tests.running.backends import RunError
from parity_tests.session.capture import inside_step
from parity_tests.session.declared import declared as _declared
from parity_tests.session.executor import Need, Runs
from parity_tests.session.keys import (
    AGAIN64,
    BF16_RERUNS64_RUN,
    BF16_RERUNS_RUN,
    FLOAT64,
    GRADS64,
    MOVED64_AGAIN,
    PERTURBED_RUN,
    ROUNDED64,
    STEP1,
    RunKey,
    Variant,
    as_given,
)
from parity_tests.session.loss_scale import ExactScale
from parity_tests.session.mapping import (
    NOT_EQUIVALENT,
    SideMapping,
    changed_fields,
    reads_mapping,
    residual_unjudged,
)
from parity_tests.session.partial_mapping import partial_mapping, partial_verdict
from parity_tests.session.residual import Resolved, resolve_pair, scale_checked
from parity_tests.session.results import UNSUPPORTED, PairResult
from parity_tests.session.scale_rerun import ratio_rerun, ratio_verdict
from parity_tests.session.variants import (
    _perturbed_text,
    _reorderable,
    _reorders,
    _resummed,
)

__all__ = ["CONDITIONING_ROUNDINGS"]

#: the session's checks with runs of their own (``judging.rules``: each declares them, the executor makes them)
CONDITIONING, SPREAD, SIGNATURE = Conditioning(), Spread(), BFloat16Signature()


def _loss_reported(verdict: Verdict, a: dict[str, np.ndarray], b: dict[str, np.ndarray], float64: bool) -> Verdict:
    """A mixed pair whose mixed losses are different quantities (``theory.reported_loss_differs``): say so, with the
    gap (over the steps where both are finite). ``float64``: the bfloat16 rule held the pair against its float64
    runs, which round no logit, and judged their loss (``judging.bfloat16.judge_bfloat16``)."""
    la, lb = np.asarray(a["loss"], np.float64), np.asarray(b["loss"], np.float64)
    with np.errstate(invalid="ignore"):
        rel = np.abs(la - lb) / np.maximum(np.maximum(np.abs(la), np.abs(lb)), 1e-2)
    finite = rel[np.isfinite(rel)]
    gap = f"{float(np.max(finite)):.2e}" if finite.size else "none finite" if rel.size else "0.00e+00"
    first, _, rest = verdict.detail.partition("\n")
    note = (f"; mixed loss reported, not judged: Keras rounds the logits twice (product, then + bias), torch once"
            f" (greatest relative loss gap {gap})" + ("; the float64 runs' loss judged by the float64 rule" if float64 else ""))
    return dataclasses.replace(verdict, detail=first + note + (("\n" + rest) if rest else ""))


def _bf16_guard(verdict: Verdict, ref: str, impl: str, trajs: dict[RunKey, dict[str, np.ndarray]]) -> Verdict:
    """``judging.rules.bfloat16_signature`` on both sides of a mixed pair, from the runs its ``needs`` planned."""
    return SIGNATURE.judge(verdict, [SignatureSide(side, trajs.get(RunKey(side, as_given(MIXED_BFLOAT16))),
                                                  trajs.get(RunKey(side, STEP1)), trajs.get(RunKey(side, FLOAT64)))
                                     for side in (ref, impl)])


def _bf16_sides(trajs: dict[RunKey, dict[str, np.ndarray]], impl: str, suffix: str = "") -> bool:
    """Whether ``impl`` has the runs ``judging.bfloat16`` holds a mixed side by: its float64 run and its reruns."""
    # what the bfloat16 rule needs of a side that declares every run (``judging.rules.BFloat16.needs``)
    return all(RunKey(impl, v, suffix) in trajs for v in rule_needs(Planned(MIXED_BFLOAT16, "perturbation", Can(), Can()))[1])


def _tf_kernels(spec: dict[str, Any]) -> dict[str, Any] | None:
    """TensorFlow's kernel probe here, for theory's mixed-precision predictions (``None`` for other dtypes)."""
    if spec["dtype"] != MIXED_BFLOAT16:
        return None
    from parity_tests.running import kernels

    return kernels.probe("tf")["ops"]


def _bf16_side(case: Case, impl: str, trajs: dict[RunKey, dict[str, np.ndarray]], suffix: str = "",
               bias_add: bool = False) -> BF16Side:
    """One side of a mixed pair, with what its framework's kernels do on this CPU (``running.kernels``).

    ``bias_add``: the pair is two TensorFlow sides, which both sum Keras' ``bias_add`` gradients as
    ``BiasAddGrad`` does here; against torch that is a predicted difference (``theory.bias_add_differences``).
    """
    from parity_tests.running import kernels

    framework = registry.resolve(impl, "impls").framework
    terms = max((n for _, _, n in keras_bias_add_layers(case.spec, most=True)), default=None) if bias_add else None
    rho, why = kernels.side_factor(case.spec["model"]["layers"], framework, bias_add, terms)
    return BF16Side(impl, trajs[RunKey(impl, as_given(MIXED_BFLOAT16), suffix)], trajs[RunKey(impl, FLOAT64, suffix)],
                    [trajs[RunKey(impl, v, suffix)] for v in BF16_RERUNS_RUN],
                    [trajs[RunKey(impl, v, suffix)] for v in BF16_RERUNS64_RUN], rho, why,
                    trajs[RunKey(impl, ROUNDED64, suffix)],
                    trajs.get(RunKey(impl, GRADS64, suffix)))  # where the side makes it (judging.rules.BFloat16)



def _against_theory(where: dict[str, Any], pred: Prediction, rule: str | None = None) -> dict[str, Any]:
    """Say whether a predicted difference appeared first at the stage theory names for it.

    A *known* difference of the pair that acts at an earlier stage (GPT-2's float64 GELU constants in
    the forward pass, before Adam's epsilon placement in the update) may show there first: the runs
    then part where theory says they may, and the note names it. A verdict of the float64 rule (``rule``)
    judged runs that compute no bfloat16: a difference of the bfloat16 roundings alone
    (``Difference.only_in``) predicts no stage there, and with no other the where-line says nothing of theory.
    """
    expected = [d for d in pred.differences if d.expected and not (rule == RULE_FLOAT64 and d.only_in is not None)]
    if not expected and any(d.expected for d in pred.differences):
        return where
    stages = [d.stage for d in expected]
    stage = stages[0] if stages else stage_of(pred.expected[0])
    seen = where.get("stage")
    known = next((d.text.split(":")[0] for d in pred.differences
                  if not d.expected and seen is not None and seen in (d.stage, d.first_visible)), None)
    note = (f"; theory predicted it first at {stage}: " + (
        "it appeared there" if seen == stage else "it did not appear" if seen is None else
        f"it appeared first at {seen}, where the known difference '{known}' acts" if known else
        f"it appeared first at {seen}"))
    return {**where, "predicted_stage": stage, "as_predicted": seen == stage or known is not None,
            "explanation": where["explanation"] + note}



class _FreeLegs:
    """One pair's runs in the free compare, as ``residual.resolve_pair`` reads them: a leg is ``(name, mapping key)``."""

    def __init__(self, judged: _Judged, ref: str, impl: str) -> None:
        self.judged, self.ref, self.impl = judged, ref, impl
        self._where: dict[tuple[int, Any, Any], tuple[Verdict, dict[str, Any]]] = {}  # (verdict, a, b) -> its localisation, once

    def as_ran(self) -> Verdict:
        return self.judged.verdict(self.ref, self.impl)  # (with a nondeterministic side's run-to-run spread)

    def verdict(self, a: Any, b: Any) -> Verdict:
        return self.judged.verdict(self.ref, self.impl, a, b)

    def where(self, verdict: Verdict, a: Any, b: Any) -> dict[str, Any]:
        key = (id(verdict), a, b)
        if key not in self._where:
            self._where[key] = (verdict, self.judged.localised(verdict, a, b))  # the verdict kept: its id stays its own
        return self._where[key][1]

    def stage(self, a: Any, b: Any, verdict: Verdict, refine: bool = False) -> str | None:
        return self.where(verdict, a, b).get("stage")  # (refined by a capture wherever the compare localises so)

    def leaky(self, legs: Any) -> bool:
        return any(not_float64(self.judged.trajs.get(RunKey(n, FLOAT64, x))) for n, x in legs)


@dataclass
class _Judged:
    """What :func:`compare_case` ran, and how to judge one pair from it."""

    case: Case
    variants: dict[Variant, Case]
    rules: dict[str, str]
    runs: Runs  # the session's executor: every run a check declares is made there, once
    mapped_cases: dict[RunKey, Case]
    grads: list[dict[str, np.ndarray]]
    stages: bool
    beside: bool = False  # capture runs of a TensorFlow and a torch side at once (the default runner, room for both)
    #: (stand-in, plugin) -> the differences theory expects between them as the stand-in runs (:func:`stand_in_leg`)
    apart: dict[tuple[str, str], str] = field(default_factory=dict)
    #: per pair (its judged implementation), its mapping made on the plugin itself (``mapping.on_itself``): rerun
    #: only where the stand-in is no equivalent run (:meth:`on_itself`)
    itself: dict[str, SideMapping] = field(default_factory=dict)
    #: a plugin's name -> the built-in of its kind running the case as it runs, and what theory expects between them
    #: (``mapping.kind_run``, ``mapping.stand_in_apart``): made only where :meth:`computes_case` asks
    kind_of: Callable[[str], tuple[SideMapping, str | None] | None] | None = None

    @property
    def trajs(self) -> dict[RunKey, dict[str, np.ndarray]]:
        """The comparison's runs, by key."""
        return self.runs.trajs

    def side(self, name: str, suffix: str = "") -> Side:
        """``name``'s runs (``suffix``: a mapping's key for its mapped runs)."""
        d = self.case.spec["dtype"]
        return Side(self.trajs[RunKey(name, as_given(d), suffix)], self.trajs.get(RunKey(name, FLOAT64, suffix)),
                    self.trajs.get(RunKey(name, PERTURBED_RUN, suffix)))

    def verdict(self, ref: str, impl: str, a: tuple[str, str] | None = None, b: tuple[str, str] | None = None) -> Verdict:
        """``pair.judge_sides`` on the pair ``(ref, impl)`` by its rule, with the mixed-precision guards.

        ``a``, ``b``: ``(name, suffix)`` of the runs that stand for each side (default: the side's own
        runs as it ran), e.g. a built-in's mapped runs.
        """
        dtype = self.case.spec["dtype"]
        mixed = dtype == MIXED_BFLOAT16
        loss_differs = reported_loss_differs(self.case.spec, engine(ref), engine(impl))
        perturbation = ({"rule": RULE_BF16_PERTURBATION, "perturbed": "inputs moved by one bfloat16 ulp, weights and"
                         " hyperparameters by one float32 ulp", "loss": False if loss_differs else None} if mixed else
                        {"perturbed": _perturbed_text(self.variants[PERTURBED_RUN], (ref, impl))}
                        if PERTURBED_RUN in self.variants and self.rules[impl] == "perturbation" else None)
        sa, sb = self.side(*(a or (ref, ""))), self.side(*(b or (impl, "")))
        bf16 = None  # a mixed pair whose sides ran float64 and their reruns: held against float64 (judging.bfloat16)
        if mixed and all(_bf16_sides(self.trajs, *s) for s in (a or (ref, ""), b or (impl, ""))):
            sides = (a or (ref, ""), b or (impl, ""))
            both_tf = all(registry.resolve(n, "impls").framework == "tf" for n, _ in sides)
            bf16 = tuple(_bf16_side(self.case, n, self.trajs, x, both_tf) for n, x in sides)
        v = judge_sides(dtype, sa, sb, rule=self.rules[impl], grads=self.grads, perturbation=perturbation,
                        bfloat16=bf16, zero=zero_gradients(self.case.spec))
        # a plugin declared deterministic=False, on a leg of its own runs (as it ran, or against a built-in's mapped
        # runs: a residual is judged against the plugin's run-to-run spread as the pair is): against that spread
        v = _within_spread(v, a or (ref, ""), b or (impl, ""), self.variants, dtype, self.runs)
        if loss_differs:
            v = _loss_reported(v, sa.run, sb.run, bf16 is not None)
        if mixed:
            v = _bf16_guard(v, ref, impl, self.trajs)
        return v

    def legs(self, ref: str, impl: str) -> _FreeLegs:
        """The pair's runs as ``residual.resolve_pair`` reads them (a leg: ``(implementation, mapping key)``)."""
        return _FreeLegs(self, ref, impl)

    def localised(self, verdict: Verdict, a: tuple[str, str], b: tuple[str, str]) -> dict[str, Any]:
        """The localisation (docs/localisation.md) of ``verdict`` from the arrays its rule judged (refined by a capture)."""
        # float64 when the float64 rule decided (also in a float32 case, where 1e-10 would call
        # float32 rounding a difference), mapped as judged
        d = FLOAT64 if verdict.rule == RULE_FLOAT64 and RunKey(a[0], FLOAT64, a[1]) in self.trajs \
            else as_given(self.case.spec["dtype"])
        runs = [self.trajs[RunKey(n, d, suffix)] for n, suffix in (a, b)]
        where = localise(runs[0], runs[1], verdict)
        if self.stages and refinable(where, runs[0], runs[1]):
            cases = [self.mapped_cases[RunKey(n, d, suffix)] if suffix else self.variants[d] for n, suffix in (a, b)]
            where = inside_step(where, verdict, ((a[0], cases[0]), (b[0], cases[1])), self.runs,
                                beside=self.beside, stop=True)
        if "factor" not in where:  # issue 37: a constant scale at the first bad stage (judging.factor)
            where = attach_factor(where, runs[0], runs[1], self.case.spec)
        # issue 37: would the logged loss alone (rtol 1e-3) have shown it, in the case dtype as a user logs it
        d0 = as_given(self.case.spec["dtype"])
        logged = [self.trajs.get(RunKey(n, d0, s), r) for (n, s), r in zip((a, b), runs, strict=True)]
        where = attach_loss_only(where, logged[0], logged[1], self.case.spec)
        return dict(with_layer(where, self.case.spec))  # the layer (path and type) its name belongs to

    def pair(self, ref: str, impl: str, pred: Prediction, m: SideMapping | None,
             exact: tuple[ExactScale, ...] = ()) -> PairResult:
        """The pair judged as it ran and, with ``m`` (and ``exact``: programs rerun with Keras' distribution loss
        scale exact), with the predicted differences mapped away (``pair.resolve``)."""
        as_ran = ((ref, ""), (impl, ""))
        mapped_any = m is not None or bool(exact)
        keys = {e.side: e.key for e in exact}
        legs = self.legs(ref, impl)
        r = resolve_pair(  # as --lockstep resolves each step (session.residual)
            legs, *as_ran, pred, impl_is_b=m is None or m.side == impl, mapping=m,
            mapped=(m.runs_as, m.key) if m is not None else None,
            stand=(m.runs_as, m.plain.key if m.plain else "") if m is not None and m.stand_in else None,
            exact_a=(ref, keys[ref]) if ref in keys else None, exact_b=(impl, keys[impl]) if impl in keys else None,
            exact_text="; ".join(e.text for e in exact) or None, apart=self.apart.get((m.runs_as, m.side)) if m else None)
        itself: tuple[str, ...] = ()
        if r.not_judged is not None and not exact and impl in self.itself:
            # the stand-in computes another program: the plugin itself, rerun with the mapped values of its case
            through, r = r.not_judged, self.on_itself(legs, ref, impl, pred, self.itself[impl], r)
            if r.not_judged is None:  # judged on the plugin's rerun: why not through its stand-in, for the report
                itself = (f"mapped on the plugin itself, as {through.removeprefix(NOT_EQUIVALENT + ': ')}",)
        runs64 = [self.trajs.get(RunKey(name, FLOAT64)) for name in (ref, impl)]
        v, res, final, residual, not_judged, judged, text = (r.as_ran, r.resolution, r.final, r.residual, r.not_judged,
                                                             r.judged, r.text)
        decided = r.decided if residual is not None else as_ran
        where = legs.where(*r.staged) if r.staged[0].status not in ("parity", "inconclusive") else None
        final, scale = scale_checked(r, self.case.spec, engine(ref), engine(impl), *runs64, exact=bool(exact))
        if final.status == "expected_difference" and residual is None and not exact and scale is None:
            # the sum reduction's ratio, not exact on this case, checked on the parallel plugin rerun where it is
            final, scale, line = self.ratio_on_rerun(r, ref, impl, final)
            itself += (line,) if line else ()
        if (final.status == "expected_difference" and residual is None and not exact and scale is None
                and r.not_judged is not None and m is not None and m.stand_in and not self.apart.get((m.runs_as, m.side))):
            # still no equivalent run, and no ratio theory predicts found broken (those checks say more: both factors):
            # where the other side computes the case as given, the stand-in's leg decides (mapping.stand_in_leg)
            decides = self.case_computed(legs, ref, impl, pred, m, r)
            if decides is not r:
                r = decides
                v, res, final, residual, not_judged, judged, text = (r.as_ran, r.resolution, r.final, r.residual,
                                                                     r.not_judged, r.judged, r.text)
                decided = r.decided if residual is not None else as_ran
        if final.status == "expected_difference" and residual is None and not exact and scale is None:
            # differences no one side takes: those of the parallel set-up on the plugin itself, the rest by its stage
            final, line, partial_where = self.partial_on_itself(legs, r, ref, impl, final)
            itself += (line,) if line else ()
            where = partial_where or where
        if final.status in ("parity", "inconclusive"):
            where = None
        elif residual is not None and res.from_residual and residual.status != "parity":
            where = self.localised(residual, *decided)  # where what the mapping does not explain parts
        elif where is None:
            where = self.localised(v, *as_ran)
        if where is not None and judged.expected:
            where = _against_theory(where, judged, final.rule)
        if where is not None and scale is not None:  # theory's constant against the one measured at step 1
            where = {**where, "predicted_scale": scale, "explanation": f"{where['explanation']}; {scale['text']}"}
        notes = res.notes + itself
        if CONDITIONING.applies(final):
            final, note = self.conditioned(final, decided if res.from_residual else as_ran)
            notes += (note,) if note else ()
            where = None if final.status == "inconclusive" else where
        leaks = tuple(leak_text(name, t) for name in (ref, impl) if not_float64(t := self.trajs.get(RunKey(name, FLOAT64))))
        if leaks and final.key == "loss" and final.status not in ("parity", "inconclusive"):
            first, _, rest = final.detail.partition("\n")
            final = dataclasses.replace(final, detail=first + "; " + "; ".join(leaks) + (("\n" + rest) if rest else ""))
        return PairResult(ref, impl, final, pred, text, v.gap if mapped_any else None, where, residual,
                          notes + leaks, decided if res.from_residual else None, not_judged)

    def on_itself(self, legs: _FreeLegs, ref: str, impl: str, pred: Prediction, m: SideMapping,
                  through: Resolved) -> Resolved:
        """The pair resolved with its mapping made on the plugin ``m.side`` itself (``mapping.on_itself``), where the
        stand-in of ``through`` (the pair resolved through it) is no equivalent run; ``through`` itself, its reason
        extended, where the plugin's rerun cannot be made or does not read the mapped values (``mapping.reads_mapping``).

        Its runs are made here, after the stand-in's leg that asks for them (the runs the pair's rule needs of a
        mapped side, as a built-in's mapped runs): a pair whose stand-in is equivalent makes none.
        """
        from parity_tests.session.executor import Executor
        from parity_tests.session.plan import mapped_runs

        def unjudged(why: str) -> Resolved:  # still no residual: its line and report.json say why, the rerun's too
            said = f"{through.not_judged}; nor {m.text}{why}"
            return dataclasses.replace(through, not_judged=said, final=residual_unjudged(through.resolution.verdict, said))

        if not isinstance(self.runs, Executor):
            return through
        made = self.rerun_itself(m, mapped_runs(m, self.case.spec["dtype"], self.rules[impl]))
        if made is None:
            return unjudged(f" ({self.runs.unmappable.get(m.ident, 'its runs were not made')})")
        run64, mapped64, fields = made
        if not reads_mapping(run64, mapped64, fields):
            return unjudged(": it did not read " + ", ".join(fields) + " from its case"
                            if getattr(mapped64, "meta", {}).get("case_read") is not None else
                            ": its float64 run is its run without it, by the float64 rule: it does not read the mapped"
                            " value")
        return resolve_pair(legs, (ref, ""), (impl, ""), pred, impl_is_b=m.side == impl, mapping=m,
                            mapped=(m.side, m.key))

    def rerun_itself(self, m: SideMapping, runs: list[Any]) -> tuple[Any, Any, list[str]] | None:
        """Make ``runs``, the plugin ``m.side`` rerun with ``m``'s mapped values of its case (each run once), and return
        its float64 run as given, the rerun's float64 run and the case fields the mapping changed (what
        ``mapping.reads_mapping`` asks); ``None`` where they were not made (``self.runs.unmappable``). A failing run
        raises as the executor does: :meth:`on_itself`, :meth:`ratio_on_rerun` and :meth:`partial_on_itself` differ
        only in what they do then and with the runs."""
        self.runs.run(runs)
        run64, mapped64 = (self.trajs.get(RunKey(m.side, FLOAT64, x)) for x in ("", m.key))
        if m.ident in self.runs.unmappable or run64 is None or mapped64 is None:
            return None
        return run64, mapped64, changed_fields(self.case.spec, m.changes)

    def case_computed(self, legs: _FreeLegs, ref: str, impl: str, pred: Prediction, m: SideMapping,
                      through: Resolved) -> Resolved:
        """The pair resolved with its stand-in's leg deciding (``mapping.stand_in_leg``'s ``computes``), where the
        stand-in is no equivalent run (``through``, the pair resolved without it) because the plugin ``m.side`` parts
        from it before the update, and the other side computes the case as given (:meth:`computes_case`); else
        ``through``. The other side's runs are made only here, after the stand-in's leg parted (a divergence)."""
        stand = (m.runs_as, m.plain.key if m.plain else "")
        own = (m.side, "")
        plain = legs.verdict(stand, own)  # as resolve_pair judges the stand-in's leg
        if plain.status != "divergence" or legs.leaky((stand, own)):
            return through
        why = self.computes_case(ref, impl, m.other)
        if why is None:
            return through
        # (no exact reruns: a pair whose loss scale is mapped keeps its own path, judge_pair.pair)
        again = resolve_pair(legs, (ref, ""), (impl, ""), pred, impl_is_b=m.side == impl, mapping=m,
                             mapped=(m.runs_as, m.key), stand=stand, computes=why)
        return again if again.not_judged is None else through

    def computes_case(self, ref: str, impl: str, other: str) -> str | None:
        """Why ``other`` computes the case as given, or ``None`` where that is not shown.

        A built-in does by construction. A plugin does where its runs are at parity, by the pair's rule,
        with the built-in of its kind running the case as the plugin runs it (``mapping.kind_run``: its own
        Keras roundings), theory predicting nothing between the two (``mapping.stand_in_apart``); that
        built-in's runs are made here, once. Not for a plugin no built-in runs (an external model).
        """
        from parity_tests.session.executor import Executor
        from parity_tests.session.plan import mapped_runs

        found = _declared(other)
        if found is None:
            return None
        if found.kind == "builtin":
            return f"{other} is a built-in: it computes the case as given"
        got = self.kind_of(other) if self.kind_of is not None else None
        if got is None or got[1] or not isinstance(self.runs, Executor):
            return None
        k, dtype = got[0], self.case.spec["dtype"]
        self.runs.run(mapped_runs(k, dtype, self.rules[impl]))
        if k.ident in self.runs.unmappable or RunKey(k.runs_as, as_given(dtype), k.key) not in self.trajs:
            return None
        v = self.verdict(ref, impl, (k.runs_as, k.key), (other, ""))  # the built-in first, as a stand-in's leg
        if v.status != "parity":
            return None
        return (f"{other} computes what {k.runs_as}, the built-in of its kind, computes of the case as given: parity by"
                f" {v.rule}, gap {v.gap:.3g}")

    def ratio_on_rerun(self, r: Resolved, ref: str, impl: str, final: Verdict,
                       ) -> tuple[Verdict, dict[str, Any] | None, str | None]:
        """``final`` (an ``expected_difference`` of ``r`` with no residual judged) held against theory's sum-reduction
        ratio on the parallel plugin rerun where that ratio is exact (``session.scale_rerun``); its rerun made here,
        float64 only, once. Returns the verdict, what ``check_scale`` found and a line for the report (``None`` where
        no rerun applies or it could not be made or read)."""
        from parity_tests.session.executor import Executor, _Run

        rr = ratio_rerun(self.case, r.judged, engine(ref), engine(impl))
        if rr is None or not isinstance(self.runs, Executor):
            return final, None, None
        m = rr.mapping
        other = ref if m.side == impl else impl
        if self.computes_case(ref, impl, other) is None:
            # the ratio is exact for the case's loss only: a single side that computes more (a loss term the case cannot
            # express, on both sides as issue 35's L2 ports: (1/N) sum_r G_r + L2' against sum_r G_r + L2') need not hold it
            return final, None, (f"the predicted ratio not checked on {m.text}: {other} is not shown to compute the case"
                                 " as given (it parts from the built-in of its kind), and the ratio holds for the case's"
                                 " loss alone")
        try:
            made = self.rerun_itself(m, [_Run(m.side, FLOAT64, m, serves=m)])
        except RunError as e:  # a check of the prediction only: a plugin that fails on the rerun's case fails no compare
            return final, None, f"the predicted ratio not checked on {m.text}: its rerun failed: {e}"
        other64 = self.trajs.get(RunKey(other, FLOAT64))
        if made is None or other64 is None:
            return final, None, None
        run64, rerun64, fields = made
        if any(not_float64(t) for t in (run64, rerun64, other64)):
            return final, None, None
        if not reads_mapping(run64, rerun64, fields):
            return final, None, f"the predicted ratio not checked on {m.text}: it did not read {', '.join(fields)} from its case"
        said = next(d.text for d in r.judged.differences if d.text.startswith(SUM_REDUCTION))
        return ratio_verdict(final, r.as_ran, said, rr, other64, rerun64)

    def partial_on_itself(self, legs: _FreeLegs, r: Resolved, ref: str, impl: str, final: Verdict,
                          ) -> tuple[Verdict, str | None, dict[str, Any] | None]:
        """``final`` (an ``expected_difference`` of ``r`` with no residual judged) with the differences of the parallel
        set-up mapped on the plugin itself and the rest of the prediction held to its stage
        (``session.partial_mapping``); the rerun made here, once. Returns the verdict, a line for the report and,
        where it is a divergence, where the rerun and the other side part (else ``None`` twice)."""
        from parity_tests.session.executor import Executor
        from parity_tests.session.plan import mapped_runs

        p = partial_mapping(self.case, r.judged, engine(ref), engine(impl))
        if p is None or self.rules[impl] != "float64" or not isinstance(self.runs, Executor):
            return final, None, None
        m = p.mapping
        try:
            made = self.rerun_itself(m, mapped_runs(m, self.case.spec["dtype"], self.rules[impl]))
        except RunError as e:  # a check of the prediction only: a plugin that fails on the rerun's case fails no compare
            return final, f"not rerun with {', '.join(changed_fields(self.case.spec, m.changes))} mapped: it failed: {e}", None
        if made is None:
            return final, None, None
        run64, mapped64, fields = made
        if not reads_mapping(run64, mapped64, fields):
            return final, f"not rerun with {', '.join(fields)} mapped: {m.side} did not read it from its case", None
        a, b = ((m.side, m.key), (impl, "")) if m.side == ref else ((ref, ""), (m.side, m.key))
        v = legs.verdict(a, b)
        stage = legs.stage(a, b, v) if v.status not in ("parity", "inconclusive") else None
        out, line = partial_verdict(final, p, v, stage)
        return out, line, (legs.where(v, a, b) if out.status == "divergence" else None)

    def conditioned(self, verdict: Verdict, sides: tuple[tuple[str, str], tuple[str, str]]) -> tuple[Verdict, str]:
        """A float64 divergence held against how far one float64 ulp of the inputs moves each run
        (``judging.rules.conditioning``): each side's moved rerun (the check's ``needs``) made here, once, after the
        divergence that asks for it; a side that does not reproduce itself is judged by its spread instead
        (:meth:`unreproduced`). Returns the verdict and a line for the report."""
        from parity_tests.session.spread import nondeterministic

        if any(nondeterministic(name) for name, _ in sides):  # its reruns would measure its own run-to-run
            return verdict, ""  # noise, not conditioning: judged against that spread already (judging.spread)
        runs, needs, cases = [], [], []
        for name, suffix in sides:
            key = RunKey(name, FLOAT64, suffix)
            found = _declared(name)
            if key not in self.trajs or (found is not None and not found.rerunnable):
                return verdict, ""
            c = self.mapped_cases.get(key) or self.variants[FLOAT64]
            seed = c.spec.get("seed", 0)
            moved = dataclasses.replace(c, init=perturb_ulp(c.init, seed, np.float64),
                                        x=c.x if np.asarray(c.x).dtype.kind != "f"
                                        else perturb_ulp({"x": c.x}, seed, np.float64)["x"])
            if _reorders(name) and _reorderable(c.replace(dtype="float32")):
                # on its own devices: the spread of this computation, not of the full batch's
                moved = _resummed(moved, one_device=False)
            runs.append(self.trajs[key])
            needs.append(Need(RunKey(name, CONDITIONING.needs[0], suffix), lambda m=moved: m, stored=False))
            cases.append((c, moved))
        # asked for after the float64 divergence that needs them (each side's moved rerun, made once)
        reruns = self.runs.make(needs)
        checked, spread = CONDITIONING.judge(verdict, (runs[0], runs[1]), (reruns[0], reruns[1]), self.case.spec["steps"])
        if checked.status != "parity":
            return verdict, CONDITIONING.well_conditioned(spread)
        unsteady = self.unreproduced(verdict, sides, runs, reruns, cases)
        if unsteady is not None:
            return unsteady
        return CONDITIONING.inconclusive(verdict, checked, spread)


    def unreproduced(self, verdict: Verdict, sides: tuple[tuple[str, str], tuple[str, str]],
                     runs: list[dict[str, np.ndarray]],
                     reruns: list[dict[str, np.ndarray]], cases: list[tuple[Case, Case]],
                     ) -> tuple[Verdict, str] | None:
        """Whether the conditioning floor measured a side that does not reproduce itself, and the verdict then.

        A one-ulp rerun measures conditioning only if the run is a function of its inputs. A
        plugin with an order left to thread timing (the TF1 cifar10 trainer's moving averages,
        grouped with the update but not after it: each average reads its variable before or
        after the step) may take another order in that rerun, and its spread is then the race's,
        not rounding's: the pair would be called ill-conditioned for a program that is merely
        not deterministic. So, before that answer, each side runs the same moved case again and,
        where that repeats bit for bit, the case as judged again. Deterministic runs repeat bit
        for bit (the frameworks' op determinism is on; a built-in's resummed order is fixed by
        its seed). Where a repeat differs, the side is nondeterministic, the two runs' gap from
        the same inputs is its run-to-run spread, and the divergence is judged against that
        spread as a plugin declared ``deterministic=False`` is (``spread``). Both repeats, not
        one: a rare order seen in the moved rerun is unlikely to recur in its repeat, and a rare
        order in the judged run unlikely to recur in its own (a test plugin alternating two
        orders run by run is caught by the first).

        Returns ``None`` (every side reproduces itself: the conditioning answer stands) or the
        verdict and the report's line.
        """
        from parity_tests.session.spread import spread_rows, within_spread

        spreads, named = [], []
        for (name, suffix), run, moved_run, (case, moved) in zip(sides, runs, reruns, cases, strict=True):
            # each repeat asked for only after the one before it repeated bit for bit, side by side in order
            again = self.runs.make([Need(RunKey(name, MOVED64_AGAIN, suffix), lambda m=moved: m, stored=False)])[0]
            pair = [moved_run, again]  # the moved run first: a reran order shows there most
            if _same_run(*pair):
                pair = [run, self.runs.make([Need(RunKey(name, AGAIN64, suffix), lambda c=case: c, stored=False)])[0]]
                if _same_run(*pair):
                    spreads.append(None)
                    continue
            spreads.append(spread_rows(pair))
            named.append(name)
        if not named:
            return None
        zero = next(s for s in spreads if s is not None)
        spreads = [s if s is not None else (np.zeros_like(zero[0]), None) for s in spreads]
        greatest = max(float(np.nanmax(s[0], initial=0.0)) for s in spreads)
        line = (f"{' and '.join(named)} does not reproduce itself: two float64 runs from the same inputs differ by up"
                f" to {greatest:.2g} (an order left to thread timing?), so its one-ulp rerun measured that, not"
                f" conditioning; judged against its run-to-run spread (declare it deterministic=False, or fix the race)")
        judged = within_spread(verdict, spreads[0], spreads[1],
                               f"{' and '.join(named)} rerun from the same inputs")
        return dataclasses.replace(judged, detail=f"{line}; {judged.detail}"), line


def _same_run(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two runs of the same case recorded the same numbers, bit for bit (NaN equal to NaN)."""
    if a.keys() != b.keys():
        return False
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k]),
                              equal_nan=np.asarray(a[k]).dtype.kind in "fc") for k in a)


def _within_spread(verdict: Verdict, a: tuple[str, str], b: tuple[str, str], variants: dict[Variant, Case], dtype: str,
                   runs: Runs) -> Verdict:
    """A divergence with a nondeterministic plugin on a side, judged against its run-to-run spread (``spread``).

    ``a``, ``b``: each side's leg, ``(implementation, mapping key)``. Only a leg of a plugin's own runs (key
    ``""``) has a spread: its reruns are of the case it ran; a built-in's mapped runs are deterministic. Its needs
    (``SPREAD_RERUNS`` more runs of each nondeterministic side, kept with the comparison's runs) are asked for only
    after the divergence that needs them, and made by ``runs`` before the spread is judged.
    """
    from parity_tests.session.spread import judge_with_spread, nondeterministic

    trajs = runs.trajs
    (ref, ka), (impl, kb) = a, b
    own = [name for name, key in (a, b) if key == "" and nondeterministic(name)]
    if not own:
        return verdict
    d = "float64" if verdict.rule == RULE_FLOAT64 and RunKey(ref, FLOAT64, ka) in trajs else dtype
    if RunKey(ref, as_given(d), ka) not in trajs or RunKey(impl, as_given(d), kb) not in trajs:
        return verdict
    if SPREAD.applies(verdict):
        case = variants[as_given(d)]
        runs.make([Need(RunKey(name, v), lambda: case) for name in own for v in SPREAD.needs(d)])
    return judge_with_spread(verdict, (ref, impl), (trajs[RunKey(ref, as_given(d), ka)], trajs[RunKey(impl, as_given(d), kb)]),
                             lambda name, i: trajs[RunKey(name, SPREAD.needs(d)[i])], own=(ka == "", kb == ""))



def judge_pairs(judged: _Judged, impls: list[str], refused: Mapping[str, str], preds: Mapping[str, Prediction],
                mappings: Mapping[str, SideMapping | None], exact: dict[str, tuple[ExactScale, ...]],
                unmappable: Mapping[tuple[str, str], str]) -> list[PairResult]:
    """Every pair ``(impls[0], impl)`` judged from the runs made: ``unsupported`` where ``impl`` refused the case; a
    mapping or exact rerun that could not be made is dropped (the pair is judged without it, and says so)."""
    ref, dtype, trajs = impls[0], judged.case.spec["dtype"], judged.trajs
    for impl, ex in exact.items():  # a rerun that could not be made: that pair's loss scale is not mapped
        if any(e.ident in unmappable or RunKey(e.side, as_given(dtype), e.key) not in trajs for e in ex):
            exact[impl] = ()
    pairs = []
    for impl in impls[1:]:
        if impl in refused:
            nan = float("nan")
            verdict = Verdict(UNSUPPORTED, "not implemented", nan, nan, None, None, np.array([]), None,
                              f"{impl} does not run this case: {refused[impl]}")
            pairs.append(PairResult(ref, impl, verdict, preds[impl]))
            continue
        m = mappings.get(impl)
        note = ()
        if m is not None and (m.ident in unmappable or RunKey(m.runs_as, as_given(dtype), m.key) not in trajs):
            note = (f"could not map the predicted difference ({unmappable.get(m.ident, m.text)})",)
            m = None
        pair = judged.pair(ref, impl, preds[impl], m, exact.get(impl, ()))
        pairs.append(dataclasses.replace(pair, notes=pair.notes + note))
    return pairs
