"""Keras' distribution loss scale in float32 (``session.loss_scale``, ``theory.loss_scale_difference``).

``model.fit`` under ``MirroredStrategy`` of N replicas multiplies each replica's loss by
``keras.ops.cast(1.0 / N, dtype)``, which passes float32: a float64 run's loss, logged loss and
gradients are ``float32(1/N) N`` times the exact ones (``1 + 2^-25`` at N = 3). Checked here at the
smallest size that can fail: the factor is read from the run (3 replicas: float32(1/3); 4: exact);
theory predicts it only where the two sides' factors differ; a correct ``model.fit`` program
against a correct DDP port is ``expected_difference`` with a float64 residual at 3 replicas and
``parity`` at 2, while the same program with a learning rate off by 1e-3 or its loss divided by N
once more is a ``divergence`` at 3.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.judging.theory import LOSS_SCALE, loss_scale_difference, predict
from parity_tests.protocol.hyper import keras_scale_factor
from parity_tests.running.harness import run_impl
from parity_tests.running.registry import resolve
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make
from parity_tests.tests.hunt.corpus import program, torch

THIRD = float(np.float32(1 / 3))  # 0.3333333432674408: keras.ops.cast(1.0 / 3, "float64")
SGD = {"name": "sgd", "lr": 0.05, "semantics": "native"}  # 0.05 is no float32 number: a rounded rate would show


def _case(n: int, dtype: str = "float64", steps: int = 2):
    """N devices, 2 rows each (model.fit's even contiguous slices), 2 steps of SGD on the 5-10-1 MLP."""
    return make(MLP, dtype=dtype, data__global_batch=2 * n, steps=steps, parallel__devices=n,
                parallel__weighting="equal", optimizer=SGD)


# ---------------------------------------------------------------- the factor (no runs)


def test_the_factor_is_float32_one_over_n_times_n_in_float64_only():
    seen = [{"replicas": 3, "dtype": "float64", "factor": THIRD, "exact": False}]
    assert keras_scale_factor(seen) == THIRD * 3 == 1 + 2.0**-25
    assert keras_scale_factor([{**seen[0], "exact": True}]) is None  # the mapped rerun
    assert keras_scale_factor([{**seen[0], "dtype": "float32"}]) is None  # float32 arithmetic's own 1/N
    assert keras_scale_factor([{"replicas": 4, "dtype": "float64", "factor": 0.25, "exact": False}]) is None
    assert keras_scale_factor([]) is None and keras_scale_factor(None) is None


def test_theory_predicts_it_only_where_the_sides_factors_differ():
    spec = _case(3).spec
    for name in ("tf.towers", "torch.ddp"):
        resolve(name)
    d = loss_scale_difference(spec, "tf.towers", "torch.ddp", {"tf.towers": 1 + 2.0**-25})
    assert d is not None and d.expected and d.mapping == LOSS_SCALE and d.stage == "loss"
    assert "scale_loss_for_distribution" in d.text and "float32(1/3)" in d.text
    assert loss_scale_difference(spec, "tf.towers", "torch.ddp", {}) is None
    both = {"tf.towers": 1 + 2.0**-25, "torch.ddp": 1 + 2.0**-25}  # two fit programs scale alike
    assert loss_scale_difference(spec, "tf.towers", "torch.ddp", both) is None
    assert any(x.mapping == LOSS_SCALE for x in predict(spec, "tf.towers", "torch.ddp",
                                                        scales={"torch.ddp": 1 + 2.0**-25}).differences)
    assert not any(x.mapping == LOSS_SCALE for x in predict(spec, "tf.towers", "torch.ddp").differences)


# ---------------------------------------------------------------- read from the run


@pytest.mark.parametrize(("n", "factor"), [(3, THIRD), (4, 0.25)])
def test_a_fit_program_reports_the_factor_keras_applied(n, factor):
    resolve(program("keras_fit"))
    seen = run_impl(_case(n, steps=1), program("keras_fit")).meta["keras_loss_scales"]
    assert seen == [{"replicas": n, "dtype": "float64", "factor": factor, "exact": False}]


# ---------------------------------------------------------------- verdicts, both directions


def _pair(case, a: str, b: str):
    for name in (a, b):
        resolve(name)
    return compare_case(case, [a, b], stages=False).pairs[0]


@pytest.mark.usefixtures("pool")
def test_a_correct_fit_program_is_an_expected_difference_at_3_replicas_with_a_float64_residual():
    p = _pair(_case(3), program("keras_fit"), torch("ddp"))
    assert p.verdict.status == "expected_difference", p.verdict.detail
    # unmapped: the loss of step 1 parts by the factor itself, 2^-25 (to its float64 rounding)
    assert p.unmapped_gap == pytest.approx(2.0**-25, rel=1e-6)
    assert p.residual is not None and p.residual.status == "parity", p.residual.detail
    assert "distribution loss scale exact" in p.mapping


@pytest.mark.usefixtures("pool")
def test_nothing_is_predicted_at_2_replicas_and_the_pair_is_at_parity():
    p = _pair(_case(2), program("keras_fit"), torch("ddp"))
    assert p.verdict.status == "parity", p.verdict.detail
    assert not any(d.mapping == LOSS_SCALE for d in p.prediction.differences) and p.mapping is None


@pytest.mark.usefixtures("pool")
def test_a_float32_case_at_3_replicas_is_never_a_divergence():
    p = _pair(_case(3, dtype="float32"), program("keras_fit"), torch("ddp"))
    assert p.verdict.status in ("parity", "expected_difference"), p.verdict.detail


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("bug", ["keras_fit_lr_high", "keras_fit_loss_over_n"])
def test_a_bug_in_the_fit_program_is_still_a_divergence_at_3_replicas(bug):
    p = _pair(_case(3), torch("ddp"), program(bug))
    assert p.verdict.status == "divergence", p.verdict.detail
    # the residual (the program rerun with the factor exact) is what parts: the bug is no float32 rounding
    assert p.residual is not None and p.residual.status == "divergence"


def test_keras_is_as_it_was_after_the_block_also_when_it_raises():
    from keras.src.losses import loss as loss_module

    from tfpar.keras_seen import keras_loss_scales_seen

    original = loss_module.scale_loss_for_distribution
    with pytest.raises(RuntimeError), keras_loss_scales_seen(exact=True) as seen:
        assert loss_module.scale_loss_for_distribution is not original
        raise RuntimeError("the program raised")
    assert loss_module.scale_loss_for_distribution is original and seen == []


# native Adam: Keras rounds beta1 through float32 in its bias correction (1 - float32(0.9) is 2.4e-7 relative off
# 1 - 0.9), a known difference mapped through the program's stand-in (tf.towers, torch's rule) beside the loss scale
ADAM = {"name": "adam", "lr": 0.01, "semantics": "native", "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}


@pytest.mark.usefixtures("pool")
def test_under_native_adam_both_mappings_are_made_and_the_residual_is_float64():
    p = _pair(make(MLP, data__global_batch=6, steps=2, parallel__devices=3, parallel__weighting="equal",
                   optimizer=ADAM), program("keras_fit"), torch("ddp"))
    assert p.verdict.status == "expected_difference", p.verdict.detail
    assert p.residual is not None and p.residual.status == "parity", p.residual.detail
    assert "standing in for" in p.mapping and "distribution loss scale exact" in p.mapping, p.mapping


@pytest.mark.usefixtures("pool")
def test_under_native_adam_a_learning_rate_bug_is_a_divergence_at_4_replicas():
    """No loss scale at 4: the Keras roundings' mapping alone, through the stand-in onto torch's rule, must be made
    (it once made an invalid case, keras_rounding under semantics torch, and the bug passed as expected)."""
    p = _pair(make(MLP, data__global_batch=8, steps=2, parallel__devices=4, parallel__weighting="equal",
                   optimizer=ADAM), torch("ddp"), program("keras_fit_lr_high"))
    assert p.verdict.status == "divergence", p.verdict.detail
    assert not any(d.mapping == LOSS_SCALE for d in p.prediction.differences)



# ---------------------------------------------------------------- a stand-in that is not equivalent, beside the loss scale


@pytest.mark.usefixtures("pool")
def test_a_loss_divided_by_n_twice_is_a_divergence_where_the_stand_in_is_not_equivalent():
    """Must fire. Native Adam maps Keras' rule through tf.towers standing in for the program; the program's loss
    divided by N once more than ``fit`` does (0.667 apart at the loss) makes that stand-in no equivalent run, so no
    residual is judged through it. Resolved by the stage where the pair parts, the predicted loss scale (a loss
    stage difference of 2^-25) once explained the whole gap: ``expected_difference``, exit 0. The loss scale is
    still mapped on the program itself: its exact rerun parts at the loss, where nothing left in the prediction
    (Adam's epsilon placement, at the update) explains it: a divergence."""
    p = _pair(make(MLP, data__global_batch=6, steps=2, parallel__devices=3, parallel__weighting="equal",
                   optimizer=ADAM), torch("ddp"), program("keras_fit_loss_over_n"))
    assert p.verdict.status == "divergence", p.verdict.detail
    assert "not the predicted difference" in p.verdict.detail and "appeared first at loss" in p.verdict.detail


@pytest.mark.usefixtures("pool")
def test_an_l2_term_the_stand_in_lacks_is_still_the_predicted_difference_at_3_replicas():
    """Must not fire: the same set-up with a correct program and its port, both with an L2 term no case field
    expresses (the stand-in trains without it: residual not judged). The exact rerun against the port parts first
    at the update (Adam's epsilon placement, predicted there): ``expected_difference``."""
    p = _pair(make(MLP, data__global_batch=6, steps=2, parallel__devices=3, parallel__weighting="equal",
                   optimizer=ADAM), torch("ddp_l2"), program("keras_fit_l2"))
    assert p.verdict.status == "expected_difference", p.verdict.detail
    assert p.residual_not_judged is not None and "first at update" in p.verdict.detail, p.verdict.detail
