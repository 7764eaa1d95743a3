"""Judging without float64: the one-ulp perturbation floor on real runs (docs/tolerance.md, rule 3).

A float32 case whose implementations cannot run float64 (a user's float32-only
plugin) is judged by re-running each side from its initial weights moved by one
float32 ulp. These tests show, on real tf.towers and torch.ddp runs, that the rule
gives parity for correct implementations, still catches seeded bugs (naming the
first step and the channel), and that ``compare_case`` picks it, and asks no
float64 run, exactly where a side declares float32 only.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from parity_tests.contract.case import Case
from parity_tests.judging.judge import PERTURBED, compare_case, perturbed_case
from parity_tests.judging.tolerance import RULE_FLOAT32, RULE_PERTURBATION
from parity_tests.running import registry
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import MLP, POLY, make

pytestmark = pytest.mark.usefixtures("pool")

PAIR = ["tf.towers", "torch.ddp"]
F32_ONLY = "test.float32-only-ddp"  # torch.ddp, declared as a float32-only plugin would be
RECORDED = "test.recorded-ddp"  # torch.ddp, declared as a recorded run (cannot be re-run)


def cases() -> list[Case]:
    """Two small float32 cases: the MLP with SGD, the polynomial model with Adam (exact rules on both sides)."""
    return [
        make(MLP, dtype="float32", optimizer__semantics="torch"),
        make(POLY, dtype="float32", optimizer__semantics="tf"),
    ]


@pytest.fixture
def declared() -> Iterator[None]:
    """Register the float32-only and the recorded stand-ins for the test, then remove them."""
    ddp = registry.resolve("torch.ddp")
    registry.register(registry.Implementation(F32_ONLY, "plugin", "torch", True, ("float32",), ddp.run))
    # what the judge reads of a recorded run is rerunnable=False (kind "recorded" is re-read from its file)
    registry.register(registry.Implementation(RECORDED, "plugin", "torch", True, ("float32",), ddp.run,
                                              rerunnable=False))
    yield
    for name in (F32_ONLY, RECORDED):
        registry._registry.pop(name, None)


def _one_ulp(before: np.ndarray, after: np.ndarray) -> bool:
    """``after`` is ``float32(before)`` moved one float32 ulp up or down, element by element."""
    b32 = np.asarray(before).astype(np.float32)
    a = np.asarray(after, dtype=np.float64)
    up = np.nextafter(b32, np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(b32, np.float32(-np.inf)).astype(np.float64)
    return bool(((a == up) | (a == down) | ((b32 == 0) & (a == 0))).all())  # exact zeros stay


def test_perturbed_case_moves_every_float32_input_by_one_ulp() -> None:
    mlp, poly = cases()
    moved = perturbed_case(mlp)
    assert all(_one_ulp(w, moved.init[name]) for name, w in mlp.init.items())
    assert _one_ulp(mlp.x, moved.x) and (moved.y == mlp.y).all()  # labels keep their range
    assert _one_ulp(mlp.spec["optimizer"]["lr"], moved.spec["optimizer"]["lr"])
    moved = perturbed_case(poly)
    for k in ("lr", "beta1", "beta2", "epsilon"):
        assert _one_ulp(poly.spec["optimizer"][k], moved.spec["optimizer"][k]), k
    assert moved.spec["optimizer"]["weight_decay"] == poly.spec["optimizer"]["weight_decay"] == 0  # a switch stays
    again = perturbed_case(poly)  # seeded: the same case gives the same perturbation
    assert again.spec == moved.spec and all((again.init[k] == moved.init[k]).all() for k in moved.init)


@pytest.mark.parametrize("index", [0, 1], ids=["mlp-sgd", "poly-adam"])
def test_correct_implementations_are_at_parity_by_the_perturbation_floor(index: int) -> None:
    case = cases()[index]
    r = compare_case(case, PAIR, floor="perturbation")
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("parity", RULE_PERTURBATION), r.summary()
    assert v.floor_a is not None and v.floor_b is not None and v.floor_a > 0 and v.floor_b > 0
    assert v.per_step_loss_gap is not None  # the loss was judged too
    assert not any(k.endswith("@float64") for k in r.trajectories)  # no float64 run was made
    assert {f"{i}@{PERTURBED}" for i in PAIR} <= set(r.trajectories)


def _lr_bug(case: Case, impl: str) -> dict[str, np.ndarray]:
    """torch.ddp steps with lr * (1 + 1e-3), in every run it makes (its perturbed rerun too)."""
    if impl == "torch.ddp":
        case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * (1 + 1e-3)})
    return run_impl(case, impl)


def _summed_gradients(case: Case, impl: str) -> dict[str, np.ndarray]:
    """torch.ddp sums the N device gradients instead of averaging them: its updates are N times too large."""
    if impl == "torch.ddp":
        case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * case.devices})
    return run_impl(case, impl)


def _loss_misreported(case: Case, impl: str) -> dict[str, np.ndarray]:
    """torch.ddp trains correctly but reports one device's loss scaled by 1 + 1e-3 (the curve a user publishes)."""
    traj = dict(run_impl(case, impl))
    if impl == "torch.ddp":
        traj["loss"] = (traj["loss"] * (1 + 1e-3)).astype(traj["loss"].dtype)
    return traj


@pytest.mark.parametrize(
    ("bug", "channel"),
    [(_lr_bug, "param/"), (_summed_gradients, "param/"), (_loss_misreported, "loss")],
    ids=["lr-1e-3", "summed-gradients", "loss-misreported"],
)
def test_seeded_bugs_are_caught_by_the_perturbation_floor(bug, channel: str) -> None:
    case = cases()[0]
    r = compare_case(case, PAIR, floor="perturbation", runner=bug)
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_PERTURBATION), r.summary()
    assert v.first_step == 1 and v.key is not None and v.key.startswith(channel), v.detail
    # the float64-based rule reaches the same verdict on the same bug
    v64 = compare_case(case, PAIR, floor="float64", runner=bug).pairs[0].verdict
    assert v64.status == "divergence" and v64.key is not None and v64.key.startswith(channel)


def test_a_float32_only_implementation_is_judged_by_the_perturbation_floor(declared: None) -> None:
    asked: list[str] = []
    case = cases()[0]
    r = compare_case(case, ["tf.towers", "torch.ddp", F32_ONLY], progress=asked.append)
    ddp, plugin = r.pairs
    assert (ddp.verdict.rule, plugin.verdict.rule) == (RULE_FLOAT32, RULE_PERTURBATION), r.summary()
    assert ddp.verdict.status == plugin.verdict.status == "parity", r.summary()
    # float64 runs only for the pair whose both sides declare float64; the plugin was never asked for one
    assert f"{F32_ONLY}@float64" not in asked and "tf.towers@float64" in asked
    assert {f"tf.towers@{PERTURBED}", f"{F32_ONLY}@{PERTURBED}"} <= set(asked)
    assert f"torch.ddp@{PERTURBED}" not in asked
    # and the default stays the float64-based rule when both sides declare float64
    assert compare_case(case, PAIR).pairs[0].verdict.rule == RULE_FLOAT32


def test_a_side_that_cannot_be_rerun_takes_the_other_sides_floor(declared: None) -> None:
    asked: list[str] = []
    r = compare_case(cases()[0], ["tf.towers", RECORDED], progress=asked.append)
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("parity", RULE_PERTURBATION), r.summary()
    assert v.floor_a == v.floor_b and "side B cannot be re-run" in v.detail
    assert f"{RECORDED}@{PERTURBED}" not in asked and f"tf.towers@{PERTURBED}" in asked
