"""``parallel.accumulate: k``: k micro-batches per optimizer step (issue 27; docs/layers.md, "Gradient accumulation").

``global_batch`` stays the rows per optimizer step; each device cuts its shard into k equal
contiguous micro-batches, runs each forward and backward (batch-norm statistics and moving
statistics per micro-batch), and its gradient is the mean of the micro-batch gradients,
combined across devices as ``combine`` says; torch DDP runs the first k - 1 under ``no_sync()``.

Tolerance: rtol 1e-10 in float64 (``test_layers.py``'s derivation: each op agrees to about 1e-15
between the libraries; a dozen ops, two micro-batches and two steps leave five orders of
magnitude). What the tests tell apart is of order 1e-2 or more: micro-batch against whole-shard
batch-norm statistics change step 1's loss by about 10%, a sum of two micro-batch gradients is
twice their mean.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.judging.theory import mapping_changes, predict
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import check_dtypes, run_impl
from parity_tests.tests.helpers import make, run_once
from parity_tests.tests.test_layers_nested_bn import RAW as BLOCK_CASE

RTOL, ATOL = 1e-10, 1e-12

#: the ResNet-style block of test_layers_nested_bn (batch norm in the body and the shortcut, dropout),
#: 16 rows: 8 per device, micro-batches of 4 (16 values per channel after the stride)
BN = {**BLOCK_CASE, "name": "accumulate-bn", "data": {"generator": "images", "seed": 9, "global_batch": 16}}
#: no batch norm: dense, dropout, dense; micro-batch gradients average to the whole shard's
MLP = {"schema": "parity-case/1", "name": "accumulate-mlp", "dtype": "float64", "seed": 3,
       "model": {"input_shape": [5], "layers": [{"type": "dense", "units": 6, "activation": "tanh"},
                                                 {"type": "dropout", "rate": 0.3}, {"type": "dense", "units": 2}],
                 "loss": "mse"},
       "init": {"seed": 8, "kind": "glorot_uniform"}, "data": {"generator": "gaussian", "seed": 9, "global_batch": 8},
       "optimizer": {"name": "adam", "lr": 0.05, "semantics": "torch"}, "parallel": {"devices": 2}, "steps": 2}


@pytest.fixture()
def _pool(pool):
    return pool


def _bn(accumulate: int | None = 2, **parallel):
    par = {"devices": 2, "batch_norm": "local", **parallel}
    if accumulate is not None:
        par["accumulate"] = accumulate
    return make(BN, parallel=par)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(("base", "changes", "field", "words"), [
    (MLP, {"parallel__accumulate": 3}, "parallel.accumulate", "a divisor of every device's rows"),
    (MLP, {"parallel__accumulate": 0}, "parallel.accumulate", ">= 1"),
    (MLP, {"parallel__accumulate": True}, "parallel.accumulate", "integer"),
    (MLP, {"parallel": {"devices": 2, "combine": "param_mean", "accumulate": 2}}, "parallel.accumulate", "param_mean"),
    (MLP, {"parallel": {"devices": 2, "shard": "strided", "accumulate": 2}, "data__order": "distributed_sampler"},
     "parallel.accumulate", "distributed_sampler"),
    ({**MLP, "model": {"input_shape": [5], "layers": [{"type": "dense", "units": 3}, {"type": "batch_norm"}],
                       "loss": "mse"}}, {"parallel__accumulate": 4}, "data.global_batch", "4 micro-batches"),
])
def test_accumulate_is_validated_in_one_line(base, changes, field, words):
    with pytest.raises(CaseError) as e:
        make(base, **changes)
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_accumulate_is_carried_only_when_given():
    assert "accumulate" not in make(MLP).spec["parallel"]
    assert make(MLP, parallel__accumulate=1).spec["parallel"]["accumulate"] == 1
    assert make(MLP, parallel__accumulate=4).spec["parallel"]["accumulate"] == 4  # 4 rows per device: 1 per micro-batch


def test_tf_v1_refuses_accumulation_with_batch_norm_in_one_line():
    """The v1 graph accumulates without batch norm; with it, the k moving-statistics updates of a step
    would need chaining by control dependencies: refused naming the field, by ``tfpar run`` too."""
    from tfpar.errors import Unsupported
    from tfpar.run import run_case

    with pytest.raises(Unsupported) as e:
        run_case(_bn(2).payload(), "tf.v1")
    assert e.value.field == "parallel.accumulate" and "batch norm" in str(e.value) and "\n" not in str(e.value)
    check_dtypes(make(MLP, parallel__accumulate=2), ["tf.v1"])  # declared: without batch norm it runs


#: a sample-weighted loss under torch's rule (``sum v l / sum v`` per micro-batch): the micro-batches' mean
#: is not the whole shard's, so a side that ignored ``accumulate`` would differ from step 1
WEIGHTED = {"parallel__accumulate": 2, "data__sample_weights": {"seed": 4, "low": 0.5, "high": 2.0},
            "model__loss_semantics": "torch", "optimizer": {"name": "momentum", "lr": 0.05, "momentum": 0.9,
                                                            "semantics": "torch"}}


@pytest.mark.parametrize("parallel", [{}, {"combine": "loss_mean"},
                                      {"weighting": "by_size", "clip": {"global_norm": 0.05, "where": "per_device"}}],
                         ids=["grad_mean", "loss_mean", "per-device clipping, by_size"])
def test_tf_v1_accumulates_as_towers_do(_pool, parallel):
    """The classic graph towers: each tower calls ``model_fn`` on its k micro-batches and averages their
    ``compute_gradients`` (dropout masks and sample weights go with their rows)."""
    case = make(MLP, **WEIGHTED, **{f"parallel__{k}": v for k, v in parallel.items()})
    v1 = run_impl(case, "tf.v1")
    assert_trajectories_close(v1, run_once(case, "tf.towers"), rtol=RTOL, atol=ATOL)
    whole = run_impl(case.replace(**{"parallel.accumulate": 1}), "tf.v1")  # the premise: k matters here
    result = compare_trajectories(v1, whole, rtol=RTOL, atol=ATOL)
    assert not result.ok and result.mismatch.step == 1


def test_tf_v1_captures_an_accumulated_step(_pool):
    """Localisation's captured step on tf.v1 under accumulation: each tower's accumulated loss and gradient
    and every layer's output over its k micro-batches, in row order, as tf.towers records them."""
    case = make(MLP, **WEIGHTED)
    ours = run_impl(dataclasses.replace(case, capture=1), "tf.v1")
    theirs = run_impl(dataclasses.replace(case, capture=1), "tf.towers")
    for key in ("device/x", "device/loss", "device/grad/0.kernel", "device/act/0", "device/act/2"):
        np.testing.assert_allclose(ours[key], theirs[key], rtol=RTOL, atol=ATOL, err_msg=key)


# ---------------------------------------------------------------- k = 1, and no batch norm


@pytest.mark.parametrize("impl", ["tf.towers", "tf.mirrored", "torch.ddp"])
def test_accumulate_1_is_no_accumulation_bit_for_bit(_pool, impl):
    plain, one = run_once(_bn(None), impl), run_impl(_bn(1), impl)
    assert set(plain) == set(one)
    for key in plain:
        np.testing.assert_array_equal(plain[key], one[key], err_msg=key)


@pytest.mark.parametrize("impl", ["tf.towers", "torch.ddp", "tf.single", "torch.single"])
def test_without_batch_norm_micro_batches_average_to_the_whole_shard(_pool, impl):
    """Mean reduction, equal micro-batches, no batch statistics: the mean of the micro-batch gradients is
    the shard's gradient in exact arithmetic (the dropout masks go with their rows), so accumulate 2
    equals accumulate 1 to rounding. Theory predicts nothing for the pair."""
    assert_trajectories_close(run_once(make(MLP), impl), run_impl(make(MLP, parallel__accumulate=2), impl),
                              rtol=RTOL, atol=ATOL)


def test_summing_micro_batch_gradients_is_caught(_pool, monkeypatch):
    """A planted mistake: the TensorFlow side sums the micro-batch gradients instead of averaging them.
    Against torch.ddp (which averages) the step-1 gradient is twice as large."""
    import tfpar.towers
    from tfpar import reuse

    case = make(MLP, parallel__accumulate=2)
    ddp = run_once(case, "torch.ddp")
    assert_trajectories_close(run_once(case, "tf.towers"), ddp, rtol=RTOL, atol=ATOL)
    monkeypatch.setattr(tfpar.towers, "_micro_mean", lambda gs: gs[0] + gs[1])
    with reuse.disabled():  # a trainer traced before the patch must not be reused
        wrong = run_impl(case, "tf.towers")
    result = compare_trajectories(wrong, ddp, rtol=RTOL, atol=ATOL)
    assert not result.ok and result.mismatch.step == 1 and result.mismatch.key.startswith("grad/")
    key = result.mismatch.key
    np.testing.assert_allclose(wrong[key][0], 2 * ddp[key][0], rtol=1e-9)


# ---------------------------------------------------------------- with batch norm: tf.towers vs torch.ddp


CONFIGS = {
    "grad_mean, local": {},
    "loss_mean, sync": {"combine": "loss_mean", "batch_norm": "sync"},
    # local: under sync statistics a tower's own-loss gradient is not a rank's share (predicted, theory.py)
    "grad_mean, local, per-device clipping, by_size": {"weighting": "by_size",
                                                       "clip": {"global_norm": 0.05, "where": "per_device"}},
    "grad_mean, local, clipping after combining": {"clip": {"global_norm": 0.05}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accumulate_towers_equal_ddp(_pool, name):
    case = _bn(2, **CONFIGS[name])
    tf_side, ddp = run_once(case, "tf.towers"), run_impl(case, "torch.ddp")
    assert_trajectories_close(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.towers", "torch.ddp").expected == ()
    # the micro-batches matter: their batch-norm statistics are not the whole shard's (from step 1's loss)
    whole = run_once(case.replace(**{"parallel.accumulate": 1}), "tf.towers")
    result = compare_trajectories(tf_side, whole, rtol=RTOL, atol=ATOL)
    assert not result.ok and (result.mismatch.key, result.mismatch.step) == ("loss", 1)


def test_accumulate_with_sample_weights_towers_equal_ddp(_pool):
    """torch's weighted mean ``sum v l / sum v`` is taken per micro-batch on both sides."""
    case = make(MLP, parallel__accumulate=2, data__sample_weights={"seed": 4, "low": 0.5, "high": 2.0},
                model__loss_semantics="torch")
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["grad_mean, local", "loss_mean, sync", "grad_mean, local, per-device clipping, by_size"])
def test_mirrored_accumulates_as_towers_do(_pool, name):
    """MirroredStrategy: each replica loops over its micro-batches (each scaled as a global batch of B/k
    rows), averages their gradients, and the moving statistics are updated once per micro-batch."""
    case = _bn(2, **CONFIGS[name])
    assert_trajectories_close(run_once(case, "tf.towers"), run_impl(case, "tf.mirrored"), rtol=RTOL, atol=ATOL)


def test_mirrored_accumulates_sample_weighted_losses_as_towers_do(_pool):
    case = make(MLP, parallel__accumulate=2, data__sample_weights={"seed": 4, "low": 0.5, "high": 2.0})
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "tf.mirrored"), rtol=RTOL, atol=ATOL)


def test_accumulate_single_devices_agree(_pool):
    case = _bn(2, batch_norm="sync")
    assert_trajectories_close(run_once(case, "tf.single"), run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- theory: N devices against one


def test_micro_batch_rows_against_one_device_are_predicted_and_strided_shards_map_them(_pool):
    """Synchronized statistics and accumulate 2: with contiguous shards the devices' micro-batch j is
    not one device's micro-batch j (predicted, step 1's loss); strided shards make it so (not predicted,
    and measured equal): the mapping theory names."""
    contiguous = _bn(2, batch_norm="sync")
    single = run_once(contiguous, "tf.single")
    found = predict(contiguous.spec, "tf.towers", "tf.single")
    assert [d.mapping for d in found.differences if "micro-batch" in d.text] == ["micro_batches"]
    result = compare_trajectories(run_once(contiguous, "tf.towers"), single, rtol=RTOL, atol=ATOL)
    assert not result.ok and (result.mismatch.key, result.mismatch.step) == ("loss", 1)
    mapped = contiguous.replace(**mapping_changes("micro_batches", contiguous.spec, "tf.towers", "tf.single"))
    assert mapped.spec["parallel"]["shard"] == "strided"
    assert not any("micro-batch" in d.text for d in predict(mapped.spec, "tf.towers", "tf.single").differences)
    assert any("micro-batch" in a for a in predict(mapped.spec, "tf.towers", "tf.single").absent)
    assert_trajectories_close(run_impl(mapped, "tf.towers"), single, rtol=RTOL, atol=ATOL)
    # without accumulation there is nothing to predict
    assert not any("micro-batch" in d.text for d in predict(_bn(1, batch_norm="sync").spec, "tf.towers",
                                                             "tf.single").differences)


# ---------------------------------------------------------------- DDP's no_sync


@pytest.mark.parametrize(("k", "sync", "calls"), [(3, True, 1), (1, True, 1), (3, False, 0)])
def test_ddp_all_reduces_once_per_step(_pool, k, sync, calls):
    """``torchref.ddp._accumulate`` under real DDP: the first k - 1 micro-batches run in ``no_sync()``, so
    DDP's communication hook fires once (one bucket: a tiny model), not k times; with ``sync=False``
    (per-device clipping, which all-reduces by hand) never. The gradient is the whole shard's."""
    from torchref import _pool_testfns as fns

    case = make({**MLP, "model": {**MLP["model"], "layers": [MLP["model"]["layers"][0], MLP["model"]["layers"][2]]}},
                data__global_batch=12)
    payload = {"spec": case.spec, "init": case.init, "x": case.x[:12], "y": case.y[:12], "k": k, "sync": sync}
    results = _pool.run(fns.count_ddp_allreduces, payload, 2)
    assert [r["calls"] for r in results] == [calls, calls]
    if sync:
        whole = _pool.run(fns.count_ddp_allreduces, {**payload, "k": 1}, 2)[0]["grads"]
        for name, g in results[0]["grads"].items():
            np.testing.assert_allclose(g, whole[name], rtol=RTOL, atol=ATOL, err_msg=name)
