"""The error-rate hunt's small sample (issue 25, item 7): a few pairs of each kind, with their right verdicts.

``benchmarks/bench_error_rates.py`` draws 1000 equivalent pairs and 300 seeded bugs
and prints the judge's error rates (``docs/error-rates.md``); this file checks, at
the smallest size that can fail:

* the ground truth (``hunt/corpus.py``) says what its rule says, at the edges
  (lr 0, Adam's epsilon 0, a clip threshold never reached, Keras' rounding only
  in float64);
* the corpus' premise: every equivalent rewrite (``tf.add_n``, ``tf.stack`` +
  ``reduce_mean``, one concatenated-loss mean, no ``grads=``, a Keras model and
  optimizer; DDP, a hand all-reduce, one process) is at parity with the built-ins
  on cases that use what it honours (uneven shards, ``by_size``, a clip that some
  steps reach, Adam), so a pair's truth is known by construction;
* one seeded bug of each family is found (a divergence) against its correct
  version: the update, the data, the clip, the DDP replicas, a mutated built-in.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from parity_tests.protocol.hyper import cosine_lr
from parity_tests.running.harness import run_impl
from parity_tests.running.registry import resolve
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make
from parity_tests.tests.hunt.corpus import (
    BUGS,
    BY_NAME,
    LATE,
    MOMENTUM,
    NEVER,
    OK,
    TORCH,
    Pair,
    differences,
    judgement,
    mutated_runner,
    pairs,
    program,
    rates,
    register_mutants,
    specs,
    tf,
    torch,
    truth,
)

# 4 devices, 14 rows: shards 4, 4, 3, 3; by_size; 3 steps; the 5-10-1 MLP
BASE = {"dtype": "float64", "data__global_batch": 14, "steps": 3, "parallel__devices": 4,
        "parallel__weighting": "by_size"}


def spec(**changes):
    return make(MLP, **{**BASE, **changes}).spec


# ---------------------------------------------------------------- the ground truth (no runs)


def test_truth_lr_zero_is_inconclusive():
    assert truth(spec(optimizer={"name": "sgd", "lr": 0.0}), BY_NAME["tf.towers"], BY_NAME["torch.ddp"])[0] == (
        "inconclusive",)


def test_truth_adam_epsilon_zero_has_no_difference_across_frameworks():
    adam = {"name": "adam", "lr": 0.01, "semantics": "native", "beta1": 0.9, "beta2": 0.999}
    a, b = BY_NAME[tf("add_n")], BY_NAME[torch("ddp")]  # neither rounds hyperparameters
    assert truth(spec(optimizer={**adam, "epsilon": 0.0}), a, b)[0] == ("parity",)
    assert truth(spec(optimizer={**adam, "epsilon": 1e-8}), a, b)[0] == OK


def test_truth_per_device_clip_differs_from_one_device_only_when_reached():
    sgd = {"name": "sgd", "lr": 0.01, "semantics": "torch"}
    towers, single = BY_NAME["tf.towers"], BY_NAME["tf.single"]
    never = spec(optimizer=sgd, parallel__clip={"global_norm": NEVER, "where": "per_device"})
    always = spec(optimizer=sgd, parallel__clip={"global_norm": 1e-6, "where": "per_device"})
    assert differences(never, towers, single) == ([], [])
    assert differences(always, towers, single)[0] == ["per-device clip vs one device"]


def test_truth_keras_rounding_is_a_float64_difference_only():
    sgd = {"name": "sgd", "lr": 0.01, "semantics": "native"}
    keras, raw = BY_NAME[tf("keras_model")], BY_NAME[tf("add_n")]
    assert truth(spec(optimizer=sgd), keras, raw)[0] == OK
    assert truth(spec(optimizer=sgd, dtype="float32"), keras, raw)[0] == ("parity",)
    assert truth(spec(optimizer={**sgd, "lr": 0.5}), keras, raw)[0] == ("parity",)  # 0.5 is a float32


def test_a_bug_at_parity_or_behind_a_predicted_difference_is_a_miss():
    bug = next(b for b in BUGS if b.name == "grads_summed")
    pair = Pair(make(MLP, **BASE).spec, "torch.ddp", bug.impl, bug)
    assert not judgement(pair, "parity")[0]
    assert not judgement(pair, "expected_difference")[0]
    assert judgement(pair, "divergence")[0]
    assert judgement(pair, "unexpected_parity")[0]
    # "could not judge" says nothing about the code: a miss, since this bug leaves the run far from vacuous
    assert not judgement(pair, "inconclusive")[0] and not judgement(pair, "error")[0]


def test_keras_made_under_floatx_float64_rounds_momentum_and_betas_but_not_the_rate():
    """docs/plugins.md's recipe: ``learning_rate`` a float64 variable, momentum and Adam's betas through float32."""
    fit, towers, ddp = BY_NAME[program("keras_fit")], BY_NAME["tf.towers"], BY_NAME[torch("ddp")]
    sgd = {"name": "sgd", "lr": 1e-3, "semantics": "native"}
    assert truth(spec(optimizer=sgd, parallel__weighting="equal", data__global_batch=16), fit, ddp)[0] == ("parity",)
    assert truth(spec(optimizer=sgd, data__global_batch=16), fit, towers)[0] == OK  # tf.towers rounds the rate
    momentum = {**sgd, "name": "momentum", "momentum": 0.9}
    assert truth(spec(optimizer=momentum, data__global_batch=16), fit, ddp)[0] == OK
    both = {**momentum, "lr": 0.5}  # a float32 rate: only momentum is rounded, by both
    assert truth(spec(optimizer=both, data__global_batch=16), fit, towers)[0] == ("parity",)


def test_truth_knows_keras_float32_distribution_loss_scale_at_n_not_a_power_of_two():
    """model.fit scales each replica's loss by float32(1/N): 1 + 2^-25 at N = 3, nothing at N = 2 or 4."""
    fit, ddp = BY_NAME[program("keras_fit")], BY_NAME[torch("ddp")]
    sgd = {"name": "sgd", "lr": 0.05, "semantics": "native"}
    even = {"optimizer": sgd, "parallel__weighting": "equal"}
    assert truth(spec(**even, data__global_batch=12, parallel__devices=3), fit, ddp)[0] == OK
    assert truth(spec(**even, data__global_batch=12, parallel__devices=4), fit, ddp)[0] == ("parity",)
    assert truth(spec(**even, data__global_batch=12, parallel__devices=2), fit, ddp)[0] == ("parity",)
    assert truth(spec(**even, data__global_batch=12, parallel__devices=3), fit, BY_NAME[program("keras_fit_floatx")]
                 )[0] == ("parity",)  # both scale alike


def test_truth_knows_keras_float32_betas_decide_a_float32_case_where_one_minus_beta_is_rounded_far():
    """1 - float32(0.999999) is 1.3e-2 off 1 - 0.999999: the float64 runs that decide a float32 case part by that
    (the hunt's keras_fit_l2 vs ddp_l2, 2026-11-28); 1 - float32(0.9) is 2.4e-7 off: float32 noise."""
    fit, ddp = BY_NAME[program("keras_fit")], BY_NAME[torch("ddp")]
    adam = {"name": "adam", "lr": 0.01, "semantics": "native", "beta1": 0.999999, "beta2": 0.999, "epsilon": 0.0}
    even = {"dtype": "float32", "parallel__weighting": "equal", "data__global_batch": 16}
    assert truth(spec(**even, optimizer=adam), fit, ddp)[0] == OK
    # beta2 0.999 would count: 1 - float32(0.999) is 1.3e-5 off 1 - 0.999
    assert truth(spec(**even, optimizer={**adam, "beta1": 0.9, "beta2": 0.9}), fit, ddp)[0] == ("parity",)


def test_programs_are_drawn_only_where_they_honour_the_case():
    fit, v1 = BY_NAME[program("keras_fit")], BY_NAME[program("v1_losses")]
    native = {"name": "sgd", "lr": 0.05, "semantics": "native"}
    even = spec(optimizer=native, data__global_batch=16)
    assert fit.runs(even) and not fit.runs(spec(optimizer=native))  # 14 rows on 4 devices: uneven slices
    assert not fit.runs(spec(optimizer={**native, "semantics": "torch"}, data__global_batch=16))
    assert not v1.runs(even) and v1.runs(spec(optimizer=native, dtype="float32", data__global_batch=16))
    assert BY_NAME[program("keras_fit_l2")].group == BY_NAME[torch("ddp_l2")].group == "l2"
    user = BY_NAME[program("keras_fit_l2_user")]
    assert user.group == BY_NAME[torch("ddp_l2_user")].group == "l2_user"
    assert user.runs(spec(optimizer=native, dtype="float32", data__global_batch=16)) and not user.runs(even)


COSINE = {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 3, "min_lr": 0.0}


def test_corpus_draws_warmup_cosine_schedules_with_their_edges_and_never_for_programs():
    """About one case in five draws the GPT trainers' warm-up + cosine (those with lr > 0), its edges included: a
    one-step warm-up, one longer than the run, a decay done in one step, to 0 and to a floor."""
    drawn: list = []

    @settings(max_examples=400, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @seed(5)
    @given(specs())
    def collect(raw):
        drawn.append(raw)

    collect()
    moving = [r for r in drawn if r["optimizer"]["lr"] > 0]  # the contract refuses lr 0 with a warmup_cosine
    cos = [r for r in moving if "schedule" in r["optimizer"]]
    # integers(0, 4) == 0 is 1/5 for a uniform draw; hypothesis does not draw uniformly (measured at this seed:
    # 0.15 under hypothesis' default settings, about 0.11 under the test profile), hence the wide window: some
    # schedule cases, most cases still at a constant rate
    assert 0.05 < len(cos) / len(moving) < 0.35, (len(cos), len(moving))
    assert all(r["optimizer"]["lr"] > 0 and r["optimizer"]["schedule"]["kind"] == "warmup_cosine" for r in cos)
    sch = [r["optimizer"]["schedule"] for r in cos]
    assert any(s["warmup_steps"] == 1 for s in sch) and any(s["decay_steps"] == 1 for s in sch)
    assert any(s["warmup_steps"] >= r["steps"] for s, r in zip(sch, cos, strict=True))
    assert any(s["min_lr"] == 0 for s in sch) and any(s["min_lr"] > 0 for s in sch)
    native = {"name": "sgd", "lr": 0.05, "semantics": "native", "schedule": COSINE}
    assert not any(BY_NAME[program(f)].runs(spec(optimizer=native, data__global_batch=16))
                   for f in ("keras_fit", "keras_fit_floatx", "keras_fit_l2"))
    assert not BY_NAME[program("v1_losses")].runs(spec(optimizer=native, dtype="float32", data__global_batch=16))


def test_corpus_rates_are_the_contracts_curve_and_keras_reads_it_one_step_late():
    """``corpus.rates`` against the tool's own closed form (``protocol.hyper.cosine_lr``): step t at f(t), or at
    f(t - 1) on a side running Keras' CosineDecay (step 1 at rate 0)."""
    s = spec(optimizer={"name": "sgd", "lr": 0.05, "schedule": {**COSINE, "min_lr": 0.005}}, steps=4)
    assert rates(s) == pytest.approx([cosine_lr(s["optimizer"]["schedule"], 0.05, t) for t in (1, 2, 3, 4)], rel=1e-15)
    assert rates(s, late=True) == pytest.approx([0.0] + rates(s)[:3], rel=1e-15)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_truth_keras_cosine_decay_one_step_late_against_the_curve_and_nowhere_else(name):
    """Under native a Keras optimizer runs Keras' CosineDecay (one step late); torch's schedulers and every rule
    written out (tf_side's included) run the curve. Keras against the curve is expected_difference and nothing
    else (parity would hide step 1 at rate 0); two sides reading it alike are at parity (float32: Keras' rounded
    momentum and betas matter in float64 only), but for momentum across frameworks (Keras' buffer holds the
    changing rate) and Adam's epsilon; under tf or torch semantics every side reads the curve: parity."""
    opt = {"name": name, "lr": 0.05, "semantics": "native", "schedule": COSINE,
           **({"momentum": 0.9} if name == "momentum" else {}),
           **({"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8} if name == "adam" else {})}
    late = [BY_NAME[i] for i in ("tf.towers", "tf.single", "tf.mirrored", tf("keras_model"))]
    curve_sides = [BY_NAME[i] for i in ("torch.ddp", torch("ddp"), torch("hand_allreduce"), tf("add_n"),
                                        tf("concat_loss"))]
    native = spec(optimizer=opt, dtype="float32")
    for k in late:
        for c in curve_sides:
            allowed, why = truth(native, k, c)
            assert allowed == ("expected_difference",) and LATE in why, (k.name, c.name, allowed, why)
    assert truth(native, BY_NAME["tf.towers"], BY_NAME[tf("keras_model")])[0] == ("parity",)
    assert truth(native, BY_NAME["torch.ddp"], BY_NAME[torch("hand_allreduce")])[0] == ("parity",)
    across, why = truth(native, BY_NAME[tf("add_n")], BY_NAME[torch("ddp")])  # both on the curve, each its rule
    assert across == {"sgd": ("parity",), "momentum": OK, "adam": OK}[name], why
    assert (MOMENTUM in why) == (name == "momentum") and LATE not in why
    if name == "sgd":  # nothing Keras rounds: both read CosineDecay's float32 rates, also in float64
        assert truth(spec(optimizer=opt), BY_NAME["tf.towers"], BY_NAME[tf("keras_model")])[0] == ("parity",)
    for sem in ("tf", "torch"):
        same = spec(optimizer={**opt, "semantics": sem})
        assert truth(same, BY_NAME["tf.towers"], BY_NAME[torch("ddp")])[0] == ("parity",)
        assert truth(same, BY_NAME[tf("add_n")], BY_NAME["torch.ddp"])[0] == ("parity",)


def test_mutants_are_declared_as_their_built_in_under_their_own_name():
    """What the judge reads of a mutated built-in (``protocol.engine.declared``) is its base's declaration: it
    splits the batch as the base does, in the base's framework; without it theory took ``mutant:...@torch.ddp``
    for a one-device run and predicted (and mapped away) exactly the weighting bug it carries."""
    from parity_tests.judging.theory import is_parallel
    from parity_tests.protocol.engine import declared

    register_mutants()
    for name, base, parallel in [("mutant:weighting_flipped@torch.ddp", "torch.ddp", True),
                                 ("mutant:next_batch@tf.single", "tf.single", False)]:
        spec = declared(name)
        assert spec is not None and spec.name == name and spec.kind == "plugin"
        assert (spec.framework, spec.parallel, is_parallel(name)) == (resolve(base).framework, parallel, parallel)


def test_torch_side_does_not_import_tensorflow():
    imported = set()
    for node in ast.walk(ast.parse(TORCH.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"tensorflow", "tfpar", "keras"}


# ---------------------------------------------------------------- the corpus' premise (runs)

REWRITES = [tf("add_n"), tf("stack_mean"), tf("concat_loss"), tf("add_n_nograds"), torch("ddp"),
            torch("hand_allreduce")]


def _judge(case, impls, bug=None):
    register_mutants()
    for name in impls:
        resolve(name)
    return compare_case(case, impls, runner=mutated_runner(bug), stages=False)


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("opt", [
    {"name": "adam", "lr": 0.05, "semantics": "torch", "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    {"name": "momentum", "lr": 0.1, "semantics": "tf", "momentum": 0.9},
], ids=["adam-torch", "momentum-tf"])
def test_rewrites_are_at_parity_with_the_builtins(opt):
    """Uneven shards weighted by size, a clip of 0.5 after the combine: every rewrite computes what torch.ddp does."""
    case = make(MLP, **BASE, optimizer=opt, parallel__clip={"global_norm": 0.5, "where": "after_combine"})
    result = _judge(case, ["torch.ddp", "tf.towers", *REWRITES])
    for p in result.pairs:
        assert p.verdict.status == "parity", f"{p.impl}: {p.verdict.status}\n{p.verdict.detail}"


@pytest.mark.usefixtures("pool")
def test_one_device_and_keras_rewrites_are_at_parity():
    """torch_side.single against torch.single; the Keras model and optimizer against tf.towers (both Keras)."""
    sgd = {"name": "momentum", "lr": 0.05, "semantics": "native", "momentum": 0.9}
    single = _judge(make(MLP, **BASE, optimizer=sgd), ["torch.single", torch("single")]).pairs[0].verdict
    assert single.status == "parity", single.detail
    keras = _judge(make(MLP, **BASE, optimizer=sgd), ["tf.towers", tf("keras_model")]).pairs[0].verdict
    assert keras.status == "parity", keras.detail


# 4 devices, 16 rows: even contiguous slices, as model.fit under MirroredStrategy cuts them
EVEN = {**BASE, "data__global_batch": 16, "parallel__weighting": "equal"}


@pytest.mark.usefixtures("pool")
def test_schedule_rewrites_read_it_as_their_framework_does():
    """The truth's premise for warmup_cosine under native, simply run in float64 (no judge): Keras' optimizer with
    CosineDecay (keras_model) agrees with tf.towers, the written-out rule (the curve) and torch's schedulers
    (SequentialLR, LambdaLR) with torch.ddp, to the float64 bound (SGD: one rule); Keras differs from them by far
    more (one step late: step 1 at rate 0). Then momentum under tf semantics with a floor (the curve and Keras'
    rule on every side): all agree."""
    opt = {"name": "sgd", "lr": 0.05, "semantics": "native", "schedule": COSINE}
    case = make(MLP, **{**BASE, "steps": 4}, optimizer=opt)
    names = ["tf.towers", tf("keras_model"), "torch.ddp", tf("add_n"), torch("ddp"), torch("hand_allreduce")]
    for name in names:
        resolve(name)
    runs = {n: run_impl(case, n) for n in names}
    assert _gap(runs["tf.towers"], runs[tf("keras_model")]) <= 1e-10
    for n in names[3:]:
        assert _gap(runs["torch.ddp"], runs[n]) <= 1e-10, n
    assert _gap(runs["tf.towers"], runs["torch.ddp"]) > 1e-3
    same = make(MLP, **{**BASE, "steps": 4}, optimizer={**opt, "name": "momentum", "momentum": 0.5, "semantics": "tf",
                                                        "schedule": {**COSINE, "min_lr": 0.005}})
    ref = run_impl(same, "tf.towers")
    for n in (tf("add_n"), "torch.ddp", torch("ddp")):
        assert _gap(ref, run_impl(same, n)) <= 1e-10, n


@pytest.mark.usefixtures("pool")
def test_keras_cosine_decay_against_a_tensorflow_rule_written_out_is_the_expected_lateness():
    """The default hunt's 8 schedule false alarms (docs/error-rates.md): a Keras optimizer (tf.towers, or a plugin's
    own Keras optimizer) against a TensorFlow rule written out on the curve (tf_side's add_n) part by CosineDecay's
    step of lateness, which theory named only between a TensorFlow and a torch side: divergence (and parity where a
    mapping swapped CosineDecay for the curve unnamed). The right verdict is expected_difference, by that name, its
    residual judged with the Keras side run on the curve (semantics tf, exact numbers): parity for the written-out
    rule, divergence for the same rule with a bug behind the lateness (every third step updated twice, the hunt's
    3 misses when no residual was judged); the curve against torch's rule stays parity (SGD: one rule)."""
    opt = {"name": "sgd", "lr": 0.05, "semantics": "native", "schedule": COSINE}
    case = make(MLP, **BASE, optimizer=opt)
    for keras_side in ("tf.towers", tf("keras_model")):
        pair = _judge(case, [keras_side, tf("add_n")]).pairs[0]
        assert pair.verdict.status == "expected_difference", (keras_side, pair.verdict.detail)
        assert "as predicted (warmup_cosine one step late in Keras' CosineDecay)" in pair.verdict.detail
        assert pair.residual is not None and pair.residual.status == "parity", (keras_side, pair.mapping)
        bug = _judge(case, [keras_side, tf("extra_update_on_log_steps")]).pairs[0]
        assert bug.verdict.status == "divergence", (keras_side, bug.verdict.detail)
    assert _judge(case, ["torch.ddp", tf("add_n")]).pairs[0].verdict.status == "parity"


@pytest.mark.usefixtures("pool")
def test_a_stand_in_that_differs_as_predicted_makes_no_divergence():
    """The default hunt of 2adafb3's 13 schedule false alarms: a rule written out (tf_side's stack_mean, its rate on the
    curve) against torch at parity (gap 0), where theory names a possible difference (clip_grad_norm_'s 1e-6) and
    maps it through tf.towers standing in for the plugin. The stand-in ran Keras' CosineDecay, a step late: it parted
    from the plugin at the update, which the stand-in leg called the plugin's own wrong rule, a divergence. Theory
    now knows the plugin's rate is its own (own_schedule): the stand-in runs as the plugin does (on the curve,
    Keras' rule with exact numbers), its leg is at parity, and the residual is judged: parity."""
    opt = {"name": "sgd", "lr": 0.001, "semantics": "native", "schedule": COSINE}
    case = make(MLP, **{**BASE, "steps": 1, "dtype": "float32"}, optimizer=opt,
                parallel__clip={"global_norm": 0.5, "where": "after_combine"})
    pair = _judge(case, [torch("single"), tf("stack_mean")]).pairs[0]
    assert pair.verdict.status == "parity", pair.verdict.detail
    assert "standing in for" in (pair.mapping or "") and pair.residual is not None and pair.residual.status == "parity"
    assert pair.residual_not_judged is None


def test_a_stand_in_leg_that_parts_as_theory_predicts_judges_no_residual():
    """comparison.stand_in_leg: where the stand-in parts from its plugin at the update, the plugin's own rule is
    wrong (a divergence naming it), unless theory predicts that difference between the two (``apart``: e.g. the
    built-in's CosineDecay a step late against the plugin's own rate): then the stand-in is no equivalent run."""
    from parity_tests.judging.verdict import Verdict
    from parity_tests.session.comparison import NOT_EQUIVALENT, SideMapping, stand_in_leg

    m = SideMapping("p.py:own", "torch.ddp", {"optimizer.semantics": "torch"}, "tf.towers")
    parted = Verdict("divergence", "float64 bound", 1e-3, 1e-10, None, None, np.array([]), None, "apart at step 1")
    decides, why = stand_in_leg(parted, lambda: "update", m)
    assert decides is not None and decides.status == "divergence" and why is None
    decides, why = stand_in_leg(parted, lambda: "update", m, "warmup_cosine one step late in Keras' CosineDecay")
    assert decides is None and why.startswith(NOT_EQUIVALENT) and "as predicted (warmup_cosine one step late" in why
    at_parity = Verdict("parity", "float64 bound", 0.0, 1e-10, None, None, np.array([]), None, "")
    assert stand_in_leg(at_parity, lambda: "update", m, "anything") == (None, None)


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize(("a", "b"), [
    (program("keras_fit"), torch("ddp")),
    (program("keras_fit_floatx"), program("keras_fit")),  # set_floatx alone: what a fresh Python runs
    (program("keras_fit_l2"), torch("ddp_l2")),  # a loss term the case cannot express, ported
], ids=["fit-ddp", "floatx-alone", "l2"])
def test_programs_compute_what_their_counterparts_do_in_float64(a, b):
    """The programs' premise, simply run (no judge): the same float64 numbers to the float64 bound. SGD at an
    exact float64 rate 0.05 (not a float32 number: a rounded rate would show at 1e-9)."""
    case = make(MLP, **EVEN, optimizer={"name": "sgd", "lr": 0.05, "semantics": "native"})
    for name in (a, b):
        resolve(name)
    assert _gap(run_impl(case, a), run_impl(case, b)) <= 1e-10


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("loss", ["sigmoid_ce", "mse"])  # mse returns a float32 loss in a float64 graph
def test_v1_losses_reduce_in_float32_inside_a_float64_run(loss):
    """The premise of the TF1 family: its float64 run is not float64 throughout (``tf.compat.v1.losses`` casts
    to float32), so it parts from a float64 run by float32 rounding: more than the float64 bound, well under 1e-5."""
    case = make(MLP, **EVEN, optimizer={"name": "sgd", "lr": 0.05, "semantics": "tf"}, model__loss=loss)
    resolve(program("v1_losses"))
    gap = _gap(run_impl(case, program("v1_losses")), run_impl(case, "tf.towers"))
    assert 1e-10 < gap < 1e-5, gap


@pytest.mark.usefixtures("pool")
def test_v1_losses_runs_adam_in_float64():
    """The first hunt's softmax_ce errors: Adam made inside the control dependency on the logged loss, its slot
    variables' initializers waited on the input placeholder (InvalidArgumentError before step 1)."""
    adam = {"name": "adam", "lr": 0.01, "semantics": "tf", "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}
    case = make(MLP, **{**EVEN, "steps": 2}, optimizer=adam, model__loss="softmax_ce", data__generator="gaussian",
                model__layers=[{"type": "dense", "units": 3}])
    resolve(program("v1_losses"))
    loss = run_impl(case, program("v1_losses"))["loss"]
    assert loss.shape == (2,) and np.all(np.isfinite(loss))


# ---------------------------------------------------------------- one seeded bug of each family


def _bug(name: str, impl: str | None = None):
    return next(b for b in BUGS if b.name == name and (impl is None or b.impl == impl))


FAMILIES = [
    ("grads_summed", None, {}),  # the update
    ("same_shard", None, {}),  # the data each tower reads
    ("clip_per_tower", None, {"parallel__clip": {"global_norm": 1e-6, "where": "after_combine"},
                              "optimizer": {"name": "sgd", "lr": 1.0, "semantics": "tf"}}),
    ("no_allreduce", None, {}),  # DDP replicas out of sync
    ("lr_times_n", "mutant:lr_times_n@torch.ddp", {}),  # a mutated built-in
    ("next_batch", "mutant:next_batch@tf.towers", {}),
]


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize(("name", "impl", "changes"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_seeded_bug_is_a_divergence(name, impl, changes):
    bug = _bug(name, impl)
    case = make(MLP, **{**BASE, "optimizer": {"name": "sgd", "lr": 0.1, "semantics": "torch"}, **changes})
    assert bug.applies(case.spec), f"{name} does not apply to the test's case"
    reference = "tf.single" if bug.base == "torch.ddp" else "torch.ddp"
    v = _judge(case, [reference, bug.impl], bug).pairs[0].verdict
    assert v.status == "divergence", f"{name}: {v.status}\n{v.detail}"


# ---------------------------------------------------------------- drawn pairs: the truth's premises, checked on the runs


def _drawn(kind: str, n: int, at: int) -> list[Pair]:
    out: list[Pair] = []

    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @seed(at)
    @given(pairs(kind, dtypes=("float64",)))
    def collect(p):
        out.append(p)

    collect()
    return out


def _gap(a: dict, b: dict) -> float:
    """The greatest relative difference over the loss and the parameters (denominators floored at 1e-2)."""
    keys = [k for k in a if k == "loss" or k.startswith("param/")]
    return max(float(np.max(np.abs(a[k] - b[k]) / np.maximum(np.maximum(np.abs(a[k]), np.abs(b[k])), 1e-2)))
               for k in keys)


@pytest.mark.usefixtures("pool")
def test_drawn_bugs_change_what_is_computed():
    """Every drawn bug, run beside its correct version in float64, moves the loss or the parameters by more than
    100 times the float64 bound (or puts the DDP replicas out of sync): ``Bug.applies`` keeps its word."""
    for p in _drawn("bug", 6, 11):
        case = p.case()
        register_mutants()
        for name in (p.bug.base, p.bug.impl):
            resolve(name)
        base, buggy = run_impl(case, p.bug.base), mutated_runner(p.bug)(case, p.bug.impl)
        assert getattr(buggy, "findings", None) or _gap(base, buggy) > 1e-8, f"{p.bug.label} on {p.describe()}"


@pytest.mark.usefixtures("pool")
def test_drawn_pairs_the_truth_calls_identical_agree():
    """A drawn float64 pair whose truth is ``parity`` agrees to the float64 bound when simply run (no judge)."""
    checked = 0
    for p in _drawn("equivalent", 8, 12):
        if truth(p.case().spec, BY_NAME[p.reference], BY_NAME[p.impl])[0] != ("parity",):
            continue
        for name in (p.reference, p.impl):
            resolve(name)
        a, b = run_impl(p.case(), p.reference), run_impl(p.case(), p.impl)
        assert _gap(a, b) <= 1e-10, f"{p.reference} vs {p.impl} on {p.describe()}"
        checked += 1
    assert checked >= 3


def test_an_equivalent_pair_whose_float64_runs_both_overflow_is_right_as_an_error():
    """The hunt's pair 976 (2026-11-29): Adam with epsilon 0 divides 0 by 0 at a gradient element that is exactly 0 in
    float64 (NaN from step 1 on both sides), where float32's rounding left the float32 runs finite: the float64 runs,
    the ones the verdict reads first, both undefined, is no parity to find; one side alone is."""
    adam = {"name": "adam", "lr": 0.01, "semantics": "tf", "beta1": 0.9, "beta2": 0.999, "epsilon": 0.0}
    pair = Pair(spec(optimizer=adam), "tf.towers", "torch.ddp")
    finite = {"param/w": np.ones((2, 2)), "loss": np.ones(1)}
    nan = {"param/w": np.array([[1.0, 1.0], [np.nan, np.nan]]), "loss": np.ones(1)}
    assert judgement(pair, "error", finite, finite, nan, nan)[0]
    assert not judgement(pair, "error", finite, finite, nan, finite)[0]  # one side alone: a difference, parity wanted
    assert not judgement(pair, "error", finite, finite)[0]
    assert judgement(pair, "parity", finite, finite, finite, finite)[0]


def test_a_bug_where_nothing_moves_is_right_inconclusive_only_when_nothing_moved():
    """CONTRACT §8: no parameter that moves is inconclusive whatever the logged loss says (a logged-loss bug at
    lr 0 cannot be caught by contract); where the runs did move, inconclusive stays a miss."""
    bug = next(b for b in BUGS if b.name == "last_tower_loss")
    still = spec(optimizer={"name": "sgd", "lr": 0.0})
    pair = Pair(still, "tf.single", bug.impl, bug)
    unmoved = {"param/w": np.ones((3, 2)), "loss": np.ones(2)}
    assert judgement(pair, "inconclusive", unmoved, unmoved)[0]
    assert judgement(pair, "divergence", unmoved, unmoved)[0]  # catching it anyway is never wrong
    assert not judgement(pair, "parity", unmoved, unmoved)[0]
    moved = {"param/w": np.array([[1.0, 1.0], [1.0, 1.0], [1.5, 1.0]]), "loss": np.ones(2)}
    assert not judgement(pair, "inconclusive", unmoved, moved)[0]
    assert not judgement(pair, "inconclusive")[0]  # runs not known: not taken as vacuous
    moving = Pair(spec(optimizer={"name": "sgd", "lr": 0.1}), "tf.single", bug.impl, bug)
    assert not judgement(moving, "inconclusive", unmoved, unmoved)[0]  # the case moves: the judge is asked to see it


def test_a_zero_initialised_bias_moved_below_the_contracts_scale_is_unmoved():
    """The seed-1 hunt's pairs 1064 and 1065 (lr 1e-7 behind a clip of 1e-6): every array within 2e-13 of its start
    but a zero-initialised bias, moved by 1e-14, counted as moved (1e-14 / 0): a relative movement is measured
    against the 1e-2 floor of docs/tolerance.md (d_p), as every relative gap is; 2e-5 of it is movement (above the 1e-5 of STILL)."""
    bug = next(b for b in BUGS if b.name == "last_tower_loss")
    tiny = Pair(spec(optimizer={"name": "momentum", "semantics": "native", "lr": 1e-7, "momentum": 0.5},
                     parallel__clip={"global_norm": 1e-6, "where": "after_combine"}), "tf.single", bug.impl, bug)
    still = {"param/w": np.ones((3, 2)), "param/b": np.array([[0.0], [1e-14], [3e-14]]), "loss": np.ones(2)}
    assert judgement(tiny, "inconclusive", still, still)[0]
    moved = {"param/w": np.ones((3, 2)), "param/b": np.array([[0.0], [1e-7], [2e-7]]), "loss": np.ones(2)}
    assert not judgement(tiny, "inconclusive", still, moved)[0]  # 2e-7 / 1e-2 = 2e-5 > 1e-5: moved


def test_a_dead_network_is_every_gradient_of_both_sides_exactly_zero():
    """The seed-1 hunt's pairs 857, 858: torch.ddp's combined gradient exactly 0 (two one-row devices whose gradients,
    of opposite sign, are each clipped to 1e-6 before the mean) against tf.single's -1e-6 (the full batch clipped):
    the per-device clip's difference, not a dead network; where both sides record only zeros, it is one."""
    sgd = {"name": "momentum", "semantics": "tf", "lr": 0.05, "momentum": 0.9}
    pair = Pair(spec(optimizer=sgd, parallel__devices=2, data__global_batch=2, steps=1,
                     parallel__clip={"global_norm": 1e-6, "where": "per_device"}), "tf.single", "torch.ddp")
    assert "expected_difference" in truth(pair.raw, BY_NAME[pair.reference], BY_NAME[pair.impl])[0]  # the premise
    zero = {"param/w": np.ones((2, 1)), "grad/w": np.zeros((1, 1)), "loss": np.ones(1)}
    live = {"param/w": np.array([[1.0], [1.0 + 1e-6]]), "grad/w": np.full((1, 1), -1e-6), "loss": np.ones(1)}
    assert judgement(pair, "expected_difference", live, zero)[0] and judgement(pair, "expected_difference", zero, live)[0]
    assert judgement(pair, "inconclusive", zero, zero)[0]
    assert not judgement(pair, "expected_difference", zero, zero)[0] and not judgement(pair, "parity", zero, zero)[0]
    assert not judgement(pair, "divergence", live, zero)[0]


def test_a_bug_on_a_dead_network_is_right_inconclusive_only_where_both_sides_record_zeros_and_nothing_moved():
    """The 10,000-pair run's s6-1283: reduction_flipped@tf.towers against tf.single on a dead ReLU network (every
    gradient both sides record exactly zero, the correct reference's too): no parameter moves, CONTRACT §8 makes it
    inconclusive whatever the (flipped) logged loss says, as for the equivalent pairs on such a network (the truth's
    dead-reference clause, ``corpus._dead``). Where the reference records a nonzero gradient or a parameter moves,
    inconclusive stays a miss."""
    bug = next(b for b in BUGS if b.name == "reduction_flipped" and b.base == "tf.towers")
    pair = Pair(spec(optimizer={"name": "sgd", "lr": 0.1}), "tf.single", bug.impl, bug)  # a case that moves
    zero = {"param/w": np.ones((2, 1)), "grad/w": np.zeros((1, 1)), "loss": np.ones(1)}
    live = {"param/w": np.array([[1.0], [1.0 + 1e-3]]), "grad/w": np.full((1, 1), -1e-2), "loss": np.ones(1)}
    assert judgement(pair, "inconclusive", zero, zero)[0]
    assert judgement(pair, "divergence", zero, zero)[0]  # catching it anyway is never wrong
    assert not judgement(pair, "expected_difference", zero, zero)[0] and not judgement(pair, "parity", zero, zero)[0]
    assert not judgement(pair, "inconclusive", zero, live)[0] and not judgement(pair, "inconclusive", live, zero)[0]
    moved = {**zero, "param/w": np.array([[1.0], [1.5]])}  # zeros recorded, yet a parameter moved: not vacuous
    assert not judgement(pair, "inconclusive", zero, moved)[0]


def test_a_logged_loss_bug_beside_a_dead_reference_is_right_inconclusive_only_where_nothing_moves():
    """The 10,000-pair run's s2-1127 and s4-1104: a loss-only bug (no ``grads=``) against a correct reference whose
    every recorded gradient is exactly 0 at every step, nothing moving on either side: CONTRACT §8 makes the pair
    ``inconclusive`` (every gradient zero) whatever the logged loss says, as at lr 0, so the case leaves the bug
    unseen. Not where the reference records no gradient (nothing says the network is dead), records one that is
    not 0, or where a side moved (the bug's side training: something was compared)."""
    bug = next(b for b in BUGS if b.name == "last_rank_loss")
    pair = Pair(spec(optimizer={"name": "sgd", "semantics": "tf", "lr": 0.001}, parallel__devices=2), "tf.towers",
                bug.impl, bug)
    dead = {"param/w": np.ones((3, 2)), "grad/w": np.zeros((2, 2)), "loss": np.array([1.0, 1.0])}
    logged = {"param/w": np.ones((3, 2)), "loss": np.array([1.3, 1.3])}  # the bug's side: its own loss, no grads=
    right, why = judgement(pair, "inconclusive", dead, logged)
    assert right and why.startswith("nothing moves on either side"), why  # counted apart, with lr 0's
    assert judgement(pair, "divergence", dead, logged)[0]  # catching it anyway is never wrong
    assert not judgement(pair, "parity", dead, logged)[0] and not judgement(pair, "expected_difference", dead, logged)[0]
    live = {**dead, "grad/w": np.array([[0.0, 0.0], [1e-3, 0.0]])}
    assert not judgement(pair, "inconclusive", live, logged)[0]
    unrecorded = {k: v for k, v in dead.items() if k != "grad/w"}
    assert not judgement(pair, "inconclusive", unrecorded, logged)[0]
    moving = {**logged, "param/w": np.array([[1.0, 1.0], [1.0, 1.0], [1.5, 1.0]])}
    assert not judgement(pair, "inconclusive", dead, moving)[0]


def test_a_bug_whose_correct_reference_overflows_too_is_right_as_an_error():
    """The seed-1 hunt's pairs 1161-1163: ``next_batch@torch.ddp`` against ``tf.single`` under Adam with epsilon 0,
    where the correct reference (and the clean torch.ddp) divide 0 by 0 at a dead unit's gradient from step 1 on
    in float64, as the mutant does: the case leaves nothing to compare, so ``error`` is no miss. One side alone
    non-finite is a difference the judge must report (a divergence): ``error`` stays a miss there."""
    bug = next(b for b in BUGS if b.name == "next_batch" and b.base == "torch.ddp")
    adam = {"name": "adam", "lr": 1.0, "semantics": "tf", "beta1": 0.9, "beta2": 0.999, "epsilon": 0.0}
    pair = Pair(spec(optimizer=adam), "tf.single", bug.impl, bug)
    finite = {"param/w": np.ones((3, 2)), "loss": np.ones(2)}
    nan = {"param/w": np.array([[1.0, 1.0], [np.nan, 1.0], [np.nan, np.nan]]), "loss": np.array([1.0, np.nan])}
    assert judgement(pair, "error", nan, nan)[0] and judgement(pair, "inconclusive", finite, finite, nan, nan)[0]
    assert judgement(pair, "divergence", nan, nan)[0]  # catching it anyway is never wrong
    assert not judgement(pair, "parity", nan, nan)[0] and not judgement(pair, "expected_difference", nan, nan)[0]
    assert not judgement(pair, "error", finite, nan)[0]  # the bug's side alone: the bug overflowed, not the case
    assert not judgement(pair, "error", nan, finite)[0]  # the reference alone: the bug changed what is computed
    assert not judgement(pair, "error", finite, finite, nan, finite)[0]
    assert not judgement(pair, "error")[0]  # runs not known: not taken as overflowing


def test_both_runs_overflowing_allow_the_difference_certain_at_step_1():
    """Both runs NaN after step 1's update: step 1's loss, computed before it, shows a certain difference."""
    adam = {"name": "adam", "lr": 1.0, "semantics": "tf", "beta1": 0.9, "beta2": 0.999, "epsilon": 0.0}
    nan = {"param/w": np.array([[1.0], [np.nan]]), "loss": np.ones(1)}
    summed = Pair(spec(optimizer=adam, model__reduction="sum"), "torch.single", tf("add_n_nograds"))
    assert differences(summed.raw, BY_NAME[summed.reference], BY_NAME[summed.impl])[0]  # the premise: one is certain
    assert judgement(summed, "expected_difference", nan, nan)[0] and judgement(summed, "error", nan, nan)[0]
    assert not judgement(summed, "divergence", nan, nan)[0] and not judgement(summed, "parity", nan, nan)[0]
    same = Pair(spec(optimizer=adam), "tf.towers", "torch.ddp")
    assert not differences(same.raw, BY_NAME[same.reference], BY_NAME[same.impl])[0]
    assert not judgement(same, "expected_difference", nan, nan)[0] and judgement(same, "inconclusive", nan, nan)[0]


def test_truth_reads_keras_adam_epsilon_as_its_rule_scales_it():
    """Keras' Adam is torch's with epsilon ``eps / sqrt(1 - beta2^t)`` (1000 eps at step 1 for beta2 = 0.999999):
    the 10,000-pair run's s3-0876/0877 (two written-out Keras rules, lr 10, eps 1, a clip of 1e-6 reached) move
    1e-8 a step, nothing in float32: ``inconclusive`` allowed. The same case under torch's rule moves 1e-5 a step
    (``lr |g| / eps``) and must be judged."""
    adam = {"name": "adam", "lr": 10.0, "beta1": 0.999999, "beta2": 0.999999, "epsilon": 1.0}
    clip = {"global_norm": 1e-6, "where": "after_combine"}
    a, b = BY_NAME[tf("add_n")], BY_NAME[tf("stack_mean")]
    keras = spec(dtype="float32", optimizer={**adam, "semantics": "native"}, parallel__clip=clip, steps=4)
    assert truth(keras, a, b)[0] == ("parity", "inconclusive")
    torch_rule = spec(dtype="float32", optimizer={**adam, "semantics": "torch"}, parallel__clip=clip, steps=4)
    assert truth(torch_rule, a, b)[0] == ("parity",)
    # beta2 = 0: epsilon as it is under both rules (the estimate as before)
    assert truth(spec(dtype="float32", optimizer={**adam, "beta2": 0.0, "semantics": "native"}, parallel__clip=clip,
                      steps=4), a, b)[0] == ("parity",)


def test_per_device_clipped_gradients_that_cancel_on_both_sides_are_inconclusive_only_when_nothing_moved():
    """The 10,000-pair run's s3-0801/0803: one weight, two devices of one row, their gradients of opposite sign each
    clipped to 1e-6 before the mean: 0 in exact arithmetic, no parameter moves on either side, ``inconclusive``
    right (CONTRACT §8). Where a side moved, or the clip is after the combine, it stays wrong."""
    sgd = {"name": "sgd", "semantics": "native", "lr": 0.05}
    raw = spec(optimizer=sgd, parallel__devices=2, data__global_batch=2, steps=1,
               parallel__clip={"global_norm": 1e-6, "where": "per_device"})
    pair = Pair(raw, "tf.towers", "torch.ddp")
    assert "inconclusive" not in truth(raw, BY_NAME["tf.towers"], BY_NAME["torch.ddp"])[0]  # the estimate: it moves
    unmoved = {"param/w": np.array([[0.0125], [0.0125 + 1e-24]]), "grad/w": np.full((1, 1), 1e-22), "loss": np.ones(1)}
    moved = {"param/w": np.array([[0.0125], [0.0125 - 5e-8]]), "grad/w": np.full((1, 1), 1e-6), "loss": np.ones(1)}
    assert judgement(pair, "inconclusive", unmoved, unmoved)[0] and judgement(pair, "parity", unmoved, unmoved)[0]
    assert not judgement(pair, "inconclusive", unmoved, moved)[0]
    assert not judgement(pair, "inconclusive")[0]  # runs not known: not taken as cancelled
    after = Pair(spec(optimizer=sgd, parallel__devices=2, data__global_batch=2, steps=1,
                      parallel__clip={"global_norm": 1e-6, "where": "after_combine"}), "tf.towers", "torch.ddp")
    assert not judgement(after, "inconclusive", unmoved, unmoved)[0]
