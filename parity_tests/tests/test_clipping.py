"""Gradient clipping by global norm (``parallel.clip``): the formulas, the two placements, end to end."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.compare import (
    assert_trajectories_close,
    compare_trajectories,
    relative_gap,
)
from parity_tests.judging.theory import predict
from parity_tests.protocol.errors import CaseError
from parity_tests.reporting.optimizer_rules import clip_then_mean, np_clip, typical_case
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import MLP, SOFTMAX, make, set_path

# float64, one rule on both sides: see test_towers.py for the derivation
RTOL, ATOL = 1e-10, 1e-12

_, GRADS = typical_case()
PAIR = [GRADS[0], GRADS[2]]  # two "parameters", global norm ~3.9
NORM = float(np.sqrt(sum(np.sum(g * g) for g in PAIR)))


def _tf():
    import tensorflow as tf

    from tfpar.devices import available_devices

    available_devices()  # the runtime fixes its devices on first use
    return tf


def _tf_clip(grads, c, semantics):
    from tfpar.optimizers import clip_by_global_norm

    tf = _tf()
    return [t.numpy() for t in clip_by_global_norm([tf.constant(g) for g in grads], c, semantics)]


def _torch_clip(grads, c, semantics):
    import torch

    from torchref.optimizers import clip_grads

    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float64)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = torch.tensor(g)
    clip_grads(params, c, semantics)
    return [p.grad.numpy() for p in params]


# ---------------------------------------------------------------- the formulas


@pytest.mark.parametrize("c", [0.5, 3.0, 10.0], ids=["active", "active-near", "inactive"])
@pytest.mark.parametrize("semantics", ["torch", "tf"])
@pytest.mark.parametrize("backend", ["tf", "torch"])
def test_clip_rules_match_numpy(backend, semantics, c):
    got = (_tf_clip if backend == "tf" else _torch_clip)(PAIR, c, semantics)
    for a, b in zip(got, np_clip(PAIR, c, semantics), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)


def test_native_sides_are_the_frameworks_own_functions():
    """native: TensorFlow side is tf.clip_by_global_norm, torch side clip_grad_norm_ (with its 1e-6)."""
    import torch

    tf = _tf()
    want_tf = [t.numpy() for t in tf.clip_by_global_norm([tf.constant(g) for g in PAIR], 0.5)[0]]
    for a, b in zip(_tf_clip(PAIR, 0.5, "native"), want_tf, strict=True):
        np.testing.assert_array_equal(a, b)
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float64)) for g in PAIR]
    for p, g in zip(params, PAIR, strict=True):
        p.grad = torch.tensor(g)
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    for a, p in zip(_torch_clip(PAIR, 0.5, "native"), params, strict=True):
        np.testing.assert_array_equal(a, p.grad.numpy())


def test_torch_adds_1e6_to_the_norm():
    """Active clipping: the two rules differ by (n + 1e-6)/n - 1 = 1e-6/n relative, exactly as predicted."""
    t, k = np_clip(PAIR, 0.5, "torch"), np_clip(PAIR, 0.5, "tf")
    want = 1e-6 / (NORM + 1e-6)
    # the real functions, not the oracle: torch's clip_grad_norm_ against tf.clip_by_global_norm
    real_t, real_k = _torch_clip(PAIR, 0.5, "native"), _tf_clip(PAIR, 0.5, "native")
    for a, b in ((t, k), (real_t, real_k)):
        rel = np.abs(np.concatenate([x.ravel() - y.ravel() for x, y in zip(a, b, strict=True)]))
        rel /= np.abs(np.concatenate([y.ravel() for y in b]))
        # want ~2.5e-7; each element carries a few float64 roundings (~4e-16), i.e. ~2e-9 of the gap
        np.testing.assert_allclose(rel, want, rtol=1e-8)
    # inactive (c above the norm): torch's coefficient clamps to 1, TensorFlow's is c * (1/c)
    for a, b in zip(_torch_clip(PAIR, 10.0, "native"), _tf_clip(PAIR, 10.0, "native"), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-15, atol=0)


# ---------------------------------------------------------------- end to end

# 4 steps of SGD with lr 0.0625: a float32 number, so native Keras' float32 learning rate is exact
# in float64 and the clipping formula is the only difference between the native sides
CLIP = 0.05  # below every step's gradient norm on these cases (checked below), so clipping is active


def _norms(traj) -> np.ndarray:
    keys = [k for k in traj if k.startswith("grad/")]
    return np.sqrt(sum(np.sum(traj[k] ** 2, axis=tuple(range(1, traj[k].ndim))) for k in keys))


@pytest.mark.parametrize("where", ["after_combine", "per_device"])
@pytest.mark.parametrize("semantics", ["torch", "tf"])
def test_towers_and_ddp_agree_for_each_placement(semantics, where, pool):
    opt = {"name": "momentum", "lr": 0.05, "momentum": 0.9, "semantics": semantics}
    case = make(SOFTMAX, parallel__devices=3, optimizer=opt, parallel__clip={"global_norm": CLIP, "where": where})
    towers, ddp = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    assert_trajectories_close(towers, ddp, rtol=RTOL, atol=ATOL)
    # the clipping really acted (otherwise this test would prove nothing)
    unclipped = run_impl(case.replace(**{"parallel.clip": None}), "tf.towers")
    assert not compare_trajectories(towers, unclipped, rtol=RTOL, atol=ATOL).ok
    norms = _norms(towers)
    # a mean of vectors of norm <= c has norm <= c
    assert np.all(norms <= CLIP * (1 + 1e-12)), norms
    if where == "after_combine":
        # every step clipped: the applied gradient has norm c (tf) or c * n/(n + 1e-6) (torch)
        np.testing.assert_allclose(norms, CLIP, rtol=1e-5 if semantics == "torch" else 1e-13)


@pytest.mark.parametrize(("impl", "single"), [("tf.towers", "tf.single"), ("torch.ddp", "torch.single")])
def test_per_device_clipping_differs_from_clipping_the_full_batch(impl, single, pool):
    case = make(MLP, parallel__devices=4, steps=2, optimizer={"name": "sgd", "lr": 0.0625, "semantics": "tf"},
                parallel__clip={"global_norm": CLIP, "where": "per_device"})
    par, one = run_impl(case, impl), run_impl(case, single)
    result = compare_trajectories(par, one, rtol=RTOL, atol=ATOL)
    assert not result.ok
    assert (result.mismatch.key.startswith("grad/"), result.mismatch.step) == (True, 1)
    assert any("clipping before vs after averaging" in e for e in predict(case.spec, impl, single).expected)
    # after_combine: the same pair agrees, and theory predicts nothing
    after = case.replace(**{"parallel.clip": {"global_norm": CLIP, "where": "after_combine"}})
    assert_trajectories_close(run_impl(after, impl), run_impl(after, single), rtol=RTOL, atol=ATOL)
    assert predict(after.spec, impl, single).expected == ()


def test_per_device_gradient_is_the_mean_of_clipped_shard_gradients():
    """Step 1 of the towers equals (1/N) sum_r clip(g_r), g_r from one-device runs on each shard."""
    case = make(MLP, parallel__devices=4, steps=1, optimizer={"name": "sgd", "lr": 0.0625, "semantics": "tf"},
                parallel__clip={"global_norm": CLIP, "where": "per_device"})
    towers = run_impl(case, "tf.towers")
    keys = sorted(k for k in towers if k.startswith("grad/"))
    shard_grads = []
    for lo in range(0, 48, 12):
        raw = dict(set_path(case.spec, "parallel", {"devices": 1}), data={"arrays": True, "global_batch": 12},
                   init={"arrays": True})
        sub = case_from_dict(raw, x=case.x[lo:lo + 12], y=case.y[lo:lo + 12], init=case.init)
        run = run_impl(sub, "tf.single")
        shard_grads.append([run[k][0] for k in keys])
    assert all(np.sqrt(sum(np.sum(g * g) for g in gs)) > CLIP for gs in shard_grads)
    want = clip_then_mean(shard_grads, CLIP, "tf")
    for k, w in zip(keys, want, strict=True):
        np.testing.assert_allclose(towers[k][0], w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", ["tf.single", "torch.single", "tf.towers", "torch.ddp"])
def test_one_device_has_nothing_to_average(impl, pool):
    base = make(MLP, parallel__devices=1, steps=3, optimizer={"name": "adam", "lr": 0.01, "semantics": "torch"},
                parallel__clip={"global_norm": CLIP, "where": "per_device"})
    after = base.replace(**{"parallel.clip": {"global_norm": CLIP, "where": "after_combine"}})
    a, b = run_impl(base, impl), run_impl(after, impl)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert predict(base.spec, "tf.towers", "tf.single").expected == ()


@pytest.mark.parametrize("where", ["after_combine", "per_device"])
def test_native_clipping_differs_by_torchs_1e6(where, pool):
    """Native SGD with a float32 learning rate: without clipping the frameworks agree; with it, by ~1e-6/norm."""
    opt = {"name": "sgd", "lr": 0.0625, "semantics": "native"}
    plain = make(MLP, parallel__devices=2, steps=3, optimizer=opt)
    assert_trajectories_close(run_impl(plain, "tf.towers"), run_impl(plain, "torch.ddp"), rtol=RTOL, atol=ATOL)
    case = plain.replace(**{"parallel.clip": {"global_norm": CLIP, "where": where}})
    towers, ddp = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    result = compare_trajectories(ddp, towers, rtol=RTOL, atol=ATOL)
    assert not result.ok
    pred = predict(case.spec, "tf.towers", "torch.ddp")
    assert pred.expected == () and any("1e-6" in k for k in pred.known)
    if where == "after_combine":
        # step 1's combined gradient, before any parameter has moved apart: gap 1e-6 / (n + 1e-6)
        n = _norms(run_impl(plain, "tf.towers"))[0]
        g = max(float(relative_gap(ddp[k][:1], towers[k][:1])[0]) for k in towers if k.startswith("grad/"))
        np.testing.assert_allclose(g, 1e-6 / (n + 1e-6), rtol=1e-3)


@pytest.mark.parametrize(("clip", "field", "text"), [
    ({"global_norm": 0}, "parallel.clip.global_norm", "a number > 0"),
    ({"global_norm": 1.0, "where": "before"}, "parallel.clip.where", "one of after_combine, per_device"),
    ({"where": "per_device"}, "parallel.clip.global_norm", "the field is missing"),
    ({"global_norm": 1.0, "norm": 2}, "parallel.clip.norm", "no such field"),
    ("1.0", "parallel.clip", "an object"),
], ids=["zero", "where", "missing", "extra", "not-object"])
def test_bad_clip_names_the_field(clip, field, text):
    with pytest.raises(CaseError) as e:
        make(MLP, parallel__clip=clip)
    assert e.value.field == field and text in str(e.value), str(e.value)


def test_per_device_clipping_needs_per_device_gradients():
    with pytest.raises(CaseError) as e:
        make(MLP, parallel__combine="loss_mean", parallel__clip={"global_norm": 1.0, "where": "per_device"})
    assert e.value.field == "parallel.clip.where" and "loss_mean" in str(e.value)
    spec = make(MLP, parallel__combine="loss_mean", parallel__clip={"global_norm": 1.0}).spec
    assert spec["parallel"]["clip"] == {"global_norm": 1.0, "where": "after_combine"}
    assert "clip" not in make(MLP).spec["parallel"]


BN_MLP = set_path(MLP, "model.layers", [{"type": "dense", "units": 8}, {"type": "batch_norm", "semantics": "tf"},
                                        {"type": "dense", "units": 1}])


def test_per_device_clipping_with_sync_batch_norm_is_a_named_difference(pool):
    """Sync batch norm: tf.towers clips d(L_r)/dθ, torch ranks and tf.mirrored replicas their share of d(ΣL)/dθ.

    Without clipping (and with clipping after the allreduce) the two agree: the per-device
    gradients sum to the same thing. Clipped per device, they differ from step 1 on, in
    the gradients, and theory names why.
    """
    base = make(BN_MLP, parallel__devices=3, steps=2, parallel__batch_norm="sync",
                optimizer={"name": "sgd", "lr": 0.1, "semantics": "tf"})
    for clip in (None, {"global_norm": CLIP, "where": "after_combine"}):
        same = base.replace(**{"parallel.clip": clip})
        assert_trajectories_close(run_impl(same, "tf.towers"), run_impl(same, "torch.ddp"), rtol=RTOL, atol=ATOL)
        assert predict(same.spec, "tf.towers", "torch.ddp").expected == ()
    case = base.replace(**{"parallel.clip": {"global_norm": CLIP, "where": "per_device"}})
    result = compare_trajectories(run_impl(case, "torch.ddp"), run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL)
    assert not result.ok
    assert (result.mismatch.key.startswith("grad/"), result.mismatch.step) == (True, 1)
    assert [e for e in predict(case.spec, "tf.towers", "torch.ddp").expected
            if e.startswith("per-device gradients under synchronized batch norm")]
    # MirroredStrategy differentiates its all-reduce of the statistics as torch does: a replica's
    # gradient is its share, so tf.mirrored equals torch.ddp here and differs from tf.towers
    mirrored = run_impl(case, "tf.mirrored")
    assert_trajectories_close(mirrored, run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.mirrored", "torch.ddp").expected == ()
    assert not compare_trajectories(mirrored, run_impl(case, "tf.towers"), rtol=RTOL, atol=ATOL).ok
    assert predict(case.spec, "tf.towers", "tf.mirrored").expected
    # local statistics: every device's gradient is its own loss's on both sides, so they agree
    local = case.replace(**{"parallel.batch_norm": "local"})
    assert_trajectories_close(run_impl(local, "tf.towers"), run_impl(local, "torch.ddp"), rtol=RTOL, atol=ATOL)
    assert predict(local.spec, "tf.towers", "torch.ddp").expected == ()
