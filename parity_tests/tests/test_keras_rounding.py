"""Keras' float32 hyperparameters in a float64 run: measured bit for bit, and mapped onto the other side.

Three layers, each able to fail on its own:

1. Keras itself (no tool code): a float64 Keras 3 optimizer reproduces, *bit for bit*, a numpy
   transcription of its rule in which exactly the uses ``contract.optimizer.keras_float32`` names
   are rounded to float32 -- and every one of those roundings is needed, and rounding any other
   use breaks the match. If Keras changes where it rounds, this fails first.
2. The engines: torch's ``KerasRule`` with ``keras_rounding`` reproduces Keras' own class to
   float64 rounding (and without it does not), for every optimizer, weight decay and schedule.
3. The judge: a built-in side is mapped onto what a plugin's Keras optimizer held, found out
   from the plugin's own optimizer (floatx float32 or float64), never from a flag.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from parity_tests.judging.rules import judge_float64
from parity_tests.protocol.hyper import keras_float32
from parity_tests.running.backends import tf_module
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

P0 = np.array([1.0, -2.0, 0.5, 0.3])
GS = [np.array([0.3, -0.7, 1.1, 0.01]), np.array([0.2, 0.9, -0.4, -0.02]), np.array([-0.5, 0.1, 0.3, 0.05]),
      np.array([0.05, -0.3, 0.2, 0.4])]
HP = {"lr": 0.0123, "momentum": 0.9123, "weight_decay": 0.0311, "beta1": 0.91, "beta2": 0.9991, "epsilon": 1.3e-3,
      "rho": 0.913, "initial_accumulator": 0.1123}
# every place a Python float enters a Keras rule (the candidates a float64 run could round)
USES = ("lr", "momentum", "weight_decay", "beta_power", "one_minus_beta", "epsilon", "rho", "initial_accumulator")
OPTIMIZERS = {  # name -> (Keras constructor keyword arguments, uses that exist in its rule)
    "sgd": ({"weight_decay": HP["weight_decay"]}, ("lr", "weight_decay")),
    "momentum": ({"momentum": HP["momentum"]}, ("lr", "momentum")),
    "nesterov": ({"momentum": HP["momentum"], "nesterov": True}, ("lr", "momentum")),
    "adam": ({"beta_1": HP["beta1"], "beta_2": HP["beta2"], "epsilon": HP["epsilon"]},
             ("lr", "beta_power", "one_minus_beta", "epsilon")),
    "adamw": ({"beta_1": HP["beta1"], "beta_2": HP["beta2"], "epsilon": HP["epsilon"], "weight_decay": HP["weight_decay"]},
              ("lr", "beta_power", "one_minus_beta", "epsilon", "weight_decay")),
    "rmsprop": ({"rho": HP["rho"], "epsilon": HP["epsilon"], "momentum": 0.7123, "centered": True},
                ("lr", "rho", "epsilon", "momentum")),
    "adagrad": ({"initial_accumulator_value": HP["initial_accumulator"], "epsilon": HP["epsilon"]},
                ("lr", "initial_accumulator", "epsilon")),
}


def _keras(name: str, floatx: str) -> np.ndarray:
    tf_module()  # TensorFlow started as the tool starts it (its logical devices fixed once per process)
    import keras
    import tensorflow as tf

    kw, _ = OPTIMIZERS[name]
    cls = {"sgd": "SGD", "momentum": "SGD", "nesterov": "SGD", "adam": "Adam", "adamw": "AdamW",
           "rmsprop": "RMSprop", "adagrad": "Adagrad"}[name]
    before = keras.config.floatx()
    keras.config.set_floatx(floatx)
    try:
        opt = getattr(keras.optimizers, cls)(HP["lr"], **kw)
        v = tf.Variable(P0.copy(), dtype=tf.float64)
        for g in GS:
            opt.apply_gradients([(tf.constant(g), v)])
        return v.numpy()
    finally:
        keras.config.set_floatx(before)


def _rule(name: str, rounded: set[str]) -> np.ndarray:
    """Keras' published rule for ``name`` in float64 numpy, the uses in ``rounded`` passed through float32."""
    kw, _ = OPTIMIZERS[name]

    def r(x: float, use: str) -> float:
        return float(np.float32(x)) if use in rounded else x

    p, st = P0.copy(), {}
    for t, g in enumerate(GS, 1):
        lr = r(HP["lr"], "lr")
        wd = kw.get("weight_decay", 0.0)
        if wd:
            p = p - p * r(wd, "weight_decay") * lr
        if name in ("sgd", "momentum", "nesterov"):
            mu = kw.get("momentum", 0.0)
            if mu:
                m = st.get("m", np.zeros_like(p)) * r(mu, "momentum") - g * lr
                st["m"] = m
                p = p + (m * r(mu, "momentum") - g * lr if name == "nesterov" else m)
            else:
                p = p - g * lr
        elif name in ("adam", "adamw"):
            b1, b2, eps = kw["beta_1"], kw["beta_2"], kw["epsilon"]
            m, v = st.get("m", np.zeros_like(p)), st.get("v", np.zeros_like(p))
            alpha = lr * np.sqrt(1 - np.power(r(b2, "beta_power"), float(t))) / (1 - np.power(r(b1, "beta_power"), float(t)))
            m = m + (g - m) * r(1 - b1, "one_minus_beta")
            v = v + (g * g - v) * r(1 - b2, "one_minus_beta")
            st["m"], st["v"] = m, v
            p = p - (m * alpha) / (np.sqrt(v) + r(eps, "epsilon"))
        elif name == "rmsprop":
            rho, eps, mu = kw["rho"], kw["epsilon"], kw["momentum"]
            s = r(rho, "rho") * st.get("s", np.zeros_like(p)) + r(1 - rho, "rho") * g * g
            a = r(rho, "rho") * st.get("a", np.zeros_like(p)) + r(1 - rho, "rho") * g
            st["s"], st["a"] = s, a
            inc = (lr * g) / np.sqrt(s - a * a + r(eps, "epsilon"))
            st["b"] = r(mu, "momentum") * st.get("b", np.zeros_like(p)) + inc
            p = p - st["b"]
        else:
            acc = st.get("acc", np.full_like(p, r(kw["initial_accumulator_value"], "initial_accumulator"))) + g * g
            st["acc"] = acc
            p = p - (lr * g) / np.sqrt(acc + r(kw["epsilon"], "epsilon"))
    return p


def _table(name: str, floatx: str) -> set[str]:
    """The uses ``keras_float32`` says a Keras optimizer made under ``floatx`` rounds."""
    spec = {"name": name, "keras_rounding": f"floatx_{floatx}"}
    _, uses = OPTIMIZERS[name]
    return {u for u in uses if keras_float32(spec, u)}


@pytest.mark.parametrize("floatx", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras_rounds_exactly_the_uses_the_table_names(name, floatx):
    keras_result = _keras(name, floatx)
    table = _table(name, floatx)
    assert np.array_equal(_rule(name, table), keras_result), f"{name}/{floatx}: the table's roundings {sorted(table)}"
    _, uses = OPTIMIZERS[name]
    for use in uses:  # each rounding named is needed, and no other use is rounded
        changed = table ^ {use}
        assert not np.array_equal(_rule(name, changed), keras_result), f"{name}/{floatx}: {use} {'un' * (use in table)}rounded"


def test_the_rounding_matters_at_every_use_the_test_changes():
    """The test above can fail: each use, flipped alone, moves the float64 result (else it would prove nothing)."""
    for name, (_, uses) in OPTIMIZERS.items():
        for use in uses:
            assert not np.array_equal(_rule(name, {use}), _rule(name, set())), (name, use)
    assert set(itertools.chain.from_iterable(u for _, u in OPTIMIZERS.values())) <= set(USES)


ENGINE_OPTIMIZERS = [
    {"name": "sgd", "lr": 0.0123, "weight_decay": 0.031},
    {"name": "momentum", "lr": 0.0123, "momentum": 0.9123, "weight_decay": 0.031},
    {"name": "nesterov", "lr": 0.0123, "momentum": 0.9123},
    {"name": "adam", "lr": 0.0123, "beta1": 0.91, "beta2": 0.9991, "epsilon": 1.3e-3, "weight_decay": 0.01},
    {"name": "amsgrad", "lr": 0.0123, "beta1": 0.91, "beta2": 0.9991, "epsilon": 1.3e-3},
    {"name": "adamw", "lr": 0.0123, "weight_decay": 0.031, "beta1": 0.91, "beta2": 0.9991, "epsilon": 1.3e-3},
    {"name": "rmsprop", "lr": 0.0123, "rho": 0.913, "epsilon": 1.3e-3, "momentum": 0.7, "centered": True},
    {"name": "adagrad", "lr": 0.0123, "initial_accumulator": 0.1123, "epsilon": 1.3e-3, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.0123, "momentum": 0.9,
     "schedule": {"kind": "step", "boundaries": [2], "values": [0.0123, 0.00311]}},
    {"name": "adam", "lr": 0.0123, "schedule": {"kind": "warmup_linear", "warmup_steps": 3}},
]


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("opt", ENGINE_OPTIMIZERS, ids=lambda o: o["name"] + "-" + o.get("schedule", {}).get("kind", ""))
def test_torch_keras_rule_with_keras_rounding_is_keras_own_class(opt):
    native = make(MLP, optimizer=dict(opt, semantics="native"), parallel__devices=1, steps=5)
    mapped = native.replace(**{"optimizer.semantics": "tf", "optimizer.keras_rounding": "floatx_float32"})
    exact = native.replace(**{"optimizer.semantics": "tf"})
    keras_run = run_impl(native, "tf.single")
    assert judge_float64(keras_run, run_impl(mapped, "torch.single")).gap < 1e-14  # float64 rounding only
    assert judge_float64(keras_run, run_impl(exact, "torch.single")).gap > 1e-10  # the rounding is real here
    assert judge_float64(keras_run, run_impl(mapped, "tf.single")).gap == 0  # tf: Keras' own class under that floatx


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_keras_code_with_floatx_float64_is_mapped_as_what_it_held(name):
    """Keras code that sets floatx float64 keeps its rate exact: the torch side must not round it (was 1.5e-8)."""
    from parity_tests.tests.plugins import tf_plugins

    opt = {"name": name, "lr": 0.0123, **({"momentum": 0.9123} if name == "momentum" else {"epsilon": 1.3e-3})}
    case = make(MLP, optimizer=opt, parallel__devices=2)
    plugin = f"{tf_plugins.__file__}:keras_floatx64"
    p = compare_case(case, ["torch.ddp", plugin]).pairs[0]
    assert p.mapping == "torch.ddp run with optimizer.semantics tf, optimizer.keras_rounding floatx_float64", p.mapping
    assert p.residual is not None and p.residual.status == "parity" and p.residual.gap < 1e-14, p.residual
    assert p.verdict.status == ("parity" if name == "momentum" else "expected_difference"), p.verdict.detail
    default = compare_case(case, ["torch.ddp", f"{tf_plugins.__file__}:keras_sgd"]).pairs[0]
    assert default.mapping.endswith("floatx_float32") and default.residual.gap < 1e-14
