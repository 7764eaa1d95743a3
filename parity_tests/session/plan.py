"""The runs a comparison makes, planned: the first round (every pair's rule) and the second (what the first
runs decide: the mapped runs, the exact loss-scale reruns, a gradient for the loss channel); each run
once, float64 first. ``session.executor`` makes them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from parity_tests.contract.case import MIXED_BFLOAT16, Case
from parity_tests.judging.rules import Can, Planned
from parity_tests.judging.rules import needs as rule_needs
from parity_tests.judging.rules.bfloat16_signature import BFloat16Signature
from parity_tests.judging.theory import LOSS_SCALE, Prediction
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.grad_rounding import rounds_gradients
from parity_tests.running import registry
from parity_tests.running.harness import refusal
from parity_tests.session.declared import declared as _declared
from parity_tests.session.declared import rerunnable as _rerunnable
from parity_tests.session.declared import runs_float64 as _runs_float64
from parity_tests.session.executor import Mapped, _Run
from parity_tests.session.keys import (
    BF16_RERUNS64_RUN,
    BF16_RERUNS_RUN,
    FLOAT64,
    GRADS64,
    PERTURBED_RUN,
    ROUNDED64,
    STEP1,
    RunKey,
    Variant,
    as_given,
)
from parity_tests.session.loss_scale import ExactScale
from parity_tests.session.mapping import SideMapping, choose_mapping

__all__ = ["FLOORS", "first_round", "second_round", "in_place_captures", "mapped_runs"]


#: how a float32 case's noise floor is measured: ``auto`` (float64 runs where both sides of a pair
#: declare float64, else the perturbation), or one of the two for every pair (the benchmark compares them)
FLOORS = ("auto", "float64", "perturbation")
#: the implementation whose float64 run bounds the loss's sensitivity when neither side records a gradient
GRAD_SOURCE = "grads"


def _floor_rules(case: Case, impls: list[str], floor: str) -> dict[str, str]:
    """Per judged impl: ``"float64"`` or ``"perturbation"`` (a float64 case: always ``"float64"``)."""
    if floor not in FLOORS:
        raise ValueError(f"floor must be one of {', '.join(FLOORS)}, got {floor!r}")
    ref = impls[0]
    if case.spec["dtype"] == "float64":
        return {impl: "float64" for impl in impls[1:]}
    if case.spec["dtype"] == MIXED_BFLOAT16:  # no float64 run computes in bfloat16: always measured by perturbation
        return {impl: "perturbation" for impl in impls[1:]}
    if floor != "auto":
        return {impl: floor for impl in impls[1:]}
    # float64 runs only where both sides of the pair declare they can make them
    return {impl: "float64" if _runs_float64(ref) and _runs_float64(impl) else "perturbation" for impl in impls[1:]}


def _unrefused(impls: list[str], rules: dict[str, str], refused: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """``impls`` and ``rules`` without the implementations that refused the case (none of their runs is planned)."""
    return [i for i in impls if i not in refused], {i: r for i, r in rules.items() if i not in refused}


SIGNATURE = BFloat16Signature()
#: the order of the runs after each implementation's run as given (float64 first, then: :func:`_float64_first`)
_ORDER = (PERTURBED_RUN, STEP1, FLOAT64, ROUNDED64, GRADS64, *BF16_RERUNS_RUN[1:], *BF16_RERUNS64_RUN)


def _can(impl: str, case: Case | None = None) -> Can:
    """What ``impl`` declares it can run, as the rules read it before any run (``judging.rules.Planned``); with
    ``case``, also whether it makes that case's float64 run rounding the gradients (``protocol.grad_rounding``:
    an engine that declares ``rounds_gradients``, on a case that run covers)."""
    found = _declared(impl)
    grads = (case is not None and case.spec["dtype"] == MIXED_BFLOAT16 and found is not None
             and found.spec.rounds_gradients and rounds_gradients(case.spec))
    return Can(float64=_runs_float64(impl), rerunnable=_rerunnable(impl), grads_bf16=grads)


def side_needs(dtype: str, rule: str, ref: str, impl: str) -> tuple[tuple[Variant, ...], tuple[Variant, ...]]:
    """The variants of ``ref`` and of ``impl`` the pair's rule judges from (``judging.rules.needs``)."""
    return rule_needs(Planned(dtype, rule, _can(ref), _can(impl)))


def _plan(case: Case, impls: list[str], rules: dict[str, str]) -> list[tuple[str, Variant]]:
    """The runs to make, ``(impl, variant)``: every implementation's run as given, then the union of what each
    pair's rule needs (``judging.rules.needs``) and what the bfloat16 signature check needs before any verdict
    (``judging.rules.bfloat16_signature``: each side's one-step float32 run in a mixed case); float64 first."""
    ref, dtype = impls[0], case.spec["dtype"]
    plan: list[tuple[str, Variant]] = [(impl, as_given(dtype)) for impl in impls]
    for impl, rule in rules.items():
        planned = Planned(dtype, rule, _can(ref, case), _can(impl, case))
        for checked in (rule_needs(planned), SIGNATURE.needs(planned)):  # the rule's, then the signature check's
            if checked is not None:
                plan += [(ref, v) for v in checked[0]] + [(impl, v) for v in checked[1]]
    # in a fixed order (the runs are the same in any order): each variant for every implementation in turn, the
    # variants as _ORDER lists them
    order = {v: i for i, v in enumerate((as_given(dtype), *_ORDER))}
    index = {impl: i for i, impl in enumerate(impls)}
    plan = sorted(dict.fromkeys(plan), key=lambda item: (order.get(item[1], len(order)), index[item[0]]))
    return _float64_first(plan)


def _float64_first(plan: list[tuple[str, Variant]]) -> list[tuple[str, Variant]]:
    """float64 runs first (a stable sort: the order within is kept): what a run leaves behind in the
    allocators (measured: 0.2-0.4 GB after a 25 M-parameter TensorFlow run) adds to the next run's
    peak, so the runs with twice the float32 working set go while the least is retained."""
    return sorted(dict.fromkeys(plan), key=lambda item: item[1] != FLOAT64)


def _records_grads(traj: Any) -> bool:
    params = [k for k in traj if isinstance(k, str) and k.startswith("param/")]
    return bool(params) and all(f"grad/{k[len('param/'):]}" in traj for k in params)



def _float64_first_runs(plan: list[_Run]) -> list[_Run]:
    """Each run once (by what it computes), float64 first (:func:`_float64_first`)."""
    seen: dict[RunKey, _Run] = {}
    for item in plan:
        seen.setdefault(RunKey(item.impl, item.variant, item.mapping.key if item.mapping else ""), item)
    return sorted(seen.values(), key=lambda item: item.variant != FLOAT64)


def _grads_source(case: Case, impls: list[str], rules: dict[str, str], trajs: Mapping[RunKey, Any],
                  refused: dict[str, str]) -> str | None:
    """A built-in whose float64 run gives the loss channel a gradient where neither side of a float64-rule pair records one.

    ``loss_channel.loss_sensitivity``: the loss of step ``k`` is judged against its bound only where a
    gradient bounds how the parameters' rounding moves it (or where both sides start the step from
    the same numbers). ``None`` when every such pair has a gradient, the model is external (no
    built-in runs it), or the built-ins refuse the case.
    """
    ref = impls[0]
    wanting = [impl for impl in impls[1:] if impl not in refused and rules[impl] == "float64"
               and not any(_records_grads(trajs.get(RunKey(n, FLOAT64), {})) for n in (ref, impl))]
    if not wanting or "external" in case.spec["model"]:
        return None
    for name in ("tf.single", "torch.single"):
        if RunKey(name, FLOAT64) in trajs:
            return name
    return "tf.single"


def in_place_captures(case: Case, impls: list[str], rules: Mapping[str, str], refused: Mapping[str, str],
                      preds: Mapping[str, Prediction], stages: bool) -> set[str]:
    """The implementations whose float64 run of the case records step 1's per-device values in place.

    A pair with an expected difference is not at parity, and its localisation (``judge_pair``, read
    from the float64 runs where the float64 rule judges) refines the first bad step from both sides'
    per-device values (``capture.inside_step``), which for a difference theory predicts is step 1
    wherever it acts from the start. Where both sides' engines capture in place
    (``EngineSpec.captures_in_place``: a run with a capture trains bit for bit as without), their
    float64 runs record step 1 as they go, and no run of its own is made for the capture: the
    29.5 M GPT's compare makes 6 runs, not 8 (docs/benchmarks.md). A first bad step after step 1
    still gets its own capture runs, as before.
    """
    dtype, ref = case.spec["dtype"], impls[0]
    if not stages or dtype not in ("float32", "float64"):
        return set()

    def in_place(name: str) -> bool:
        found = _declared(name)
        return found is not None and found.spec.captures_in_place

    out: set[str] = set()
    for impl in impls[1:]:
        if impl in refused or not preds[impl].expected or (dtype == "float32" and rules.get(impl) != "float64"):
            continue
        if in_place(ref) and in_place(impl):
            out |= {ref, impl}
    return out


def first_round(case: Case, impls: list[str], rules: dict[str, str], refused: Mapping[str, str],
                capture: Collection[str] = ()) -> list[_Run]:
    """The runs every pair's rule needs (:func:`_plan`), of the implementations that did not refuse the case;
    the float64 runs of ``capture`` (:func:`in_place_captures`) record step 1's per-device values as they go."""
    return [_Run(impl, d, capture=1 if d == FLOAT64 and impl in capture else None)
            for impl, d in _plan(case, *_unrefused(impls, rules, refused))]


@dataclass
class SecondRound:
    """What the first round's runs decide (:func:`second_round`): per pair, its mapping and exact reruns, and the runs."""

    mappings: dict[str, SideMapping | None]
    exact: dict[str, tuple[ExactScale, ...]]  # per pair, its programs rerun with the loss scale exact
    runs: list[_Run]
    grads_from: str | None  # the built-in whose float64 run gives the loss channel a gradient, if any


def second_round(case: Case, impls: list[str], rules: dict[str, str], refused: Mapping[str, str],
                 preds: Mapping[str, Prediction], rounding: dict[str, str | None], own: Collection[str],
                 scales: Mapping[str, float | None], trajs: Mapping[RunKey, Any], theory_spec: dict[str, Any],
                 own_schedule: Collection[str] = ()) -> SecondRound:
    """The mapped runs (a TensorFlow plugin's Keras optimizer says what it held), the programs rerun with
    Keras' loss scale exact, and a gradient for the loss channel where no side records one; float64 first."""
    ref, dtype = impls[0], case.spec["dtype"]
    mappings: dict[str, SideMapping | None] = {}
    exact: dict[str, tuple[ExactScale, ...]] = {}
    second: list[_Run] = []
    for impl in impls[1:]:
        if impl in refused:
            continue
        m = mappings[impl] = choose_mapping(theory_spec, ref, impl, preds[impl], rounding, own, own_schedule)
        # a mapped side runs as a built-in (everything declared): what the pair's rule needs of such a side
        needed = list(rule_needs(Planned(dtype, rules[impl], Can(), Can()))[1])
        if any(d.mapping == LOSS_SCALE for d in preds[impl].differences) and rules[impl] == "float64":
            exact[impl] = tuple(ExactScale(x, f) for x in (ref, impl) if (f := scales.get(x)) is not None)
            second.extend(_Run(e.side, d, e, serves=e) for e in exact[impl] for d in needed)
        if m is None:
            continue
        second.extend(_Run(m.runs_as, d, m, serves=m) for d in _mapped_needs(case, rules[impl], m.runs_as, m))
        if m.stand_in:  # the built-in as the plugin runs, against the plugin it stands in for
            second.extend(_Run(m.runs_as, d, m.plain, serves=m)
                          for d in _mapped_needs(case, rules[impl], m.runs_as, m.plain))
    grads_from = _grads_source(case, impls, rules, dict(trajs), dict(refused))
    if grads_from is not None:
        second.append(_Run(grads_from, FLOAT64, required=False))
    return SecondRound(mappings, exact, _float64_first_runs(second), grads_from)


def _mapped_needs(case: Case, rule: str, runs_as: str, m: SideMapping | None) -> list[Variant]:
    """What the pair's rule needs of a mapped side, ``runs_as`` run with ``m`` (``None``: the stand-in's unmapped
    run; either runs as a built-in: everything declared), the gradient-rounding float64 run included where
    ``runs_as`` makes it on the case it runs (:func:`_can`)."""
    grads = case.spec["dtype"] == MIXED_BFLOAT16 and _can(runs_as, case if m is None else m.apply(case)).grads_bf16
    return list(rule_needs(Planned(case.spec["dtype"], rule, Can(), Can(grads_bf16=grads)))[1])


def mapped_runs(m: Mapped, dtype: str, rule: str) -> list[_Run]:
    """The runs of ``m``'s mapped side that the pair's rule ``rule`` needs (a mapped side is judged as one that
    declares every run: ``judging.rules.needs``), float64 first."""
    return _float64_first_runs([_Run(m.ident[0], d, m, serves=m) for d in rule_needs(Planned(dtype, rule, Can(), Can()))[1]])


def refusals(case: Case, impls: list[str], skip_unsupported: bool) -> dict[str, str]:
    """Every implementation's refusal of ``case`` before any of them runs (``harness.refusal``), by name.

    The reference's refusal, and any where ``skip_unsupported`` is false, is raised; recorded float32
    runs beside runnable ones are refused too (no rule judges their pair).
    """
    for name in impls:  # every name resolved before theory reads what kind of implementation it is
        registry.resolve(name, "impls")
    from parity_tests.session.noise import check_recorded_mix, recorded_runs

    check_recorded_mix(case, impls)  # two recorded float32 runs beside runnable ones: no rule judges their pair
    if recorded_runs(case, impls):
        raise CaseError("impls", "a runnable implementation beside the recorded float32 runs (a pair of two recorded"
                                 " float32 runs has no float64 or perturbed run to be judged by; judge them with"
                                 " parity_tests.session.noise.noise_or_bug_all, as tfpar compare does)",
                        ",".join(impls))
    refused: dict[str, str] = {}
    for name in impls:
        no = refusal(case, name)
        if no is not None and (not skip_unsupported or name == impls[0]):
            raise no
        if no is not None:
            refused[name] = str(no)
    return refused
