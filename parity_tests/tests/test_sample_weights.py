"""Sample-weighted reductions (``data.sample_weights``): Keras' ``sum_over_batch_size`` against the
torch idiom ``(v * l).sum() / v.sum()``, both exact on both backends, the difference detected and mapped."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict, load_case, write_case
from parity_tests.judging.compare import assert_trajectories_close
from parity_tests.judging.rules import judge_float64
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, SOFTMAX, make, set_path

pytestmark = pytest.mark.usefixtures("pool")

SW = {"seed": 5, "low": 0.25, "high": 4.0}
# one dense layer: the logits are x W + b, so the loss has an independent numpy statement
LINEAR_SOFTMAX = set_path(SOFTMAX, "model.layers", [{"type": "dense", "units": 3}])
LINEAR_MSE = set_path(set_path(set_path(MLP, "model.layers", [{"type": "dense", "units": 2}]), "model.loss", "mse"),
                      "data", {"generator": "gaussian", "seed": 4, "global_batch": 48})


def _np_loss(case, rule: str) -> float:
    """Step 1's loss in numpy, from the initial weights: the formulas of docs/layers.md."""
    b = case.spec["data"]["global_batch"]
    x, y, v = case.x[:b], case.y[:b], case.w[:b]
    z = x @ case.init["0.kernel"] + case.init["0.bias"]
    if case.spec["model"]["loss"] == "softmax_ce":
        z = z - z.max(axis=1, keepdims=True)
        e = (np.log(np.exp(z).sum(axis=1)) - z[np.arange(b), y])[:, None]  # [n, 1]
    else:
        e = (z - y) ** 2  # [n, k]
    total = (v[:, None] * e).sum()
    return total / e.size if rule == "tf" else total / (v.sum() * e.shape[1])


@pytest.mark.parametrize("base", [LINEAR_SOFTMAX, LINEAR_MSE], ids=["softmax_ce", "mse"])
@pytest.mark.parametrize("rule", ["tf", "torch"])
@pytest.mark.parametrize("impl", ["tf.single", "torch.single", "tf.towers", "torch.ddp"])
def test_loss_is_the_stated_formula(base, rule, impl):
    case = make(base, data__sample_weights=SW, model__loss_semantics=rule, parallel__devices=1)
    np.testing.assert_allclose(run_impl(case, impl)["loss"][0], _np_loss(case, rule), rtol=1e-13)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("rule", ["tf", "torch"])
def test_towers_equal_ddp_under_either_rule(rule, n):
    case = make(MLP, data__sample_weights=SW, model__loss_semantics=rule, parallel__devices=n,
                data__global_batch=47, parallel__weighting="by_size", optimizer__semantics="torch")
    v = judge_float64(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"))
    assert v.status == "parity", v.detail


def test_unit_weights_are_no_weights():
    ones = make(MLP, optimizer__semantics="torch", parallel__devices=2)
    raw = dict(ones.spec, data={"arrays": True, "global_batch": 48, "sample_weights": True}, init={"arrays": True})
    weighted = case_from_dict(raw, x=ones.x, y=ones.y, init=ones.init, w=np.ones(len(ones.x)))
    for rule in ("tf", "torch"):
        w = weighted.replace(**{"model.loss_semantics": rule})
        for impl in ("tf.towers", "torch.ddp"):
            assert judge_float64(run_impl(w, impl), run_impl(ones, impl)).status == "parity"


def test_keras_rule_by_size_equals_one_device_and_torch_idiom_does_not():
    keras = make(MLP, data__sample_weights=SW, model__loss_semantics="tf", parallel__devices=4,
                 data__global_batch=50, parallel__weighting="by_size", optimizer__semantics="torch")
    assert judge_float64(run_impl(keras, "tf.towers"), run_impl(keras, "tf.single")).status == "parity"
    r = compare_case(keras.replace(**{"model.loss_semantics": "torch"}), ["torch.ddp", "torch.single"])
    assert r.pairs[0].verdict.status == "expected_difference", r.summary()
    assert "per-device sample-weight sums" in r.pairs[0].prediction.expected[0]


def test_native_frameworks_differ_by_the_normalisation_and_the_mapping_removes_it():
    native = make(MLP, data__sample_weights=SW, parallel__devices=2, optimizer__semantics="torch")
    r = compare_case(native, ["tf.towers", "torch.ddp"])
    p = r.pairs[0]
    assert p.verdict.status == "expected_difference" and "sample-weight normalisation" in p.prediction.expected[0]
    mapped = compare_case(native.replace(**{"model.loss_semantics": "tf"}), ["tf.towers", "torch.ddp"])
    assert mapped.parity, mapped.summary()


def test_round_trip_and_replay_inputs(tmp_path):
    case = make(MLP, data__sample_weights=SW)
    back = load_case(write_case(case, tmp_path / "c"))
    assert back.spec["data"]["sample_weights"] is True and np.array_equal(back.w, case.w)


@pytest.mark.parametrize(("change", "field"), [
    ({"data__sample_weights": {"seed": 1, "low": 0.0}}, "data.sample_weights.low"),
    ({"data__sample_weights": "yes"}, "data.sample_weights"),
    ({"data__sample_weights": True}, "data.sample_weights"),  # generator data has no npz "w"
    ({"data__sample_weights": SW, "parallel__combine": "param_mean"}, "data.sample_weights"),
    ({"data__sample_weights": SW, "model__label_smoothing": 0.1}, "data.sample_weights"),
])
def test_bad_sample_weights_name_the_field(change, field):
    raw = MLP
    for k, v in change.items():
        raw = set_path(raw, k.replace("__", "."), v)
    with pytest.raises(CaseError) as info:
        case_from_dict(raw)
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_negative_weights_in_npz_are_refused(tmp_path):
    case = make(MLP)
    w = np.ones(len(case.x))
    w[7] = -1.0
    np.savez(tmp_path / "d.npz", x=case.x, y=case.y, w=w)
    raw = set_path(MLP, "data", {"npz": "d.npz", "global_batch": 48, "sample_weights": True})
    with pytest.raises(CaseError, match=r"^data.sample_weights: expected positive weights, got -1.0$"):
        case_from_dict(raw, tmp_path)


@pytest.mark.parametrize("impl", ["tf.v1", "tf.mirrored"])
@pytest.mark.parametrize("semantics", ["native", "torch"])
def test_other_tf_paths_weight_samples_as_the_towers_do(impl, semantics):
    """tf.v1 feeds the weights with the batch, tf.mirrored with each replica's shard: the same trajectory as tf.towers."""
    case = make(MLP, parallel__devices=4, data__sample_weights=SW, model__loss_semantics=semantics)
    assert_trajectories_close(run_impl(case, impl), run_impl(case, "tf.towers"), rtol=1e-10, atol=1e-12)
