"""The torch reference: real DDP (gloo, pool of spawned ranks) against one process and against TF towers."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import MLP, POLY, SOFTMAX, make

RTOL, ATOL = 1e-10, 1e-12  # see test_towers.py for the derivation


@pytest.fixture(autouse=True)
def _pool(pool):
    return pool


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ddp_equals_single_process_float64(n):
    case = make(SOFTMAX, parallel__devices=n)
    assert_trajectories_close(run_impl(case, "torch.ddp"), run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    ("base", "opt"),
    [
        (MLP, {"name": "sgd", "lr": 0.05, "semantics": "torch"}),
        (POLY, {"name": "adam", "lr": 0.05, "semantics": "torch"}),
        (POLY, {"name": "adam", "lr": 0.05, "semantics": "tf"}),
        (SOFTMAX, {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": "tf"}),
    ],
    ids=["mlp-sgd-torch", "poly-adam-torch", "poly-adam-tf", "softmax-momentum-tf"],
)
def test_ddp_equals_tf_towers_float64(base, opt, n):
    case = make(base, parallel__devices=n, optimizer=opt)
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("combine", ["grad_mean", "loss_mean"])
def test_uneven_by_size_ddp_equals_full_batch(combine):
    # exact semantics: a float64 cross-framework check must not use Keras' float32 learning rate
    case = make(MLP, parallel__devices=4, parallel__weighting="by_size", parallel__combine=combine,
                data__global_batch=50, optimizer__semantics="torch")
    assert_trajectories_close(run_impl(case, "torch.ddp"), run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)
    assert_trajectories_close(run_impl(case, "torch.ddp"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)


def test_ddp_loss_mean_equals_grad_mean():
    a = run_impl(make(POLY, parallel__devices=3, parallel__combine="loss_mean"), "torch.ddp")
    b = run_impl(make(POLY, parallel__devices=3, parallel__combine="grad_mean"), "torch.ddp")
    assert_trajectories_close(a, b, rtol=RTOL, atol=ATOL)


def test_strided_shards_ddp_equal_tf():
    case = make(SOFTMAX, parallel__devices=3, parallel__shard="strided", data__global_batch=47,
                parallel__weighting="by_size", optimizer__semantics="tf")
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)


def test_sum_reduction_under_ddp_is_detected_as_one_nth():
    """DDP averages per-rank sums: the update is the full-batch sum gradient / N, not the sum."""
    n = 4
    case = make(MLP, parallel__devices=n, model__reduction="sum", steps=2, optimizer__semantics="torch")
    ddp, single = run_impl(case, "torch.ddp"), run_impl(case, "torch.single")
    result = compare_trajectories(ddp, single, rtol=RTOL, atol=ATOL)
    assert not result.ok and result.mismatch is not None
    # the first place it shows: step 1's combined loss, the mean of the rank sums
    assert (result.mismatch.key, result.mismatch.step) == ("loss", 1)
    np.testing.assert_allclose(ddp["loss"][0], single["loss"][0] / n, rtol=RTOL)
    for key in [k for k in ddp if k.startswith("grad/")]:
        np.testing.assert_allclose(ddp[key][0], single[key][0] / n, rtol=RTOL, atol=ATOL)
    # and the TF towers make the same choice as DDP
    assert_trajectories_close(run_impl(case, "tf.towers"), ddp, rtol=RTOL, atol=ATOL)


def test_ddp_repeat_is_bit_identical():
    case = make(MLP, parallel__devices=4, dtype="float32")
    a, b = run_impl(case, "torch.ddp"), run_impl(case, "torch.ddp")
    for k in a:
        assert np.array_equal(a[k], b[k]), k
