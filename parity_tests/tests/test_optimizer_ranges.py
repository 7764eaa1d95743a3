"""Every hyperparameter's accepted range is the range both frameworks accept, derived from the frameworks.

For each optimizer and hyperparameter, values at and around every boundary
(:data:`PROBES`) are given to the real classes, built the way the tool builds
them: ``torch.optim`` by ``torchref.optimizers.make_optimizer`` and Keras 3 by
``tfpar.optimizers.make_optimizer`` (``native`` semantics). The case validation
must accept a value exactly when both frameworks accept it, except where
neither framework checks and the tool's own limit applies (:data:`TOOL_LIMITS`,
each with its reason, each checked to be the tool's own and to be real). A
refusal names the class that refuses (found in the traceback of its own
``ValueError``) and quotes its words.

Run as a script, it prints the derived table (``python -m parity_tests.tests.test_optimizer_ranges``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from parity_tests.contract.optimizer import validate_optimizer
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.optimizer_state import HYPERPARAMETERS, OPTIMIZERS
from parity_tests.tests.helpers import MLP, make, set_path

# at and around every boundary either framework or the tool has (0 and 1), and far beyond
PROBES = (-1.0, -1e-9, 0.0, 1e-9, 0.5, 1.0 - 1e-9, 1.0, 1.0 + 1e-9, 2.0, 1e3)

# Where neither framework checks: the tool's own limit, (accepts, reason). Checked below to be
# the tool's own (both frameworks accept the values it refuses) and real (what it refuses is NaN).
TOOL_LIMITS: dict[tuple[str, str], tuple[Callable[[float], bool], str]] = {
    ("rmsprop", "rho"): (lambda v: v <= 1.0, "rho > 1: 1 - rho < 0 makes the square average negative"),
}

PAIRS = [(name, key) for name in OPTIMIZERS for key in ("lr", *HYPERPARAMETERS[name]) if key != "centered"]


def _base(name: str) -> dict:
    """A valid native spec of ``name`` with every default filled in (constant schedule)."""
    return validate_optimizer({"name": name, "lr": 0.1, "semantics": "native"})


def _refusal(build: Callable[[], object]) -> tuple[str, str] | None:
    """``None`` if ``build()`` succeeds, else (the refusing class, its message up to the value)."""
    try:
        build()
    except ValueError as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        owner = tb.tb_frame.f_locals.get("self")
        cls = type(owner)
        prefix = "keras.optimizers" if cls.__module__.startswith("keras") else "torch.optim"
        return f"{prefix}.{cls.__name__}", str(e).split(":")[0]
    return None


def _torch(spec: dict) -> tuple[str, str] | None:
    from torchref.optimizers import make_optimizer

    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    return _refusal(lambda: make_optimizer(spec, [p]))


def _keras(spec: dict) -> tuple[str, str] | None:
    from tfpar.devices import configure_devices
    from tfpar.optimizers import make_optimizer

    configure_devices()  # before TensorFlow's first op, or the tower engine gets one device
    return _refusal(lambda: make_optimizer(spec))


def _tool(name: str, key: str, value: float) -> CaseError | None:
    raw = {"name": name, "lr": 0.1, "semantics": "native", key: value}
    try:
        validate_optimizer(raw)
    except CaseError as e:
        return e
    return None


def derive(name: str, key: str) -> list[dict]:
    """One row per probe: what torch, Keras, the tool's own limit and the case validation say."""
    rows = []
    for v in PROBES:
        spec = dict(_base(name), **{key: v})
        limit = TOOL_LIMITS.get((name, key))
        rows.append({"value": v, "torch": _torch(spec), "keras": _keras(spec),
                     "tool_limit_ok": limit is None or limit[0](v), "case": _tool(name, key, v)})
    return rows


@pytest.mark.parametrize(("name", "key"), PAIRS, ids=[f"{n}.{k}" for n, k in PAIRS])
def test_a_value_is_accepted_exactly_when_both_frameworks_accept_it(name, key):
    wrong = []
    for r in derive(name, key):
        both = r["torch"] is None and r["keras"] is None
        want = both and r["tool_limit_ok"]
        got = r["case"] is None
        if want != got:
            wrong.append(f"{key}={r['value']!r}: torch {r['torch'] or 'accepts'}, keras {r['keras'] or 'accepts'},"
                         f" tool limit {'ok' if r['tool_limit_ok'] else 'refuses'}; case validation "
                         f"{'accepts' if got else 'refuses: ' + str(r['case'])}")
            continue
        if got:
            continue
        msg = str(r["case"])
        assert r["case"].field == f"optimizer.{key}", msg
        # the message names every framework that refuses, with its words
        for side in ("torch", "keras"):
            if r[side] is not None:
                cls, says = r[side]
                assert cls in msg and says in msg, f"{key}={r['value']!r}: {cls} refuses ({says!r}), message: {msg}"
        if both:  # refused by the tool's own limit only: it says so
            assert "tfpar refuses" in msg and "neither framework checks" in msg, msg
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("name", "key"), list(TOOL_LIMITS), ids=[f"{n}.{k}" for n, k in TOOL_LIMITS])
def test_each_tool_limit_is_the_tools_own(name, key):
    """Both frameworks accept some value the tool refuses there (else it would be a framework check)."""
    refused_by_tool_only = [r for r in derive(name, key) if not r["tool_limit_ok"]]
    assert refused_by_tool_only
    assert all(r["torch"] is None and r["keras"] is None for r in refused_by_tool_only)


def _torch_rmsprop_step(**kw) -> np.ndarray:
    p = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.RMSprop([p], lr=0.1, foreach=False, **kw)
    p.grad = torch.tensor([0.5, -0.25], dtype=torch.float64)
    opt.step()
    return p.detach().numpy()


def _keras_rmsprop_step(**kw) -> np.ndarray:
    import keras
    import tensorflow as tf

    from tfpar.devices import configure_devices

    configure_devices()  # before TensorFlow's first op, or the tower engine gets one device
    v = tf.Variable([1.0, -2.0], dtype=tf.float64)
    opt = keras.optimizers.RMSprop(learning_rate=0.1, **kw)
    opt.apply_gradients([(tf.constant([0.5, -0.25], tf.float64), v)])
    return v.numpy()


def test_rho_above_one_is_nan_in_torch_from_the_first_step():
    assert np.isnan(_torch_rmsprop_step(alpha=1.5)).all()
    assert np.isfinite(_torch_rmsprop_step(alpha=1.0)).all()


@pytest.mark.parametrize(("rho", "centered"), [(1.0, False), (1.0, True), (0.0, True)],
                         ids=["rho1", "rho1-centered", "rho0-centered"])
def test_rmsprop_epsilon_0_where_every_update_divides_by_zero_is_refused(rho, centered):
    # both frameworks accept it and divide by zero at the first step, for a nonzero gradient
    assert not np.isfinite(_torch_rmsprop_step(alpha=rho, eps=0.0, centered=centered)).any()
    assert not np.isfinite(_keras_rmsprop_step(rho=rho, epsilon=0.0, centered=centered)).any()
    with pytest.raises(CaseError) as e:
        validate_optimizer({"name": "rmsprop", "lr": 0.1, "rho": rho, "centered": centered, "epsilon": 0.0})
    assert e.value.field == "optimizer.epsilon" and "every update divides by zero" in str(e.value)
    # any epsilon > 0 makes it finite, and is accepted
    assert np.isfinite(_torch_rmsprop_step(alpha=rho, eps=1e-9, centered=centered)).all()
    validate_optimizer({"name": "rmsprop", "lr": 0.1, "rho": rho, "centered": centered, "epsilon": 1e-9})


@pytest.mark.parametrize("kind", ["warmup_linear", "step"])
def test_lr_0_with_a_schedule_is_refused_because_the_torch_side_divides_by_lr(kind):
    """torch and Keras accept lr 0; the tool's LambdaLR factor lr_t / lr does not (lift this when it does)."""
    from torchref.optimizers import make_scheduler

    schedule = ({"kind": "warmup_linear", "warmup_steps": 3} if kind == "warmup_linear"
                else {"kind": "step", "boundaries": [2], "values": [0.0, 0.1]})
    raw = {"name": "sgd", "schedule": schedule, **({"lr": 0.0} if kind == "warmup_linear" else {})}
    with pytest.raises(CaseError, match="LambdaLR"):
        validate_optimizer(raw)
    spec = dict(_base("sgd"), lr=0.0, schedule=schedule)
    assert _torch(spec) is None and _keras(spec) is None
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        make_scheduler(spec, torch.optim.SGD([p], lr=0.0))
    # a constant schedule takes lr 0, and later step values may be 0
    validate_optimizer({"name": "sgd", "lr": 0.0})
    validate_optimizer({"name": "sgd", "schedule": {"kind": "step", "boundaries": [2], "values": [0.1, 0.0]}})


@pytest.mark.parametrize("value", [-1e-9, -1.0])
def test_a_step_schedule_value_is_a_learning_rate(value):
    with pytest.raises(CaseError) as e:
        validate_optimizer({"name": "adam", "schedule": {"kind": "step", "boundaries": [2], "values": [0.1, value]}})
    assert e.value.field == "optimizer.schedule.values[1]"
    assert "torch.optim.Adam refuses lr < 0: 'Invalid learning rate'" in str(e.value)


def test_the_refusal_message_names_the_framework():
    with pytest.raises(CaseError) as e:
        validate_optimizer({"name": "adam", "lr": 0.1, "epsilon": -1.0})
    assert str(e.value) == ("optimizer.epsilon: expected a number >= 0 (torch.optim.Adam refuses eps < 0:"
                            " 'Invalid epsilon value'), got -1.0")
    with pytest.raises(CaseError) as e:
        validate_optimizer({"name": "momentum", "lr": 0.1, "momentum": 1.5})
    assert str(e.value) == ("optimizer.momentum: expected a number >= 0 and <= 1 (keras.optimizers.SGD refuses"
                            " momentum > 1: '`momentum` must be a float between [0, 1].'), got 1.5")


# ---------------------------------------------------------------- end to end: epsilon 0 runs to a verdict

# tanh, not relu: no gradient element is exactly 0, so no 0/0 with epsilon 0
_TANH_MLP = set_path(MLP, "model.layers.0.activation", "tanh")


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("semantics", ["torch", "tf", "native"])
@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_epsilon_0_runs_on_towers_and_ddp_to_a_verdict(name, semantics):
    """torch / tf semantics: parity. native: Keras' float32 roundings in a float64 run (lr mapped, Adam's
    bias-correction betas not) still show, so an expected difference (measured: 3.9e-7 Adam, 3.6e-9 RMSprop)."""
    from parity_tests.session.comparison import compare_case

    case = make(_TANH_MLP, parallel__devices=2, optimizer={"name": name, "lr": 0.01, "epsilon": 0.0,
                                                          "semantics": semantics})
    assert case.spec["dtype"] == "float64" and case.spec["optimizer"]["epsilon"] == 0.0
    r = compare_case(case, ["tf.towers", "torch.ddp"])
    assert r.as_expected, r.summary()
    if semantics == "native":
        assert r.pairs[0].verdict.status in ("parity", "expected_difference"), r.summary()
    else:
        assert r.parity and r.pairs[0].verdict.rule == "float64 bound", r.summary()


@pytest.mark.usefixtures("pool")
def test_epsilon_0_with_a_dead_relu_unit_is_nan_on_both_sides():
    """The one division by zero epsilon 0 allows: a gradient element exactly 0 so far gives 0/0 in both rules."""
    from parity_tests.session.comparison import compare_case

    case = make(MLP, parallel__devices=2, optimizer={"name": "adam", "lr": 0.01, "epsilon": 0.0, "semantics": "torch"})
    v = compare_case(case, ["tf.towers", "torch.ddp"]).pairs[0].verdict
    assert v.rule == "non-finite values" and "both trajectories are NaN from step 1" in v.detail, v.detail


def main() -> None:
    """Print the derived table: per optimizer and hyperparameter, the probes each side refuses."""
    def refused(rows, side):
        out = [repr(r['value']) for r in rows if r[side] is not None]
        return ", ".join(out) or "-"

    print("| hyperparameter | torch refuses | Keras refuses | tool limit refuses | case validation refuses |")
    print("| --- | --- | --- | --- | --- |")
    for name, key in PAIRS:
        rows = derive(name, key)
        tool = ", ".join(repr(r['value']) for r in rows if not r["tool_limit_ok"]) or "-"
        case = ", ".join(repr(r['value']) for r in rows if r["case"] is not None) or "-"
        print(f"| {name}.{key} | {refused(rows, 'torch')} | {refused(rows, 'keras')} | {tool} | {case} |")


if __name__ == "__main__":
    main()
