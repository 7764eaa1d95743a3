"""The TF2 tower engine: towers vs one device, combine rules, sharding, make_parallel."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import MLP, POLY, SOFTMAX, make

# float64: the same update computed in two orders agrees to ~1e-15 relative per step;
# 1e-10 leaves five orders of magnitude for a few steps of accumulation, and any
# semantic difference (a wrong weight, a missing 1/N) is >= 1e-3 relative.
RTOL, ATOL = 1e-10, 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("base", [MLP, POLY, SOFTMAX], ids=["mlp", "poly", "softmax"])
def test_towers_equal_single_device_float64(base, n):
    case = make(base, parallel__devices=n)
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "tf.single"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [2, 4])
def test_grad_mean_equals_loss_mean(n):
    a = run_impl(make(MLP, parallel__devices=n, parallel__combine="grad_mean"), "tf.towers")
    b = run_impl(make(MLP, parallel__devices=n, parallel__combine="loss_mean"), "tf.towers")
    assert_trajectories_close(a, b, rtol=RTOL, atol=ATOL)


def test_uneven_shards_by_size_equal_full_batch():
    case = make(MLP, parallel__devices=4, parallel__weighting="by_size", data__global_batch=50)
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "tf.single"), rtol=RTOL, atol=ATOL)


def test_uneven_shards_equal_weighting_is_the_device_mean():
    """Shards of 13,13,12,12 rows with equal weights: g = (1/4) sum_r mean-grad_r, not the full mean."""
    case = make(MLP, parallel__devices=4, data__global_batch=50, steps=1)
    towers = run_impl(case, "tf.towers")
    single = run_impl(case, "tf.single")
    assert not compare_trajectories(towers, single, rtol=RTOL, atol=ATOL).ok
    # the prediction, from per-shard single-device runs on the same initial weights
    shard_grads = []
    for lo, hi in [(0, 13), (13, 26), (26, 38), (38, 50)]:
        raw = dict(case.spec, data={"arrays": True, "global_batch": hi - lo}, init={"arrays": True})
        sub = case_from_dict(raw, x=case.x[lo:hi], y=case.y[lo:hi], init=case.init)
        shard_grads.append(run_impl(sub, "tf.single"))
    for key in [k for k in towers if k.startswith("grad/")]:
        want = np.mean([g[key][0] for g in shard_grads], axis=0)
        np.testing.assert_allclose(towers[key][0], want, rtol=RTOL, atol=ATOL)


def test_strided_equals_contiguous_without_per_device_state():
    a = run_impl(make(SOFTMAX, parallel__devices=3, parallel__shard="contiguous"), "tf.towers")
    b = run_impl(make(SOFTMAX, parallel__devices=3, parallel__shard="strided"), "tf.towers")
    assert_trajectories_close(a, b, rtol=RTOL, atol=ATOL)


def test_sum_reduction_towers_are_one_nth_of_the_full_batch_sum():
    case = make(MLP, parallel__devices=4, model__reduction="sum", steps=1)
    towers, single = run_impl(case, "tf.towers"), run_impl(case, "tf.single")
    for key in [k for k in towers if k.startswith("grad/")]:
        np.testing.assert_allclose(towers[key][0], single[key][0] / 4, rtol=RTOL, atol=ATOL)
    assert not compare_trajectories(towers, single, rtol=RTOL, atol=ATOL).ok


def test_repeat_is_bit_identical():
    case = make(POLY, parallel__devices=4)
    a, b = run_impl(case, "tf.towers"), run_impl(case, "tf.single")
    a2, b2 = run_impl(case, "tf.towers"), run_impl(case, "tf.single")
    for k in a:
        assert np.array_equal(a[k], a2[k]) and np.array_equal(b[k], b2[k]), k


def test_make_parallel_matches_unsplit_call():
    import tensorflow as tf

    from tfpar import make_parallel

    x = tf.constant(np.arange(30.0).reshape(10, 3))
    w = tf.constant(np.linspace(-1, 1, 6).reshape(3, 2))
    out = make_parallel(lambda x: tf.matmul(x, w), 4, x=x)  # uneven: 3,3,2,2 rows
    np.testing.assert_array_equal(out.numpy(), tf.matmul(x, w).numpy())
    sums = make_parallel(lambda x: tf.reduce_sum(x), ["/device:CPU:0", "/device:CPU:1"], x=x)
    assert sums.shape == (2,) and float(tf.reduce_sum(sums)) == float(tf.reduce_sum(x))


def test_average_gradients_plain_and_weighted():
    import tensorflow as tf

    from tfpar import average_gradients

    g = [[tf.constant([1.0, 2.0]), tf.constant(3.0)], [tf.constant([3.0, 6.0]), tf.constant(5.0)]]
    mean = average_gradients(g)
    np.testing.assert_array_equal(mean[0].numpy(), [2.0, 4.0])
    assert float(mean[1]) == 4.0
    weighted = average_gradients(g, [0.25, 0.75])
    np.testing.assert_array_equal(weighted[0].numpy(), [2.5, 5.0])


def test_more_devices_than_configured_is_refused():
    from tfpar import DeviceError, available_devices, tower_devices

    have = len(available_devices())  # 64 logical CPU devices without GPUs (tfpar.devices)
    with pytest.raises(DeviceError, match=f"{have + 1} devices asked for, but this process has {have}"):
        tower_devices(have + 1)


def _sgd_trainer(n: int, combine: str, dtype=np.float64):
    """A 5-10-1 tanh MLP tower trainer (plain SGD) over the first ``n`` tower devices."""
    import tensorflow as tf

    from tfpar import TowerTrainer, configure_devices, tower_devices
    from tfpar.optimizers import make_optimizer

    configure_devices()  # the tower devices, were this the process's first TensorFlow use
    rng = np.random.default_rng(0)
    variables = {"w1": tf.Variable(rng.normal(size=(5, 10)).astype(dtype)),
                 "w2": tf.Variable(rng.normal(size=(10, 1)).astype(dtype))}

    def loss_fn(p, x, y):
        return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, p["w1"])), p["w2"]) - y))

    opt = make_optimizer({"name": "sgd", "lr": 0.1, "semantics": "torch"})
    x, y = rng.normal(size=(18, 5)).astype(dtype), rng.normal(size=(18, 1)).astype(dtype)
    return TowerTrainer(loss_fn, variables, opt, tower_devices(n), combine=combine), x, y


@pytest.mark.parametrize("combine", ["grad_mean", "loss_mean"])
def test_one_trace_of_a_tower_serves_every_tower(combine):
    """The step traces a tower once per shard size, not once per tower: 8 equal shards of 16 rows
    are one trace, 18 rows over 4 towers (5, 5, 4, 4) are two; the trace grows no more with N."""
    trainer, x, y = _sgd_trainer(8, combine)
    tower = trainer._tower_grad if combine == "grad_mean" else trainer._tower_loss_fn
    trainer.step(x[:16], y[:16])
    assert tower.experimental_get_tracing_count() == 1
    trainer, x, y = _sgd_trainer(4, combine)
    tower = trainer._tower_grad if combine == "grad_mean" else trainer._tower_loss_fn
    trainer.step(x, y)
    trainer.step(x, y)  # a second step traces nothing new
    assert tower.experimental_get_tracing_count() == 2


def _matmuls_by_device(trainer, x, y, *, capture: bool) -> dict[str, int]:
    """How many MatMul ops each device ran in one step (from the partition graphs: what the
    runtime placed and ran, per device, after the calls were inlined)."""
    import collections

    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        trainer.step(x, y, capture=capture)
        meta = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return dict(collections.Counter(node.device.rsplit("/", 1)[-1] for g in meta.partition_graphs
                                    for node in g.node if node.op == "MatMul"))


@pytest.mark.parametrize(("combine", "want"), [
    # each tower's forward (2 matmuls) and backward (3) on its own device
    ("grad_mean", {"CPU:0": 5, "CPU:1": 5, "CPU:2": 5}),
    # each tower's forward on its device; the one gradient of the combined loss is taken on the
    # combine device (CPU:0), as the seeds' compute_gradients(mean loss) places it
    ("loss_mean", {"CPU:0": 2 + 3 * 3, "CPU:1": 2, "CPU:2": 2}),
])
def test_each_tower_runs_on_its_own_device(combine, want):
    """The shared tower trace is called under each tower's tf.device, and the runtime runs it
    there (``want``: what the inline trace placed, 2026-11-23, before towers shared a trace)."""
    trainer, x, y = _sgd_trainer(3, combine)
    shared = _matmuls_by_device(trainer, x, y, capture=False)
    assert shared == {f"device:{d}": k for d, k in want.items()}
    if combine == "grad_mean":  # a capture step's towers are traced inline (a loss_mean capture
        # also takes each tower's own gradient, 3 more matmuls a tower, so it is not compared)
        assert _matmuls_by_device(trainer, x, y, capture=True) == shared


@pytest.mark.parametrize("combine", ["grad_mean", "loss_mean"])
def test_a_capture_step_trains_bit_for_bit_as_the_plain_step(combine):
    """A capture step traces its towers inline (to record their activations), a plain step calls
    the shared tower trace: the same ops, so the same bits, in float32 over uneven shards."""
    a, x, y = _sgd_trainer(4, combine, np.float32)
    b, _, _ = _sgd_trainer(4, combine, np.float32)
    for k in range(3):
        la, ga = a.step(x, y)
        lb, gb = b.step(x, y, capture=k == 1)
        assert la.tobytes() == lb.tobytes() and all(ga[n].tobytes() == gb[n].tobytes() for n in ga), k
    assert b.captured is not None and all(a.values()[n].tobytes() == b.values()[n].tobytes() for n in a.names)
