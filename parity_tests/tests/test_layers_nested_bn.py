"""``batch_norm`` and ``dropout`` inside ``residual`` and ``repeat`` bodies (issue 27: ResNet blocks).

A ResNet basic block is conv-BN-relu-conv-BN with a conv-BN projection shortcut; its batch
norms sit inside the block. Their parameters and moving statistics are named by path
(``1.body.1.gamma``, ``1.shortcut.1.moving_mean``, one set per repetition of a ``repeat``:
``2.0.1.moving_mean``), dropout masks are keyed by the same paths, and ``parallel.batch_norm``
``local``/``sync`` applies to nested layers as to top-level ones (``tfpar.models.forward_towers``
walks the bodies in lockstep across towers).

The model (:data:`BLOCK`) is the smallest that exercises every path: a stride-2 residual block with a
batch norm in the body, a dropout between the convolutions and a conv-BN shortcut, then a repeat of
conv-BN (two copies), on 4x4x2 images, 8 rows, 2 devices (4 rows each: 16 values per channel per
device after the stride), float64, 2 SGD steps.

Tolerance: rtol 1e-10 in float64, as ``test_layers.py`` (each op agrees to about 1e-15 between the
libraries; a dozen ops and two steps leave five orders of magnitude), while what the tests
tell apart is of order 1: local against synchronized statistics change step 1's loss, and
torch's unbiased moving variance changes each increment by ``n / (n - 1)``, n = 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.generators import dropout_masks, mask_seed
from parity_tests.contract.specs import param_specs
from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.judging.theory import mapping_changes, predict
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import make, run_once

RTOL, ATOL = 1e-10, 1e-12

BLOCK = [
    {"type": "conv2d", "filters": 2, "kernel_size": 3, "padding": "same"},
    {"type": "residual", "activation": "relu",
     "body": [{"type": "conv2d", "filters": 3, "kernel_size": 3, "strides": 2, "padding": "same", "use_bias": False},
              {"type": "batch_norm", "momentum": 0.9, "semantics": "torch"},
              {"type": "activation", "fn": "relu"},
              {"type": "dropout", "rate": 0.25},
              {"type": "conv2d", "filters": 3, "kernel_size": 3, "padding": "same", "use_bias": False},
              {"type": "batch_norm", "momentum": 0.9, "semantics": "torch"}],
     "shortcut": [{"type": "conv2d", "filters": 3, "kernel_size": 1, "strides": 2, "use_bias": False},
                  {"type": "batch_norm", "momentum": 0.9, "semantics": "torch"}]},
    {"type": "repeat", "count": 2, "body": [{"type": "conv2d", "filters": 3, "kernel_size": 1},
                                            {"type": "batch_norm", "momentum": 0.8, "semantics": "torch"}]},
    {"type": "global_avg_pool2d"},
    {"type": "dense", "units": 3},
]
NESTED_BN = ["1.body.1", "1.body.5", "1.shortcut.1", "2.0.1", "2.1.1"]

RAW = {"schema": "parity-case/1", "name": "nested-bn", "dtype": "float64", "seed": 5,
       "model": {"input_shape": [4, 4, 2], "layers": BLOCK, "loss": "softmax_ce"},
       "init": {"seed": 8, "kind": "glorot_uniform"}, "data": {"generator": "images", "seed": 9, "global_batch": 8},
       "optimizer": {"name": "sgd", "lr": 0.1, "semantics": "torch"},
       "parallel": {"devices": 2, "batch_norm": "local"}, "steps": 2}


@pytest.fixture()
def _pool(pool):
    return pool


def _case(batch_norm: str = "local", **changes):
    return make(RAW, parallel__batch_norm=batch_norm, **changes)


# ---------------------------------------------------------------- names, masks, validation


def test_nested_state_and_masks_are_named_by_path():
    case = _case()
    specs = {s.name: s for s in param_specs([4, 4, 2], case.spec["model"]["layers"])}
    for path in NESTED_BN:
        assert specs[f"{path}.gamma"].trainable and specs[f"{path}.beta"].trainable
        assert not specs[f"{path}.moving_mean"].trainable and not specs[f"{path}.moving_variance"].trainable
        assert specs[f"{path}.moving_mean"].shape == (3,)
    masks = dropout_masks(case.spec)
    assert list(masks) == ["1.body.3"] and masks["1.body.3"].shape == (16, 2, 2, 3)  # input: after the stride
    expected = np.random.default_rng(mask_seed(5, "1.body.3")).random(size=(16, 2, 2, 3)) >= 0.25
    np.testing.assert_array_equal(masks["1.body.3"], expected)


def test_each_nested_dropout_draws_its_own_masks_and_top_level_ones_are_unchanged():
    """A top-level dropout keeps ``default_rng([seed, i])`` (older cases replay bit for bit); every
    repetition of a repeated dropout has its own path, so its own masks."""
    layers = [{"type": "dropout", "rate": 0.5},
              {"type": "repeat", "count": 2, "body": [{"type": "dense", "units": 4}, {"type": "dropout", "rate": 0.5}]},
              {"type": "dense", "units": 1}]
    case = make({**RAW, "model": {"input_shape": [4], "layers": layers, "loss": "mse"},
                 "data": {"generator": "gaussian", "seed": 9, "global_batch": 8}})
    masks = dropout_masks(case.spec)
    assert set(masks) == {"0", "1.0.1", "1.1.1"}
    np.testing.assert_array_equal(masks["0"], np.random.default_rng([5, 0]).random(size=(16, 4)) >= 0.5)
    assert not np.array_equal(masks["1.0.1"], masks["1.1.1"])
    assert mask_seed(5, "0") == [5, 0] and len(mask_seed(5, "1.0.1")) == 4


def test_too_few_rows_for_a_nested_batch_norm_names_its_path():
    layers = [{"type": "residual", "body": [{"type": "dense", "units": 4}, {"type": "batch_norm"}],
               "shortcut": [{"type": "dense", "units": 4}]}, {"type": "dense", "units": 1}]
    raw = {**RAW, "model": {"input_shape": [4], "layers": layers, "loss": "mse"},
           "data": {"generator": "gaussian", "seed": 9, "global_batch": 2}}
    with pytest.raises(CaseError) as e:
        make(raw)
    assert e.value.field == "data.global_batch" and "layer 0.body.1" in str(e.value) and "\n" not in str(e.value)
    make(raw, data__global_batch=4)  # 2 rows per device: enough


def test_param_mean_refuses_a_nested_batch_norm():
    with pytest.raises(CaseError) as e:
        make(RAW, parallel={"devices": 2, "combine": "param_mean"})
    assert e.value.field == "parallel.combine" and "layer 1.body.1" in str(e.value)


def test_theory_sees_nested_batch_norm():
    """Local statistics inside a block are predicted (N devices vs one); with native semantics, the
    moving-variance rule too, and its mapping names the nested layers' paths."""
    local = _case()
    assert any("local batch-norm statistics" in e for e in predict(local.spec, "tf.towers", "tf.single").expected)
    assert not any("local batch-norm" in e for e in predict(_case("sync").spec, "tf.towers", "tf.single").expected)
    native = local.replace(**{"model.layers.1.body.1.semantics": "native", "model.layers.2.body.1.semantics": "native"})
    assert any("unbiased vs biased" in e for e in predict(native.spec, "tf.towers", "torch.ddp").expected)
    assert not any("unbiased vs biased" in e for e in predict(local.spec, "tf.towers", "torch.ddp").expected)
    assert mapping_changes("bn_semantics", native.spec, "torch.ddp", "tf.towers") == {
        "model.layers.1.body.1.semantics": "tf", "model.layers.2.body.1.semantics": "tf"}


# ---------------------------------------------------------------- end to end


@pytest.mark.parametrize("batch_norm", ["local", "sync"])
def test_nested_batch_norm_towers_equal_ddp(_pool, batch_norm):
    case = _case(batch_norm)
    tf_side, ddp = run_once(case, "tf.towers"), run_impl(case, "torch.ddp")
    for path in NESTED_BN:  # the moving statistics are recorded, by path, and move
        assert not np.array_equal(tf_side[f"state/{path}.moving_mean"][0], tf_side[f"state/{path}.moving_mean"][-1])
    assert_trajectories_close(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.towers", "torch.ddp").expected == ()


def test_nested_sync_equals_the_full_batch_and_local_does_not(_pool):
    """Synchronized statistics inside the block: 2 towers compute the one-device full-batch run (the
    dropout masks go with their rows). Local statistics do not, from step 1's loss: the check can fail."""
    single = run_once(_case("sync"), "tf.single")
    assert_trajectories_close(run_once(_case("sync"), "tf.towers"), single, rtol=RTOL, atol=ATOL)
    result = compare_trajectories(run_once(_case("local"), "tf.towers"), single, rtol=RTOL, atol=ATOL)
    assert not result.ok and (result.mismatch.key, result.mismatch.step) == ("loss", 1)


@pytest.mark.parametrize(("impl", "batch_norm", "reference"), [
    ("tf.mirrored", "local", "tf.towers"), ("tf.mirrored", "sync", "tf.towers"), ("tf.v1", "local", "tf.towers"),
    ("torch.single", "sync", "tf.single")])
def test_every_engine_runs_nested_batch_norm(_pool, impl, batch_norm, reference):
    case = _case(batch_norm)
    assert_trajectories_close(run_once(case, reference), run_impl(case, impl), rtol=RTOL, atol=ATOL)


def test_tf_v1_refuses_nested_sync_batch_norm():
    from tfpar.errors import Unsupported
    from tfpar.v1 import check_supported

    with pytest.raises(Unsupported) as e:
        check_supported(_case("sync").spec)
    assert e.value.field == "parallel.batch_norm"


def test_native_nested_moving_variance_differs_and_the_mapping_removes_it(_pool):
    """``semantics: native`` on a nested batch norm: only its ``state/...moving_variance`` differs
    (torch keeps ``n/(n-1)`` times the batch variance), first at step 1; mapped, nothing does."""
    case = _case().replace(**{"model.layers.1.body.1.semantics": "native"})
    tf_side, ddp = run_once(case, "tf.towers"), run_impl(case, "torch.ddp")
    result = compare_trajectories(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert not result.ok and (result.mismatch.key, result.mismatch.step) == ("state/1.body.1.moving_variance", 1)
    rest = [k for k in tf_side if k != "state/1.body.1.moving_variance"]
    assert_trajectories_close({k: tf_side[k] for k in rest}, {k: ddp[k] for k in rest}, rtol=RTOL, atol=ATOL)
    mapped = case.replace(**mapping_changes("bn_semantics", case.spec, "torch.ddp", "tf.towers"))
    assert_trajectories_close(tf_side, run_impl(mapped, "torch.ddp"), rtol=RTOL, atol=ATOL)


def test_plugins_get_nested_masks_by_path_and_top_level_ones_by_index():
    from parity_tests.protocol.plugin_run import RunBase

    layers = [{"type": "dropout", "rate": 0.5},
              {"type": "residual", "body": [{"type": "dense", "units": 4}, {"type": "dropout", "rate": 0.5}]},
              {"type": "dense", "units": 1}]
    case = make({**RAW, "model": {"input_shape": [4], "layers": layers, "loss": "mse"},
                 "data": {"generator": "gaussian", "seed": 9, "global_batch": 8}})
    run = RunBase(case.payload())
    assert set(run.dropout_masks) == {0, "1.body.1"}
    np.testing.assert_array_equal(run.dropout_masks["1.body.1"], dropout_masks(case.spec)["1.body.1"])


def test_a_path_without_batch_norm_refuses_a_nested_one_naming_its_field():
    from tfpar.errors import Unsupported, refuse_unimplemented

    with pytest.raises(Unsupported) as e:
        refuse_unimplemented(_case().spec, "tf.example")
    assert e.value.field == "model.layers[1].body[1].type" and "batch_norm" in str(e.value)
