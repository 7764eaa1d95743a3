"""Which run stands for which, and what each run's optimizer held (``session.comparison``, ``judging.theory``).

Issue 35's false alarms on correct code, each with the pair where the same rule must still find
a real difference:

* the roundings a mapping reproduces are read from the run that decides (a float32 case's float64
  run), under every semantics that runs Keras' rule;
* a TensorFlow plugin that writes its rule out (no optimizer class) is not predicted to differ by
  the frameworks' classes, and a DDP job whose replicas differ is a divergence whatever theory
  predicted;
* a residual is judged only through a stand-in shown to compute what the plugin computes;
* a float64 run whose loss is computed in float32 (``judging.precision_leak``) is named, and a
  float32 case's loss channel is then judged at the float32 noise.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from parity_tests.judging.precision_leak import loss_in_float32
from parity_tests.session.comparison import NOT_EQUIVALENT, compare_case
from parity_tests.tests.helpers import MLP, make

PLUGINS = Path(__file__).parent / "plugins"
TF, TORCH = f"{PLUGINS / 'mapping_tf.py'}", f"{PLUGINS / 'mapping_torch.py'}"
JUDGE_TF, JUDGE_TORCH = f"{PLUGINS / 'judge_tf.py'}", f"{PLUGINS / 'judge_torch.py'}"
#: lr 0.001 is not exact in float32: |float32(0.001) - 0.001| / 0.001 = 2.8e-8, far above the float64 bound
ADAM = {"name": "adam", "lr": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-3}


def _pairs(case, impls):
    r = compare_case(case, impls)
    return {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()


# ------------------------------------------------------------------ roundings read from the deciding run


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_keras_recipe_is_mapped_as_its_float64_run_held_it(dtype):
    """docs/plugins.md's recipe holds Adam's lr in float64 in its float64 run: mapped so (floatx_float64), never
    as its float32 run's float32 lr (was: a float32 case's divergence 2.81e-8). The same pair with the torch
    port's weight decay seeded on every parameter is still a divergence."""
    case = make(MLP, dtype=dtype, parallel__devices=4, optimizer=ADAM)
    pairs, summary = _pairs(case, [f"{TF}:keras_recipe", f"{JUDGE_TORCH}:native", "tf.towers",
                                   f"{JUDGE_TORCH}:decay_on_every_parameter"])
    assert pairs["native"].verdict.status == "expected_difference", summary
    assert "optimizer.keras_rounding floatx_float64" in pairs["native"].mapping, summary
    assert pairs["native"].residual.status == "parity", summary
    # tf.towers holds Keras' default (float32 lr): the known difference, mapped, at parity
    assert pairs["tf.towers"].verdict.status == "parity", summary
    assert pairs["decay_on_every_parameter"].verdict.status == "divergence", summary


@pytest.mark.usefixtures("pool")
def test_keras_defaults_are_mapped_as_float32_in_a_float32_case():
    """Must not fire: a plugin that makes Keras' Adam under the default floatx holds lr in float32 in its
    float64 run too, and the mapping says so."""
    case = make(MLP, dtype="float32", parallel__devices=4, optimizer=ADAM)
    pairs, summary = _pairs(case, [f"{JUDGE_TF}:keras_towers_grads", f"{JUDGE_TORCH}:native"])
    assert pairs["native"].verdict.status == "expected_difference", summary
    assert "optimizer.keras_rounding floatx_float32" in pairs["native"].mapping, summary


@pytest.mark.usefixtures("pool")
def test_keras_roundings_are_mapped_under_semantics_tf():
    """``semantics: tf``: the built-ins run Keras' rule with exact numbers, the Keras-class plugin holds the
    betas of its bias correction in float32 (was: divergence 3.9e-6, unmapped); against a Keras class made
    under floatx float32 (lr float32 too) the same."""
    case = make(MLP, dtype="float64", parallel__devices=4, optimizer=dict(ADAM, semantics="tf"))
    pairs, summary = _pairs(case, ["tf.towers", f"{TF}:keras_recipe", f"{JUDGE_TF}:keras_towers_grads", "torch.ddp"])
    for name in ("keras_recipe", "keras_towers_grads"):
        assert pairs[name].verdict.status == "parity", summary
        assert pairs[name].mapping and "optimizer.keras_rounding" in pairs[name].mapping, summary
    assert pairs["torch.ddp"].verdict.status == "parity" and pairs["torch.ddp"].mapping is None, summary


# ------------------------------------------------------------------ the rule each run follows; replicas


@pytest.mark.usefixtures("pool")
def test_a_rule_written_out_is_not_predicted_and_replicas_that_differ_are_a_divergence():
    """A TensorFlow plugin with torch's AdamW by hand against torch's AdamW under DDP: no Keras-against-torch
    difference is predicted (it made no optimizer class), and the correct port is at parity. The DDP program
    that never all-reduces is a divergence by ``replicas in sync`` (was: expected_difference "as predicted
    (AdamW epsilon placement)", exit 0)."""
    case = make(MLP, dtype="float64", parallel__devices=2,
                optimizer={"name": "adamw", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-3,
                           "weight_decay": 0.01})
    pairs, summary = _pairs(case, [f"{TF}:own_adamw", f"{TORCH}:adamw", f"{TORCH}:adamw_unwrapped"])
    assert pairs["adamw"].verdict.status == "parity", summary
    assert not pairs["adamw"].prediction.expected, summary
    assert any("made no Keras or tf.compat.v1 optimizer" in a for a in pairs["adamw"].prediction.absent), summary
    bad = pairs["adamw_unwrapped"]
    assert bad.verdict.status == "divergence" and bad.verdict.rule == "replicas in sync", summary


@pytest.mark.usefixtures("pool")
def test_a_rule_written_out_that_is_its_frameworks_class_is_predicted_as_the_class():
    """The same written-out plugin, with Keras' AdamW by hand (eps added to sqrt(v)): its float64 run is at
    parity with tf.towers running Keras' AdamW with exact numbers, so its rule is read as Keras' class's, and
    against torch's AdamW the epsilon placement is predicted and mapped (``comparison.follows_its_class``; was:
    divergence, "its update rule is its own code's"). The torch-rule plugin of the test above parts from Keras'
    class at the first update and stays its own (parity there)."""
    case = make(MLP, dtype="float64", parallel__devices=2,
                optimizer={"name": "adamw", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-3,
                           "weight_decay": 0.01})
    pairs, summary = _pairs(case, [f"{TORCH}:adamw", f"{TF}:own_keras_adamw", f"{TF}:own_adamw"])
    keras = pairs["own_keras_adamw"]
    assert keras.verdict.status == "expected_difference", summary
    assert any("epsilon placement" in d for d in keras.prediction.expected), summary
    assert keras.residual is not None and keras.residual.status == "parity", summary
    torch_rule = pairs["own_adamw"]
    assert torch_rule.verdict.status == "parity" and not torch_rule.prediction.expected, summary


@pytest.mark.usefixtures("pool")
def test_a_torch_plugin_is_predicted_by_the_optimizer_its_run_made():
    """``torchref.torch_seen``: a DDP port that writes Keras' Adam out (no torch.optim class) against Keras' Adam
    (tf.towers) under ``native`` is at parity: no epsilon placement is predicted for it, only Keras' float32
    roundings, mapped onto tf.towers as Keras' rule with exact numbers (was: predicted as torch's Adam, mapped to
    torch's rule: a divergence). The port with ``torch.optim.Adam`` still gets the predicted difference, mapped,
    at parity; the one made without the case's epsilon is not taken for the case's rule: a divergence."""
    case = make(MLP, dtype="float64", parallel__devices=2, optimizer=ADAM)
    pairs, summary = _pairs(case, ["tf.towers", f"{TORCH}:keras_adam_by_hand", f"{TORCH}:adam",
                                   f"{TORCH}:adam_default_eps"])
    by_hand = pairs["keras_adam_by_hand"]
    assert by_hand.verdict.status == "parity", summary
    assert not by_hand.prediction.expected, summary
    assert any("made no torch.optim optimizer" in a for a in by_hand.prediction.absent), summary
    assert by_hand.mapping and "optimizer.keras_rounding none" in by_hand.mapping, summary
    torch_adam = pairs["adam"]
    assert torch_adam.verdict.status == "expected_difference", summary
    assert any("epsilon" in d.lower() for d in torch_adam.prediction.expected), summary
    assert torch_adam.residual.status == "parity", summary
    wrong = pairs["adam_default_eps"]
    assert wrong.verdict.status == "divergence", summary
    assert any("eps=1e-08" in a for a in wrong.prediction.absent), summary


# ------------------------------------------------------------------ mapping only through equivalent runs


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_stand_in_that_is_another_program_judges_no_residual(dtype):
    """Both sides add an L2 term no case field expresses (the TF2 custom-loop tutorial's kernel regularizers):
    torch.ddp, standing in for the torch port, trains without it, so its mapped run is no residual of the pair
    (was: "with it mapped ... divergence"). The pair is the predicted epsilon placement, said with "residual
    not judged: no equivalent run" in the line and in report.json; the port with the L2 factor doubled parts
    at the loss of step 1, before any optimizer difference can: a divergence."""
    case = make(MLP, dtype=dtype, parallel__devices=2, optimizer=ADAM)
    r = compare_case(case, [f"{TF}:keras_l2", f"{TORCH}:adam_l2", f"{TORCH}:adam_l2_doubled",
                            f"{TORCH}:adam_l2_default_eps"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    faithful, doubled = pairs["adam_l2"], pairs["adam_l2_doubled"]
    assert faithful.verdict.status == "expected_difference", summary
    assert faithful.residual is None and faithful.residual_not_judged.startswith(NOT_EQUIVALENT), summary
    assert NOT_EQUIVALENT in summary
    assert faithful.to_dict()["residual_not_judged"].startswith(NOT_EQUIVALENT)
    assert doubled.verdict.status == "divergence", summary
    assert doubled.localisation["first_bad_step"] == 1 and doubled.localisation["stage"] in ("loss", "record"), summary
    # the same port making torch.optim.Adam without the case's epsilon (torchref.torch_seen): its rule is not torch's
    # for the case, so no epsilon placement is predicted to explain its update (was: expected_difference, as the
    # equivalent run that would have shown it is missing)
    eps = pairs["adam_l2_default_eps"]
    assert eps.verdict.status == "divergence", summary
    assert not eps.prediction.expected, summary
    assert any("eps=1e-08" in a and "not torch's for the case's optimizer" in a for a in eps.prediction.absent), summary


@pytest.mark.usefixtures("pool")
def test_a_stand_in_that_parts_at_the_logged_loss_alone_decides_the_residual():
    """A DDP port that logs its batch's loss after the update (the hunt's ``loss_after_update_torch``, pairs 1026
    and 1027) against one device, ``sum`` reduction: the predicted difference (2 devices average per-device sums)
    maps only onto the DDP side, a plugin, so through its stand-in torch.ddp, which agrees with it on every
    parameter at every step and parts only at the logged loss: the stand-in trains as it does and the plugin
    logs the wrong loss, a divergence on the loss naming it (was: expected_difference, "residual not judged: no
    equivalent run", the predicted difference hiding the bug). The port that logs the loss it trains on:
    expected_difference, its residual judged at parity."""
    case = make(MLP, dtype="float64", parallel__devices=2, model__reduction="sum", optimizer=ADAM)
    pairs, summary = _pairs(case, ["torch.single", f"{TORCH}:adam", f"{TORCH}:adam_loss_after_update"])
    assert pairs["adam"].verdict.status == "expected_difference", summary
    assert pairs["adam"].residual.status == "parity" and pairs["adam"].residual_not_judged is None, summary
    after = pairs["adam_loss_after_update"]
    assert after.verdict.status == "divergence" and after.verdict.key == "loss", summary
    assert after.residual_not_judged is None, summary
    assert "only the logged loss differs" in after.verdict.detail, summary


def test_the_stand_in_leg_decides_a_loss_only_parting_unless_the_loss_is_float32():
    """Unit (``mapping.stand_in_leg``): a divergence where the stand-in and its plugin part at the logged loss
    alone (stage ``record``) decides, naming the plugin; not where a float64 run of the two computes its loss in
    float32 (``leaky``: float32 rounding on the loss is no wrong loss), nor where they part at the loss and the
    parameters follow (``loss``: a loss term the case cannot express, no equivalent run)."""
    from parity_tests.judging.verdict import Verdict
    from parity_tests.session.mapping import SideMapping, stand_in_leg

    m = SideMapping("p.py:logs", "tf.towers", {"optimizer.semantics": "tf"}, "torch.ddp")
    parted = Verdict("divergence", "float64 bound", 0.5, 1e-10, "loss", 1, np.array([]), 1, "loss apart at step 1")
    decides, why = stand_in_leg(parted, lambda: "record", m)
    assert why is None and decides.status == "divergence" and "p.py:logs logs a loss other than" in decides.detail
    decides, why = stand_in_leg(parted, lambda: "record", m, leaky=True)
    assert decides is None and why.startswith(NOT_EQUIVALENT)
    decides, why = stand_in_leg(parted, lambda: "loss", m)
    assert decides is None and why.startswith(NOT_EQUIVALENT)
    # the vacuity rule's inconclusive (nothing moves) shows no equivalence, whatever the loss does
    idle = dataclasses.replace(parted, status="inconclusive")
    assert stand_in_leg(idle, lambda: "record", m)[0] is None


def test_the_stand_in_leg_decides_a_parting_before_the_update_where_the_other_side_computes_the_case():
    """Unit (``mapping.stand_in_leg``'s ``computes``): a divergence where the stand-in and its plugin part before the
    update (the loss, the combined gradient, the clip) decides, naming the plugin, where the other side is shown to
    compute the case as given; not where nothing shows it (``computes`` None: a loss term on both sides), where a
    float64 run computes its loss in float32 (``leaky``), where theory predicts the two apart (``apart``), nor on an
    inconclusive or error leg (no showing either way)."""
    from parity_tests.judging.verdict import Verdict
    from parity_tests.session.mapping import CASE_COMPUTED, SideMapping, stand_in_leg

    m = SideMapping("p.py:by_size_ignored", "torch.single", {"parallel.weighting": "sum"}, "torch.ddp")
    parted = Verdict("divergence", "float64 bound", 0.5, 1e-10, "loss", 1, np.array([]), 1, "loss apart at step 1")
    says = "torch.single is a built-in: it computes the case as given"
    for stage in ("inputs", "loss", "combined_grads", "clip"):
        decides, why = stand_in_leg(parted, lambda s=stage: s, m, computes=says)
        assert why is None and decides.status == "divergence", stage
        assert CASE_COMPUTED in decides.detail and "p.py:by_size_ignored does not compute the case" in decides.detail
    assert stand_in_leg(parted, lambda: "loss", m)[0] is None  # nothing shows the other side computes the case
    for stage in ("state", None):  # after the update (the optimizer's slots), or no stage found: not shown before it
        decides, why = stand_in_leg(parted, lambda s=stage: s, m, computes=says)
        assert decides is None and why.startswith(NOT_EQUIVALENT), stage
    decides, why = stand_in_leg(parted, lambda: "loss", m, leaky=True, computes=says)
    assert decides is None and why.startswith(NOT_EQUIVALENT)
    decides, why = stand_in_leg(parted, lambda: "loss", m, apart="warmup_cosine one step late", computes=says)
    assert decides is None and why.startswith(NOT_EQUIVALENT)
    for status in ("inconclusive", "error"):
        assert stand_in_leg(dataclasses.replace(parted, status=status), lambda: "loss", m, computes=says)[0] is None
    assert stand_in_leg(dataclasses.replace(parted, status="parity"), lambda: "loss", m, computes=says) == (None, None)


def test_a_stand_in_whose_float64_runs_move_and_agree_is_an_equivalent_run_where_float32_moves_nothing():
    """Unit (``rules.vacuity.Vacuity``, ``mapping.stand_in_leg``): the 10,000-pair run's s6-0459 (keras_model
    against concat_loss, Adam lr 1e-7, float32): the stand-in leg moves nothing beyond the float32 noise
    (inconclusive) while its float64 runs move by 2.5e-7 and agree: that is a showing (the mapping changes what the
    float64 runs compute), and the residual is judged. Float64 runs that part, or that move nothing either, show
    nothing."""
    from parity_tests.judging.rules import Vacuity
    from parity_tests.judging.rules.context import PairRuns, Side
    from parity_tests.judging.rules.float32_floor import judge_float32
    from parity_tests.session.mapping import SideMapping, stand_in_leg

    m = SideMapping("p.py:keras", "tf.towers", {"optimizer.keras_rounding": "none"}, "p.py:concat")
    p0 = np.array([[0.4, -0.3]])
    loss = np.array([0.7])

    def leg(step64: float, gap64: float):
        a64 = {"param/w": np.concatenate([p0, p0 * (1 + step64)]), "loss": loss}
        b64 = {"param/w": np.concatenate([p0, p0 * (1 + step64 + gap64)]), "loss": loss}
        a32 = {k: v.astype(np.float32) for k, v in a64.items()}
        b32 = {k: v.astype(np.float32) for k, v in b64.items()}
        pair = PairRuns("float32", Side(a32, a64), Side(b32, b64), "float64")
        return Vacuity().judge(pair, judge_float32(a32, b32, a64=a64, b64=b64))

    shown = leg(2.5e-7, 0.0)          # float32: moves by less than its noise; float64: moves, agrees
    assert shown.status == "inconclusive" and shown.float64_runs is not None
    assert stand_in_leg(shown, lambda: "update", m) == (None, None)
    idle = leg(0.0, 0.0)                 # nothing moves in float64 either: no showing
    assert idle.status == "inconclusive" and idle.float64_runs is None
    decides, why = stand_in_leg(idle, lambda: "update", m)
    assert decides is None and why.startswith(NOT_EQUIVALENT)
    parted = leg(2.5e-7, 1e-9)           # the float64 runs part (1e-9 > 1e-10): the float64 rule's divergence
    assert parted.status == "divergence" and parted.float64_runs is None
    assert stand_in_leg(parted, lambda: "update", m) != (None, None)


# ------------------------------------------------------------------ precision leaks: a float64 run's float32 loss

#: 8 rows a tower: tf.compat.v1.losses' float32 mean divides by 8, exact, so only the logged loss holds float32
#: rounding (its gradient is exact) and the parameters of the two sides agree in float64
V1 = dict(data__global_batch=32, parallel__devices=4, optimizer={"name": "sgd", "lr": 0.1})


@pytest.mark.usefixtures("pool")
def test_a_float64_run_whose_loss_is_float32_is_detected_and_judged_at_the_float32_noise():
    """A slim-style loss (tf.compat.v1.losses, float32 inside) against its DDP port, float32 case: parity, with the
    leak named (was: divergence on the logged loss only, 9.3e-9 relative); the same program with a learning rate
    off by 1e-3 on one parameter is still a divergence; the float64 case names the leak in its divergence."""
    case = make(MLP, dtype="float32", **V1)
    pairs, summary = _pairs(case, [f"{JUDGE_TORCH}:native", f"{TF}:v1_losses", f"{TF}:v1_losses_lr_bug", "tf.towers"])
    assert pairs["v1_losses"].verdict.status == "parity", summary
    assert any("the float64 run of" in n and "computes its loss in float32" in n for n in pairs["v1_losses"].notes)
    assert pairs["v1_losses_lr_bug"].verdict.status == "divergence", summary
    assert pairs["v1_losses_lr_bug"].verdict.key.startswith("param/"), summary
    assert pairs["tf.towers"].verdict.status == "parity" and not pairs["tf.towers"].notes, summary
    f64 = compare_case(make(MLP, dtype="float64", **V1), [f"{JUDGE_TORCH}:native", f"{TF}:v1_losses"])
    p = f64.pairs[0]
    assert p.verdict.status == "divergence" and p.verdict.key == "loss", f64.summary()
    assert "computes its loss in float32" in p.verdict.detail, f64.summary()


@pytest.mark.usefixtures("pool")
def test_a_float32_loss_that_its_bits_do_not_show_is_read_from_the_run():
    """6 clones: the clone losses (float32 numbers from tf.compat.v1.losses) times 1/6 in float64 have their low bits
    spread, so the bits alone do not show the leak (the hunt's v1_losses at 5 and 6 clones: divergences at 1.3e-8 and
    2e-8 on the loss, float32 rounding); the run's own record of tf.compat.v1.losses (``tfpar.v1_losses_seen``) does:
    parity with the leak named. The learning rate off by 1e-3 on one parameter is still a divergence."""
    from parity_tests.judging.precision_leak import float32_losses

    case = make(MLP, dtype="float32", data__global_batch=48, parallel__devices=6, optimizer={"name": "sgd", "lr": 0.1})
    r = compare_case(case, [f"{JUDGE_TORCH}:native", f"{TF}:v1_losses", f"{TF}:v1_losses_lr_bug"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    leaky = next(t for k, t in r.trajectories.items() if k.endswith("v1_losses@float64"))
    assert float32_losses(leaky) and not np.all(_low_zero_bits(np.asarray(leaky["loss"])))  # the bits do not show it
    assert pairs["v1_losses"].verdict.status == "parity", summary
    assert any("inside tf.compat.v1.losses.compute_weighted_loss" in n for n in pairs["v1_losses"].notes), summary
    assert pairs["v1_losses_lr_bug"].verdict.status == "divergence", summary


def _low_zero_bits(a: np.ndarray) -> np.ndarray:
    from parity_tests.judging.precision_leak import _short

    return _short(a)


def test_loss_in_float32_reads_the_runs_own_record_first():
    """Unit: a 6-clone mean of float32 numbers, times 1/6 in float64, has float64's low bits: not a leak by its bits,
    a leak when the run recorded a float64 loss reduced in float32 (and not for a record of a float32 one)."""
    from parity_tests.protocol.trajectory import Trajectory

    rng = np.random.default_rng(0)
    clones = rng.random((5, 6)).astype(np.float32).astype(np.float64)
    traj = Trajectory({"loss": (clones * (1.0 / 6)).sum(axis=1), "param/0.kernel": rng.standard_normal((6, 5, 10))})
    assert not loss_in_float32(traj)                                  # the bits alone: missed
    traj.meta["float32_losses"] = [{"what": "tf.compat.v1.losses.compute_weighted_loss", "dtype": "float32"}]
    assert not loss_in_float32(traj)                                  # a float32 loss reduced in float32: no leak
    traj.meta["float32_losses"] = [{"what": "tf.compat.v1.losses.compute_weighted_loss", "dtype": "float64"}]
    assert loss_in_float32(traj)


@pytest.mark.usefixtures("pool")
def test_a_keras_regularizers_float32_factor_is_read_from_the_run_and_judged_at_the_float32_noise():
    """Keras' ``L2(1e-2)`` holds ``float32(1e-2)`` in a float64 run (``ops.cast`` of a Python float), its DDP port
    ``1e-2``: in a float32 case (both float32 runs hold float32(1e-2)) the pair is parity with the constant named
    (was: a divergence on the loss, 1e-9 relative: the factor's rounding times the L2 term, nothing else); the port
    with its factor 1% off is still a divergence; in a float64 case the program does not compute in float64: the
    divergence stands, with the constant named."""
    from parity_tests.judging.precision_leak import float32_constants

    sgd = {"name": "sgd", "lr": 0.1}
    case = make(MLP, dtype="float32", data__global_batch=32, parallel__devices=4, optimizer=sgd)
    pairs, summary = _pairs(case, [f"{TF}:keras_regularized", f"{TORCH}:sgd_l2", f"{TORCH}:sgd_l2_off"])
    named = "keras.regularizers.L2(0.01) as 0.009999999776482582"
    assert pairs["sgd_l2"].verdict.status == "parity", summary
    assert any(named in n for n in pairs["sgd_l2"].notes), summary
    assert pairs["sgd_l2_off"].verdict.status == "divergence", summary
    f64 = compare_case(make(MLP, dtype="float64", data__global_batch=32, parallel__devices=4, optimizer=sgd),
                       [f"{TF}:keras_regularized", f"{TORCH}:sgd_l2"])
    p = f64.pairs[0]
    assert p.verdict.status == "divergence" and p.verdict.key == "loss", f64.summary()
    assert named in p.verdict.detail, f64.summary()
    assert float32_constants(None) == [] and float32_constants({"loss": np.zeros(2)}) == []


def test_loss_in_float32_reads_the_low_bits():
    """Unit: a loss made of float32 numbers (a mean over 4 towers) with float64 parameters is a leak; a float64
    loss, or a run whose parameters are float32 numbers too, is not."""
    rng = np.random.default_rng(0)
    towers = rng.random((5, 4)).astype(np.float32).astype(np.float64)
    params = {"param/0.kernel": rng.standard_normal((6, 5, 10))}
    assert loss_in_float32({"loss": towers.mean(axis=1), **params})
    assert not loss_in_float32({"loss": rng.random(5), **params})
    assert not loss_in_float32({"loss": towers.mean(axis=1),
                                "param/0.kernel": params["param/0.kernel"].astype(np.float32).astype(np.float64)})
    assert not loss_in_float32({"loss": np.zeros(5), **params})  # no bits to read


def test_a_leaky_loss_holds_the_float64_parameters_to_the_float32_noise_too():
    """Unit (judge_float32): tf.compat.v1.losses' float32 cast is differentiated too, so a float64 run whose loss is
    float32 carries float32 rounding into its gradients and parameters (the hunt's 2 v1_losses false alarms at lr 10:
    parameters 7.9e-8 and 1.35e-7 apart, far above the float64 bound, within float32 noise). Its parameters' gap is
    held to the float32 floor: within it parity, above it the float64 divergence stands; without the leak the float64
    rule decides as before."""
    from parity_tests.judging.rules import judge_float32

    rng = np.random.default_rng(1)
    steps = 3
    p64 = rng.standard_normal((steps + 1, 4, 3))
    loss32 = rng.random(steps).astype(np.float32).astype(np.float64)   # float32 numbers: the leak
    loss64 = loss32 * (1 + 1e-13)                                    # the same, with float64's low bits

    def runs(gap: float, leaky: bool) -> dict:
        a64 = {"loss": loss32 if leaky else loss64, "param/w": p64}
        b64 = {"loss": a64["loss"].copy(), "param/w": p64 * (1 + gap)}
        # each side's float32 run: its own float32 rounding (about 6e-8 relative), the floor the float32 rule measures
        a32 = {"loss": a64["loss"].astype(np.float32), "param/w": p64.astype(np.float32)}
        b32 = {"loss": b64["loss"].astype(np.float32), "param/w": b64["param/w"].astype(np.float32)}
        return {"a32": a32, "b32": b32, "a64": a64, "b64": b64}

    def judged(gap: float, leaky: bool):
        r = runs(gap, leaky)
        return judge_float32(r["a32"], r["b32"], a64=r["a64"], b64=r["b64"])

    assert loss_in_float32(runs(0.0, True)["a64"]) and not loss_in_float32(runs(0.0, False)["a64"])
    within = judged(1e-8, leaky=True)      # above the float64 bound (1e-10), below the float32 floor (2 x ~6e-8)
    assert within.status == "parity", within.detail
    assert "held to the float32 noise" in within.detail and "float32's precision" in within.detail
    assert judged(1e-8, leaky=False).status == "divergence"            # no leak: the float64 rule decides
    above = judged(1e-5, leaky=True)                                      # far above float32 noise: a difference
    assert above.status == "divergence" and above.key.startswith("param/"), above.detail


@pytest.mark.usefixtures("pool")
def test_a_stand_in_that_lacks_a_loss_term_is_no_equivalent_run_even_where_nothing_moves():
    """The L2 program's stand-in (tf.towers, no L2 term) parts from it on the loss at step 1 by the L2 term; at
    lr 1e-7 the vacuity rule calls that check inconclusive, which was taken for equivalence: the stand-in's
    mapped leg then made a divergence of its own (the hunt, pair 54: 5.5e-4 on the loss). No residual is
    judged; the pair is resolved as one without a mapping."""
    from parity_tests.contract.case import case_from_dict

    case = case_from_dict({  # the hunt's pair 54, as drawn
        "schema": "parity-case/1", "name": "hunt", "dtype": "float64", "seed": 527,
        "model": {"input_shape": [3], "loss": "mse", "reduction": "mean", "layers": [
            {"type": "dense", "units": 5, "activation": "relu", "use_bias": False},
            {"type": "dense", "units": 4, "activation": "relu", "use_bias": False},
            {"type": "dense", "units": 2, "activation": "none", "use_bias": False}]},
        "init": {"seed": 12, "kind": "normal", "stddev": 0.1}, "data": {"generator": "gaussian", "seed": 275,
                                                                       "global_batch": 5},
        "optimizer": {"name": "adam", "semantics": "native", "lr": 1e-07, "beta1": 0.999999, "beta2": 0.999999,
                      "epsilon": 1.0},
        "parallel": {"devices": 1, "combine": "grad_mean", "shard": "contiguous", "weighting": "equal"}, "steps": 4})
    from parity_tests.running.registry import resolve
    from parity_tests.tests.hunt.corpus import program, torch

    impls = [torch("ddp_l2"), program("keras_fit_l2")]
    for name in impls:
        resolve(name)
    p = compare_case(case, impls, stages=False).pairs[0]
    assert p.verdict.status != "divergence", p.verdict.detail
    assert any(NOT_EQUIVALENT in u for u in p.verdict.unjudged), p.verdict.unjudged


def test_what_theory_expects_between_a_stand_in_and_its_plugin_is_asked_alike_by_both_modes():
    """``mapping.stand_in_apart`` (the free compare's and ``--lockstep``'s ``apart``): tf.towers standing in for a
    TensorFlow program whose rate is its own code's runs Keras' CosineDecay a step late against it under a
    warmup_cosine schedule, so the stand-in parting from it is no fault of the program; with a constant rate
    nothing is expected between them."""
    from parity_tests.running.registry import resolve
    from parity_tests.session.mapping import SideMapping, stand_in_apart
    from parity_tests.tests.hunt.corpus import tf

    plugin = tf("stack_mean")
    resolve(plugin)
    m = SideMapping(plugin, "torch.single", {"optimizer.semantics": "torch"}, "tf.towers")
    cosine = {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 3, "min_lr": 0.0}
    case = make(MLP, dtype="float64", optimizer={"name": "sgd", "lr": 0.01, "semantics": "native", "schedule": cosine})
    apart = stand_in_apart(m, case, case.spec, {}, (plugin,), (plugin,))
    assert apart is not None and "CosineDecay" in apart
    flat = make(MLP, dtype="float64", optimizer={"name": "sgd", "lr": 0.01, "semantics": "native"})
    assert stand_in_apart(m, flat, flat.spec, {}, (plugin,), (plugin,)) is None
    assert stand_in_apart(dataclasses.replace(m, runs_as=plugin), case, case.spec, {}, (plugin,), (plugin,)) is None


# ------------------------------------------------------------------ a mapping made on the plugin itself


def test_a_plugin_is_mapped_on_itself_only_through_case_values_of_its_parallel_set_up():
    """Unit (``mapping.on_itself``): uneven shards with equal weighting maps onto the DDP plugin itself as
    ``parallel.weighting: by_size`` (a case value it may read), and a per-device clip as the clip after the combine;
    not a built-in (it runs mapped itself), not the sum reduction (``weighting: sum``, a value few programs run: its
    ratio is checked instead), and not where another mapped difference is no case value (an optimizer's)."""
    from parity_tests.judging.theory import predict
    from parity_tests.running import registry
    from parity_tests.session.mapping import choose_mapping, on_itself

    def mapped(case, ref, impl):
        for name in (ref, impl):  # declared (what theory reads of a plugin) once resolved
            registry.resolve(name, "impls")
        pred = predict(case.spec, ref, impl)
        m = choose_mapping(case.spec, ref, impl, pred, {})
        return m, on_itself(m, case.spec, pred, {})

    uneven = make(MLP, parallel__devices=5)  # 48 rows on 5 devices, equal weighting
    m, own = mapped(uneven, f"{TORCH}:sgd_l2_single", f"{TORCH}:sgd_l2_weighted")
    assert m.stand_in and own is not None and not own.stand_in and own.itself, own
    assert own.runs_as == f"{TORCH}:sgd_l2_weighted" and own.changes == {"parallel.weighting": "by_size"}
    assert "itself" in own.text
    clip = make(MLP, parallel__devices=4, parallel__clip={"global_norm": 0.1, "where": "per_device"})
    own = mapped(clip, f"{TORCH}:sgd_l2_single", f"{TORCH}:sgd_l2_weighted")[1]
    assert own is not None and own.changes["parallel.clip"]["where"] == "after_combine"
    assert mapped(uneven, f"{TORCH}:sgd_l2_single", "torch.ddp")[1] is None  # a built-in side: no plugin to rerun
    summed = make(MLP, parallel__devices=4, model__reduction="sum")
    assert mapped(summed, f"{TORCH}:sgd_l2_single", f"{TORCH}:sgd_l2_weighted")[1] is None
    adam = make(MLP, parallel__devices=5, optimizer={**ADAM, "semantics": "native"})
    m, own = mapped(adam, f"{TF}:keras_l2", f"{TORCH}:adam_l2")  # Adam's epsilon placement: an optimizer's mapping
    assert m is not None and own is None


@pytest.mark.usefixtures("pool")
def test_a_weighting_ignored_behind_the_sum_reduction_is_a_divergence_where_the_other_side_computes_the_case():
    """The hunt's ``by_size_ignored`` (10,000-pair run: s2-1188, s4-1017, ...): under ``reduction: sum`` with ``by_size``
    weighting on uneven shards (48 rows on 5 devices), a DDP port that takes the plain mean over ranks against one
    device. Theory predicts the sum reduction; its mapping (``weighting: sum``) runs on torch.ddp, standing in, which
    parts from the port at the loss (no equivalent run), and no constant ratio holds (sum_r n_r / B g_r). The other
    side computes the case (torch.single, a built-in; ``sgd_single``, a plugin at parity with torch.single): the
    port computes another program than that case, a divergence (was: expected_difference). The port that honours
    ``by_size`` keeps its expected difference, its residual at parity through the stand-in."""
    case = make(MLP, parallel__devices=5, model__reduction="sum", parallel__weighting="by_size")
    for ref in ("torch.single", f"{TORCH}:sgd_single"):
        pairs, summary = _pairs(case, [ref, f"{TORCH}:sgd", f"{TORCH}:sgd_weighted"])
        right = pairs["sgd_weighted"]
        assert right.verdict.status == "expected_difference", summary
        assert right.residual is not None and right.residual.status == "parity", summary
        bug = pairs["sgd"]
        assert bug.verdict.status == "divergence", summary
        assert "the other side computes the case" in bug.verdict.detail, summary
        assert bug.residual_not_judged is None, summary


@pytest.mark.usefixtures("pool")
def test_lockstep_decides_a_weighting_ignored_behind_the_sum_reduction_against_a_built_in_too():
    """The same ports under ``--lockstep`` against torch.single (a built-in: it computes the case): the port that takes
    the plain mean over ranks parts from torch.ddp at step 1's loss, a divergence at step 1 (was: an expected
    difference at every step); the port that honours ``by_size`` keeps its expected difference."""
    from parity_tests.session.lockstep import lockstep_compare

    case = make(MLP, parallel__devices=5, model__reduction="sum", parallel__weighting="by_size", steps=2)
    result = lockstep_compare(case, ["torch.single", f"{TORCH}:sgd", f"{TORCH}:sgd_weighted"])
    pairs = {p.impl.rsplit(":", 1)[-1]: p for p in result.pairs}
    assert pairs["sgd_weighted"].status == "expected_difference", result.summary()
    bug = pairs["sgd"]
    assert (bug.status, bug.first_bad_step) == ("divergence", 1), result.summary()
    assert "the other side computes the case" in bug.detail, bug.detail


@pytest.mark.usefixtures("pool")
def test_a_loss_term_on_both_sides_behind_the_sum_reduction_keeps_its_residual_unjudged():
    """The same case with an L2 term no case field expresses on both sides (issue 35's ports): the single side is no
    run of the case either (it parts from torch.single), so nothing shows which side computes the case, and the
    port that honours ``by_size`` keeps its expected difference with "residual not judged" (no divergence)."""
    case = make(MLP, parallel__devices=5, model__reduction="sum", parallel__weighting="by_size")
    pairs, summary = _pairs(case, [f"{TORCH}:sgd_l2_single", f"{TORCH}:sgd_l2_weighted"])
    right = pairs["sgd_l2_weighted"]
    assert right.verdict.status == "expected_difference", summary
    assert right.residual is None and right.residual_not_judged.startswith(NOT_EQUIVALENT), summary


def test_what_a_mapping_changes_and_whether_a_rerun_read_it():
    """Unit (``mapping.changed_fields``, ``mapping.reads_mapping``): the clip's mapping changes its ``where`` alone;
    a run that reports what it read of its case read the changed field by name or not at all (its rerun counted
    even where it computes what it did: a tower updating its own copy clips it alike before or after the
    combine), and a run that reports nothing (a runner that is no plugin's harness) counts only where its rerun
    parts from it by the float64 rule."""
    from parity_tests.protocol.trajectory import Trajectory
    from parity_tests.session.mapping import changed_fields, reads_mapping

    spec = make(MLP, parallel__devices=4, parallel__clip={"global_norm": 0.1, "where": "per_device"}).spec
    assert changed_fields(spec, {"parallel.clip": {"global_norm": 0.1, "where": "after_combine"}}) == ["parallel.clip.where"]
    assert changed_fields(spec, {"parallel.weighting": "by_size", "parallel.period": ...}) == ["parallel.weighting"]

    def run(p, seen=None):
        t = Trajectory({"param/w": np.array([[1.0, 2.0], [p, 2.0]]), "loss": np.array([0.5])})
        if seen is not None:
            t.meta["case_read"] = seen
        return t

    fields = ["parallel.clip.where"]
    assert reads_mapping(run(1.5, ["parallel.clip", "parallel.clip.where"]), run(1.5, ["parallel.clip.where"]), fields)
    assert not reads_mapping(run(1.5, ["parallel.clip"]), run(1.7, ["parallel.clip"]), fields)  # parts, read nothing
    assert reads_mapping(run(1.5), run(1.7), fields)  # no record: its rerun parts from it
    assert not reads_mapping(run(1.5), run(1.5), fields)  # no record, the same run: nothing was mapped


@pytest.mark.usefixtures("pool")
def test_a_stand_in_that_is_no_equivalent_run_gives_way_to_the_plugin_rerun_with_the_mapped_case():
    """Issue 35, item 1: DDP ports with an L2 term no case field expresses, against one process with the same term,
    on uneven shards with equal weighting. torch.ddp, standing in for them, trains without the term: no equivalent
    run. The port that reads ``parallel.weighting`` reruns itself with ``by_size``: its residual is judged, at parity
    (expected_difference). The same port summing its shard's loss (the hunt's ``reduction_flipped``, pairs 1084-1086
    of seed 1 on a mutant) still parts with the mapping: a divergence (was: expected_difference, no residual). The
    port that never reads the weighting cannot take the mapping: "residual not judged", saying why."""
    case = make(MLP, parallel__devices=5)  # 48 rows on 5 devices: uneven
    pairs, summary = _pairs(case, [f"{TORCH}:sgd_l2_single", f"{TORCH}:sgd_l2_weighted", f"{TORCH}:sgd_l2",
                                   f"{TORCH}:sgd_l2_weighted_shard_sum"])
    weighted = pairs["sgd_l2_weighted"]
    assert weighted.verdict.status == "expected_difference", summary
    assert weighted.residual is not None and weighted.residual.status == "parity", summary
    assert weighted.residual_not_judged is None and "sgd_l2_weighted itself" in weighted.mapping, summary
    equal = pairs["sgd_l2"]  # the plain mean over ranks: right for equal weighting, and it never reads the weighting
    assert equal.verdict.status == "expected_difference" and equal.residual is None, summary
    assert equal.residual_not_judged.startswith(NOT_EQUIVALENT), summary
    assert "did not read parallel.weighting from its case" in equal.residual_not_judged, summary
    assert any("did not read parallel.weighting" in u for u in equal.verdict.unjudged), summary  # the line says it too
    bug = pairs["sgd_l2_weighted_shard_sum"]
    assert bug.verdict.status == "divergence", summary
    assert "with it mapped" in bug.verdict.detail and "still parts" in bug.verdict.detail, summary
