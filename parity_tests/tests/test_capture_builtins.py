"""Per-device capture on ``tf.mirrored`` and ``tf.v1``, and the stage chain at lockstep's first bad step (issue 10).

``tf.mirrored`` reads each replica's values with ``strategy.experimental_local_results``,
``tf.v1`` fetches its towers' tensors in the session run of the captured step; both must
record what ``tf.towers`` records (``TowerTrainer.step(capture=True)``): the same
``device/...`` keys, shapes and, in float64, the same numbers. Seeded bugs are
monkeypatched into the real runner (``tfpar.mirrored.per_example_loss``, the one function
its replicas call for their loss), so the chain runs on a real ``MirroredStrategy``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import tfpar.mirrored
from parity_tests.contract.case import case_from_dict
from parity_tests.judging.localise import _gap
from parity_tests.running.harness import run_impl
from parity_tests.session import lockstep as ls
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import CNN, MLP, make, set_path

# 18 rows over 4 devices: shards 5, 5, 4, 4 (weighting and shard sizes matter); semantics tf: the
# same update formula on every TensorFlow side
SGD = {"name": "sgd", "lr": 0.01, "semantics": "tf"}
UNEVEN = {"data__global_batch": 18, "steps": 2, "optimizer": SGD}
CONFIGS = {
    "by_size-per_device_clip": (MLP, {**UNEVEN, "parallel__weighting": "by_size",
                                      "parallel__clip": {"global_norm": 0.05, "where": "per_device"}}),
    "loss_mean-equal": (MLP, {**UNEVEN, "parallel__combine": "loss_mean"}),
    # every layer type (conv, batch norm, pool, dropout, flatten, dense); local statistics: under sync
    # batch norm a replica's gradient is its share of every replica's loss, by design (localise skips it)
    "cnn-local_bn": (CNN, {"steps": 2, "parallel__devices": 2, "dtype": "float64", "parallel__batch_norm": "local",
                           "optimizer": SGD}),
}
# float64, one step from the same parameters: each captured value is a few dozen operations from the
# inputs, each rounding by at most 2^-53 = 1.1e-16 relative (tf.mirrored adds one division by the
# replica's weight w_r), so the sides agree to well under 1e-12; a weight missing or applied twice
# (1/N, n_r/B) or a gradient of another loss is a gap of 0.1 or more
CAPTURE_RTOL = 1e-12


@pytest.fixture(scope="module")
def towers_captures():
    """tf.towers' captured step 2 of every config (the reference), computed once."""
    return {name: run_impl(dataclasses.replace(make(base, **ch), capture=2), "tf.towers")
            for name, (base, ch) in CONFIGS.items()}


@pytest.mark.parametrize("impl", ["tf.mirrored", "tf.v1"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_captures_equal_tf_towers(towers_captures, name, impl):
    base, ch = CONFIGS[name]
    case = dataclasses.replace(make(base, **ch), capture=2)
    want, got = towers_captures[name], run_impl(case, impl)
    keys = sorted(k for k in want if k.startswith("device/"))
    assert keys == sorted(k for k in got if k.startswith("device/"))
    for k in keys:
        assert got[k].shape == want[k].shape, k
        assert _gap(want[k], got[k]) < CAPTURE_RTOL, k
    assert int(got["device/step"]) == 2
    n = case.devices
    assert got["device/loss"].shape == (n,) and got["device/x"].shape[0] == case.spec["data"]["global_batch"]
    if name == "by_size-per_device_clip":
        assert got["device/sizes"].tolist() == [5, 5, 4, 4]
        assert "device/clipped/0.kernel" in got
        # the combination checked on the side's own arrays: by-size weights of the clipped device gradients
        w = np.array([5, 5, 4, 4]) / 18
        assert _gap(np.tensordot(w, got["device/clipped/0.kernel"], axes=1), got["device/combined/0.kernel"]) < CAPTURE_RTOL
    if name == "cnn-local_bn":
        assert {f"device/act/{i}" for i in range(6)} <= set(keys)


@pytest.mark.parametrize("impl", ["tf.mirrored", "tf.v1"])
def test_a_capture_run_trains_as_the_free_run(impl):
    """Capturing a step adds fetches, nothing else: the trajectory is the free run's, bit for bit."""
    case = make(MLP, **UNEVEN, parallel__weighting="by_size")
    free, captured = run_impl(case, impl), run_impl(dataclasses.replace(case, capture=1), impl)
    assert not any(k.startswith("device/") for k in free)
    for k in free:
        np.testing.assert_array_equal(free[k], captured[k], err_msg=k)


def test_uneven_shards_with_equal_weighting_are_named_at_combined_grads():
    """tf.mirrored's equal mean over uneven shards against the whole batch: theory's combined_grads, now seen there."""
    pair = compare_case(make(MLP, **UNEVEN), ["tf.mirrored", "tf.single"]).pairs[0]
    where = pair.localisation
    assert pair.verdict.status == "expected_difference"
    assert (where["stage"], where["device"], where["as_predicted"]) == ("combined_grads", None, True)
    assert [c["stage"] for c in where["chain"]] == ["inputs", "forward", "combined_grads"]


def _on_replica(r: int, change):
    """``per_example_loss`` of tf.mirrored with ``change(per)`` applied on replica ``r`` only (a seeded bug)."""
    original = tfpar.mirrored.per_example_loss

    def per_example_loss(*args, **kwargs):
        per = original(*args, **kwargs)
        here = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, r)
        return tf.where(here, change(per), per)

    return per_example_loss


def test_a_bug_on_one_replica_is_named_at_its_stage_and_device(monkeypatch):
    """Replica 2 doubles its loss: inputs and forward agree, the loss of device 2 is 2x tf.towers'."""
    monkeypatch.setattr(tfpar.mirrored, "per_example_loss", _on_replica(2, lambda per: 2.0 * per))
    where = compare_case(make(MLP, **UNEVEN), ["tf.towers", "tf.mirrored"]).pairs[0].localisation
    assert (where["first_bad_step"], where["stage"], where["device"]) == (1, "loss", 2)
    assert "(2x the reference's)" in where["explanation"]
    assert [c["stage"] for c in where["chain"]] == ["inputs", "forward", "loss"]


# ------------------------------------------------------------------ lockstep: the chain at the first bad step

B, STEPS, BUG, CAP = 16, 4, 3, 8.0


def _late_case():
    """A relu MLP, 2 devices, 16-row batches, 4 steps of sgd; one outlier row in step 3, on replica 1.

    Every other example's loss stays below 2.6 (measured at the initial weights, 0.1 learning
    rate, 4 steps); the outlier (its inputs times 25, its label against the sign of its logit,
    -19.9) has a loss near 20, so a loss capped at ``CAP`` = 8 differs at step 3 only.
    """
    rng = np.random.default_rng(11)
    x = rng.normal(size=(STEPS * B, 5))
    y = rng.integers(0, 2, size=(STEPS * B, 1)).astype(np.float64)
    row = (BUG - 1) * B + 12  # contiguous shards of 8 rows: replica 1's
    x[row] *= 25.0
    y[row] = 1.0
    raw = MLP
    for k, v in {"steps": STEPS, "data": {"arrays": True, "global_batch": B}, "parallel.devices": 2,
                 "optimizer": {"name": "sgd", "lr": 0.1, "semantics": "tf"}}.items():
        raw = set_path(raw, k, v)
    return case_from_dict(raw, x=x, y=y)


def test_lockstep_names_the_stage_and_device_of_a_late_bug(monkeypatch):
    """A loss capped for "robustness" fires only on step 3's outlier: lockstep names step 3, stage loss, device 1."""
    monkeypatch.setattr(tfpar.mirrored, "per_example_loss", _on_replica(1, lambda per: tf.minimum(per, CAP)))
    case = _late_case()
    captures = []

    def runner(c, impl):
        captures.append((impl, c.capture))
        return run_impl(c, impl)

    result = ls.lockstep_compare(case, ["tf.towers", "tf.mirrored"], runner=runner, free=False)
    pair = result.pairs[0]
    assert pair.step_status == ["parity", "parity", "divergence", "parity"] and pair.first_bad_step == BUG
    where = pair.localisation
    assert (where["first_bad_step"], where["stage"], where["device"]) == (BUG, "loss", 1)
    assert [c["stage"] for c in where["chain"]] == ["inputs", "forward", "loss"]
    assert where["explanation"].startswith(f"lockstep (from tf.towers's state after step {BUG - 1}): step {BUG}: ")
    assert "step 1" not in where["explanation"]
    # one capture run per side, of the one step (the chain, not the recorded channels, named the stage)
    assert sorted(c for c in captures if c[1] is not None) == [("tf.mirrored", 1), ("tf.towers", 1)]
    # without the chain the recorded channels say only "loss" (the combined loss and gradient differ), no device
    plain = ls.lockstep_compare(case, ["tf.towers", "tf.mirrored"], free=False, stages=False).pairs[0].localisation
    assert (plain["first_bad_step"], plain["stage"], plain["device"]) == (BUG, "loss", None) and "chain" not in plain


# dropout masks and a warm-up schedule: what a case cut shorter could draw or rate otherwise
CUT = {"steps": 3, "parallel__devices": 2, "dtype": "float64", "parallel__batch_norm": "local",
       "optimizer": {**SGD, "schedule": {"kind": "warmup_linear", "warmup_steps": 3}}}


@pytest.mark.parametrize("impl", ["tf.towers", "tf.mirrored", "tf.v1", "tf.single", "torch.ddp", "torch.single"])
def test_a_capture_run_cut_after_its_step_captures_what_the_whole_run_does(pool, impl):
    """The localisation's capture run of a built-in stops after the captured step (``comparison._up_to``): its
    per-device values and the rows up to that step are the whole run's, bit for bit."""
    from parity_tests.session.comparison import _up_to

    case = make(CNN, **{**CUT, "optimizer": SGD}) if impl == "tf.v1" else make(CNN, **CUT)  # tf.v1: no schedules
    cut = _up_to(case, impl, 2)
    assert cut.spec["steps"] == 2 and any(v.any() for v in cut.payload()["masks"].values())  # the premise
    whole = run_impl(dataclasses.replace(case, capture=2), impl)
    short = run_impl(dataclasses.replace(cut, capture=2), impl)
    assert {k for k in whole if k.startswith("device/")} == {k for k in short if k.startswith("device/")} != set()
    for k, v in short.items():
        ours = np.asarray(whole[k])
        ours = ours if k.startswith("device/") else ours[: len(v)]
        np.testing.assert_array_equal(ours, np.asarray(v), err_msg=k)


def test_what_is_never_cut():
    from parity_tests.session.comparison import _up_to

    case = make(MLP, **UNEVEN)  # 2 steps
    assert _up_to(case, "tf.towers", 1).spec["steps"] == 1
    assert _up_to(case, "tf.towers", 2) is case  # the last step: nothing to cut
    sampler = make(MLP, **{**UNEVEN, "data__global_batch": 16}, data__order="distributed_sampler", parallel__shard="strided")
    assert _up_to(sampler, "torch.ddp", 1) is sampler  # its dataset's default size is steps x B
    asynchronous = make(MLP, **{**UNEVEN, "parallel__combine": "async"})
    assert _up_to(asynchronous, "tf.towers", 1) is asynchronous  # an order drawn over all steps
    from parity_tests.session.comparison import _Reordered

    reordered = _Reordered(**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)})
    assert _up_to(reordered, "tf.towers", 1) is reordered  # Case.replace would drop its row order
