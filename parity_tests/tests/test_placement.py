"""Model parallelism (``model.placement``): layers run where the case puts them, and the trajectory
is the same as with no placement."""

from __future__ import annotations

import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.rules import judge_float64
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, MLP, make, set_path

DEEP = set_path(MLP, "model.layers", [
    {"type": "dense", "units": 8, "activation": "tanh"},
    {"type": "dense", "units": 8, "activation": "relu"},
    {"type": "dense", "units": 1},
])


@pytest.mark.parametrize(("placement", "field"), [
    ([[0, 1, 2], [1, 2, 3]], "model.placement[1]"),  # overlap
    ([[0, 5, 1]], "model.placement[0][1]"),  # past the last layer
    ([[2, 1, 1]], "model.placement[0][1]"),  # last before first
    ([[0, 0, -1]], "model.placement[0][2]"),
    ([[0, 0]], "model.placement[0]"),
    ({"0": 1}, "model.placement"),
])
def test_bad_placement_names_the_field(placement, field):
    with pytest.raises(CaseError) as info:
        case_from_dict(set_path(DEEP, "model.placement", placement))
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_device_beyond_the_process_is_bad_input(monkeypatch):
    from tfpar import devices

    devices.configure_devices()  # as if TensorFlow had started with 8 devices (the contract allows indices to 63)
    monkeypatch.setattr(devices, "_configured", devices.available_devices()[:8])
    with pytest.raises(CaseError, match=r"^model.placement\[0\]\[2\]: expected a device index below 8"):
        run_impl(make(DEEP, model__placement=[[0, 0, 9]]), "tf.single")


def test_placed_layers_run_on_their_devices():
    import tensorflow as tf

    from tfpar.models import build_variables, forward

    case = make(DEEP, model__placement=[[0, 0, 3], [2, 2, 5]])
    params = build_variables(case.init, tf.float64)
    fn = tf.function(lambda x: forward(case.spec["model"]["layers"], params, x))
    graph = fn.get_concrete_function(tf.TensorSpec([4, 5], tf.float64)).graph
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    assert [op.device.split("device:")[-1] for op in matmuls] == ["CPU:3", "", "CPU:5"]


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("impl", ["tf.towers", "tf.single", "tf.v1", "tf.mirrored", "torch.ddp"])
def test_placement_does_not_change_the_trajectory(impl, n):
    plain = make(DEEP, parallel__devices=n, optimizer__semantics="torch")
    placed = make(DEEP, parallel__devices=n, optimizer__semantics="torch", model__placement=[[0, 1, 6], [2, 2, 7]])
    v = judge_float64(run_impl(placed, impl), run_impl(plain, impl))
    assert v.status == "parity", v.detail


@pytest.mark.parametrize("impl", ["tf.towers", "tf.mirrored"])
def test_placed_cnn_with_batch_norm_matches_unplaced(impl):
    raw = set_path(CNN, "model.placement", [[0, 2, 1], [3, 5, 2]])
    v = judge_float64(run_impl(case_from_dict(raw), impl), run_impl(case_from_dict(CNN), impl))
    assert v.status == "parity", v.detail


def test_a_placed_case_can_be_changed_and_revalidated():
    """``Case.replace`` re-validates the normalised spec, whose placed layers carry ``device``: a float32
    placed case (the float64 runs, the perturbed reruns are made this way) was refused as bad input."""
    placed = make(DEEP, dtype="float32", parallel__devices=2, model__placement=[[0, 1, 6], [2, 2, 7]])
    again = placed.replace(dtype="float64", **{"parallel.devices": 1})
    assert again.spec["model"]["placement"] == [[0, 1, 6], [2, 2, 7]]
    assert [layer.get("device") for layer in again.spec["model"]["layers"]] == [6, 6, 7]
    wrong = set_path(placed.spec, "model.layers", [dict(placed.spec["model"]["layers"][0], device=3),
                                                   *placed.spec["model"]["layers"][1:]])
    with pytest.raises(CaseError, match=r"^model.layers\[0\].device: expected no such field, or the device "
                                        r"model.placement gives this layer \(6\)"):
        case_from_dict({**wrong, "init": DEEP["init"], "data": DEEP["data"]})


@pytest.mark.usefixtures("pool")
def test_a_float32_placed_case_is_judged_by_both_rules():
    from parity_tests.session.comparison import compare_case

    placed = make(DEEP, dtype="float32", parallel__devices=2, optimizer__semantics="torch",
                  model__placement=[[0, 1, 6], [2, 2, 7]])
    for floor in ("float64", "perturbation"):
        v = compare_case(placed, ["tf.towers", "torch.ddp"], floor=floor).pairs[0].verdict
        assert v.status == "parity", (floor, v.detail)
