"""Judge one case across implementations: run them, apply the tolerance model and theory, explain.

The first implementation is the reference; every other one is judged against
it. A float64 case is judged by the float64 rule. A float32 case is also run
in float64 on every implementation, so each side's own float32 noise floor is
known (``rules.judge_float32``) -- unless a side of a pair declares only
float32 (its registry ``dtypes``, e.g. a user's plugin): that pair is judged by
the perturbation floor (``perturbation.judge_perturbation``), each side re-run in
float32 with its initial weights, inputs and hyperparameters moved by one float32
ulp and the rows of each device's shard reordered (:func:`perturbed_case`, seeded
by the case seed), and no float64 run is
asked of it. A side that cannot be re-run (a recorded run) takes the other
side's floor. Every pair goes through ``pair.judge_sides`` (the rule and every guard).

Theory (``theory.predict``) says which pairs must differ at the case's values
(expected differences) and which documented small effects apply (known
differences). Where a built-in side of a pair can be run with the other side's
semantics (``theory.mapping_changes``: the other framework's optimizer rule, with
Keras' float32 hyperparameters where the other side is Keras; by-size weighting,
clipping after the combine, synchronized batch norm, ...), it is run so, and the
pair is judged again with the difference mapped away: ``pair.resolve`` calls a
divergence an expected difference only when that residual is parity, and reports
the gap without the mapping beside the verdict.

Each step has its module: ``plan`` (refusals, the first and second round), ``executor`` (making
the runs, each once), ``variants`` (the cases run), ``mapping``, ``judge_pair`` (one pair's verdict),
``capture`` and ``results``; runs are named by ``keys.RunKey``. The names other modules import from
here are re-exported.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from parity_tests.contract.case import MIXED_BFLOAT16, Case
from parity_tests.judging.pair import OK_STATUSES
from parity_tests.judging.theory import engine, predict
from parity_tests.running.harness import run_impl
from parity_tests.running.room import available_bytes, fits_beside, tf_bytes, torch_bytes
from parity_tests.session.capture import _up_to as _up_to
from parity_tests.session.capture import inside_step
from parity_tests.session.executor import Executor, Runner, _log
from parity_tests.session.executor import _beside as _beside
from parity_tests.session.judge_pair import _against_theory as _against_theory
from parity_tests.session.judge_pair import _Judged, _tf_kernels, judge_pairs
from parity_tests.session.keys import FLOAT64, RunKey
from parity_tests.session.loss_scale import loss_scales
from parity_tests.session.mapping import (
    MAPPED,
    NOT_EQUIVALENT,
    STAND_INS,
    SideMapping,
    choose_mapping,
    follows_its_class,
    held_roundings,
    keras_rounding_of,
    kind_run,
    on_itself,
    own_rules,
    residual_unjudged,
    rule_runs,
    stand_in_apart,
    stand_in_leg,
    torch_rule_from,
    torch_rule_of,
    writes_own_rule,
)
from parity_tests.session.plan import (
    FLOORS,
    _floor_rules,
    first_round,
    in_place_captures,
    refusals,
    second_round,
)
from parity_tests.session.results import CaseResult, PairResult
from parity_tests.session.variants import (
    BF16_CHECK,
    BF16_RERUN_KEYS,
    PERTURBED,
    _variants,
    perturbed_case,
)
from parity_tests.session.variants import _Reordered as _Reordered
from parity_tests.session.variants import _reordered as _reordered
from parity_tests.session.variants import _rerun_of as _rerun_of
from parity_tests.session.variants import _Variants as _Variants

__all__ = ["PairResult", "CaseResult", "compare_case", "perturbed_case", "OK_STATUSES", "FLOORS", "PERTURBED",
           "SideMapping", "STAND_INS", "choose_mapping", "keras_rounding_of", "held_roundings", "MAPPED", "inside_step",
           "NOT_EQUIVALENT", "writes_own_rule", "torch_rule_of", "torch_rule_from",
           "own_rules", "follows_its_class", "rule_runs", "stand_in_apart", "stand_in_leg", "residual_unjudged",
           "BF16_CHECK", "BF16_RERUN_KEYS"]


def compare_case(
    case: Case,
    impls: list[str],
    *,
    progress: bool | Callable[[str], None] = False,
    runner: Runner | None = None,
    skip_unsupported: bool = False,
    floor: str = "auto",
    stages: bool = True,
) -> CaseResult:
    """Run ``case`` on every implementation in ``impls`` and judge each against ``impls[0]``.

    Args:
        case: a validated case.
        impls: two or more implementation names; the first is the reference.
        progress: ``True`` for a progress bar on stderr, or a callable given a label per run.
        runner: ``runner(case, impl) -> trajectory`` (default: :func:`harness.run_impl`).
        skip_unsupported: when an implementation other than the reference refuses the
            case as not implemented (``CaseError``), record the pair as ``unsupported``
            instead of raising (what the matrix does for rows a path cannot run).
        floor: for a float32 case, how each side's noise floor is measured: ``"auto"``
            (float64 runs where both sides declare float64, else the one-ulp
            perturbation), ``"float64"`` or ``"perturbation"`` for every pair.
        stages: for a pair not at parity whose first bad step breaks inside the step (the loss or
            the combined gradient), run both sides once more recording that step's per-device
            values and name the first stage that breaks (:func:`localise.stage_chain`); costs
            one run per side and step, only for such pairs.
    """
    refused = refusals(case, impls, skip_unsupported)
    default_runner = runner is None
    # the default runner's TensorFlow and torch runs go beside each other where both fit in memory
    # (parity_tests.running.room); a large model's go one after another, with the same results
    beside = default_runner and fits_beside(case)
    runner = runner or (lambda c, i: run_impl(c, i))
    t0 = time.perf_counter()
    dtype, ref = case.spec["dtype"], impls[0]
    variants = _variants(case)
    rules = _floor_rules(case, impls, floor)
    # theory reads the float64 spec (the runs that decide a float32 case), but a mixed case's own
    theory_spec = case.spec if dtype == MIXED_BFLOAT16 else variants[FLOAT64].spec
    tf_kernels = _tf_kernels(theory_spec)
    preds = {impl: predict(theory_spec, engine(ref), engine(impl), kernels=tf_kernels) for impl in impls[1:]}
    if default_runner and not beside:  # why a large model's compare takes longer than its runs side by side
        need = (tf_bytes(case) + torch_bytes(case)) / 1e9
        _log.info("%s: TensorFlow and torch runs one after another, not beside each other: together about %.1f GB"
                  " in float64, %.1f GB available (docs/memory.md)", case.name, need, available_bytes() / 1e9)
    runs = Executor(case, ref, variants, runner, beside=beside, progress=progress, skip_unsupported=skip_unsupported,
                    refused=refused)
    first = first_round(case, impls, rules, refused, in_place_captures(case, impls, rules, refused, preds, stages))
    runs.expect(len(first))
    runs.run(first)
    # second round: what the first runs decide. The mapped runs (a TensorFlow plugin's Keras
    # optimizer says what it held), and a gradient for the loss channel where no side records one
    trajs = runs.trajs
    rounding = held_roundings(impls, trajs, dtype)
    own = own_schedule = own_rules(impls, trajs, dtype)  # own_schedule: their rates are their code's (theory)
    if "external" not in case.spec["model"]:  # (no built-in runs an external model)
        own = follows_its_class(own, rule_runs(runs, variants[FLOAT64]), case.spec)
    # Keras' distribution loss scale, read from each float64 run: a pair judged without float64 runs (the
    # perturbation rule) sees only float32 runs, whose float32(1/N) is float32 arithmetic's own
    scales = loss_scales(impls, trajs)
    preds = {impl: predict(theory_spec, engine(ref), engine(impl), held=rounding, kernels=tf_kernels, own=own,
                           own_schedule=own_schedule, scales=scales if rules.get(impl) == "float64" else None) for impl in impls[1:]}
    second = second_round(case, impls, rules, refused, preds, rounding, own, scales, trajs, theory_spec, own_schedule)
    runs.expect(len(second.runs))
    runs.run(second.runs)
    runs.close()
    g = second.grads_from
    grads = [trajs[RunKey(g, FLOAT64)]] if g is not None and RunKey(g, FLOAT64) in trajs else []
    apart = {}  # a stand-in and its plugin: what theory expects to differ between them as the stand-in runs
    for m in second.mappings.values():
        if m is not None and (why := stand_in_apart(m, case, theory_spec, rounding, own, own_schedule, tf_kernels)):
            apart[(m.runs_as, m.side)] = why
    # a plugin's mapping made on itself, rerun only where its stand-in turns out no equivalent run (judge_pair)
    itself = {impl: o for impl, m in second.mappings.items()
              if (o := on_itself(m, theory_spec, preds[impl], rounding, own, own_schedule)) is not None}

    def kind_of(name: str) -> tuple[SideMapping, str | None] | None:  # asked only by _Judged.computes_case
        k = kind_run(name, theory_spec, rounding, own, own_schedule)
        return None if k is None else (k, stand_in_apart(k, case, theory_spec, rounding, own, own_schedule, tf_kernels))

    judged = _Judged(case, variants, rules, runs, runs.mapped_cases, grads, stages, beside=beside, apart=apart,
                     itself=itself, kind_of=kind_of)
    pairs = judge_pairs(judged, impls, refused, preds, second.mappings, second.exact, runs.unmappable)
    return CaseResult(case, list(impls), pairs, {key.text: traj for key, traj in trajs.items()},
                      time.perf_counter() - t0, runs=trajs)
