"""Every optimizer in every semantics, on both backends, against the numpy statement of its rule."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.tests.rules import np_update

HP = {
    "sgd": {"name": "sgd", "lr": 0.01},
    "momentum": {"name": "momentum", "lr": 0.01, "momentum": 0.9},
    "adam": {"name": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
}
RTOL = 1e-12  # a handful of float64 ulps: the same formula evaluated in a different op order

rng = np.random.default_rng(0)
P0 = rng.normal(size=(3, 4))
# small gradients make Adam's epsilon placement visible; varied signs and scales
GRADS = [rng.normal(size=(3, 4)) * s for s in (1.0, 1e-3, 0.5, 1e-4, 2.0)]


def _tf_apply(spec):
    import tensorflow as tf

    from tfpar.optimizers import make_optimizer

    v = tf.Variable(P0, dtype=tf.float64)
    opt = make_optimizer(spec)
    opt.build([v])
    out = []
    for g in GRADS:
        opt.apply([tf.constant(g)], [v])
        out.append(v.numpy().copy())
    return out


def _torch_apply(spec):
    import torch

    from torchref.optimizers import make_optimizer

    p = torch.nn.Parameter(torch.tensor(P0, dtype=torch.float64))
    opt = make_optimizer(spec, [p])
    out = []
    for g in GRADS:
        p.grad = torch.tensor(g)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


def _close(got, want, rtol=RTOL):
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("semantics", ["torch", "tf"])
@pytest.mark.parametrize("backend", ["tf", "torch"])
def test_exact_rules_match_numpy(name, semantics, backend):
    spec = dict(HP[name], semantics=semantics)
    got = (_tf_apply if backend == "tf" else _torch_apply)(spec)
    _close(got, np_update(name, semantics, spec, P0, GRADS))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_torch_native_is_torchs_rule(name):
    spec = dict(HP[name], semantics="native")
    _close(_torch_apply(spec), np_update(name, "torch", spec, P0, GRADS))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_keras_native_is_keras_rule_with_float32_hyperparameters(name):
    spec = dict(HP[name], semantics="native")
    got = _tf_apply(spec)
    _close(got, np_update(name, "tf", spec, P0, GRADS, keras_float32=True))
    # and the float32 hyperparameters are a real, measurable difference in float64
    exact = np_update(name, "tf", spec, P0, GRADS)
    gap = max(np.max(np.abs(a - b) / np.abs(b)) for a, b in zip(got, exact, strict=True))
    assert gap > 1e-11, gap


def test_adam_epsilon_placement_differs():
    spec = dict(HP["adam"], semantics="torch")
    t = np_update("adam", "torch", spec, P0, GRADS)
    k = np_update("adam", "tf", spec, P0, GRADS)
    gap = np.max(np.abs(t[0] - k[0]) / np.abs(P0))
    assert gap > 1e-9, gap


def test_momentum_forms_agree_for_constant_lr():
    spec = dict(HP["momentum"])
    _close(np_update("momentum", "torch", spec, P0, GRADS), np_update("momentum", "tf", spec, P0, GRADS), rtol=1e-13)
