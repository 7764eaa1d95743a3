"""Judging without float64: the one-ulp perturbation floor on real runs (docs/tolerance.md, rule 3).

A float32 case whose implementations cannot run float64 (a user's float32-only
plugin) is judged by re-running each side from its initial weights, inputs and
hyperparameters moved by one float32 ulp, and a built-in's rows reordered (within each
device's shard, or, where the N-device update is the full-batch one, the whole batch on one
device).
These tests show, on real tf.towers and torch.ddp runs, that the rule gives
parity for correct implementations, still catches seeded bugs (naming the first step
and the channel), and that ``compare_case`` picks it, and asks no float64 run, exactly
where a side declares float32 only; that the reordered rerun is the same computation
in exact arithmetic (dropout masks follow their rows) with other rounding; and that
the loss bound carries the parameters' accepted gap, and no more.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np
import pytest

from parity_tests.contract.case import Case
from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR, FLOAT64_RTOL
from parity_tests.judging.perturbation import judge_perturbation, perturb_ulp, shard_permutation
from parity_tests.judging.verdict import RULE_FLOAT32, RULE_PERTURBATION
from parity_tests.protocol.engine import EngineSpec
from parity_tests.reporting.matrix import matrix_cases
from parity_tests.running import registry
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import (
    PERTURBED,
    _reordered,
    _rerun_of,
    compare_case,
    perturbed_case,
)
from parity_tests.tests.helpers import CNN, MLP, POLY, make
from parity_tests.tests.synthetic_runs import perturbation_runs, truth

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
    registry.register(registry.Implementation(EngineSpec(F32_ONLY, "plugin", "torch", True, ("float32",)), ddp.run))
    # what the judge reads of a recorded run is rerunnable=False (kind "recorded" is re-read from its file)
    registry.register(registry.Implementation(EngineSpec(RECORDED, "plugin", "torch", True, ("float32",),
                                                         rerunnable=False), ddp.run))
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
    rows = moved.rows  # each device's shard reordered within itself (test_shard_permutation_*)
    assert not (rows == np.arange(rows.size)).all()
    assert _one_ulp(mlp.x[rows], moved.x) and (moved.y == mlp.y[rows]).all()  # labels keep their range
    assert _one_ulp(mlp.spec["optimizer"]["lr"], moved.spec["optimizer"]["lr"])
    moved = perturbed_case(poly)
    for k in ("lr", "beta1", "beta2", "epsilon"):
        assert _one_ulp(poly.spec["optimizer"][k], moved.spec["optimizer"][k]), k
    assert moved.spec["optimizer"]["weight_decay"] == poly.spec["optimizer"]["weight_decay"] == 0  # a switch stays
    again = perturbed_case(poly)  # seeded: the same case gives the same perturbation
    assert again.spec == moved.spec and all((again.init[k] == moved.init[k]).all() for k in moved.init)


def test_a_step_schedules_learning_rates_are_moved_together_with_lr() -> None:
    schedule = {"kind": "step", "boundaries": [2], "values": [0.05, 0.01]}
    case = make(MLP, dtype="float32", optimizer={"name": "sgd", "lr": 0.05, "schedule": schedule})
    moved = perturbed_case(case).spec["optimizer"]
    assert all(_one_ulp(v, w) for v, w in zip(schedule["values"], moved["schedule"]["values"], strict=True))
    assert moved["lr"] == moved["schedule"]["values"][0]  # what validation asks: lr is the schedule's first value


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


# The seeded bugs are in the float32-only stand-in: rule 3 judges what cannot run float64, a user's
# plugin, and a plugin's rerun keeps its row order and its device count (a built-in's computes the
# full batch on one device, where an N-dependent bug of its own would not reproduce)
def _lr_bug(case: Case, impl: str) -> dict[str, np.ndarray]:
    """The DDP side steps with lr * (1 + 1e-3), in every run it makes (its perturbed rerun too)."""
    if impl in ("torch.ddp", F32_ONLY):
        case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * (1 + 1e-3)})
    return run_impl(case, impl)


def _summed_gradients(case: Case, impl: str) -> dict[str, np.ndarray]:
    """The DDP side sums the N device gradients instead of averaging them: its updates are N times too large."""
    if impl in ("torch.ddp", F32_ONLY):
        case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * case.devices})
    return run_impl(case, impl)


def _loss_misreported(case: Case, impl: str) -> dict[str, np.ndarray]:
    """The DDP side trains correctly but reports one device's loss scaled by 1 + 1e-3 (the curve a user publishes)."""
    traj = dict(run_impl(case, impl))
    if impl in ("torch.ddp", F32_ONLY):
        traj["loss"] = (traj["loss"] * (1 + 1e-3)).astype(traj["loss"].dtype)
    return traj


@pytest.mark.parametrize(
    ("bug", "channel"),
    [(_lr_bug, "param/"), (_summed_gradients, "param/"), (_loss_misreported, "loss")],
    ids=["lr-1e-3", "summed-gradients", "loss-misreported"],
)
def test_seeded_bugs_are_caught_by_the_perturbation_floor(declared: None, bug, channel: str) -> None:
    case = cases()[0]
    asked: list[str] = []
    r = compare_case(case, ["tf.towers", F32_ONLY], floor="perturbation", runner=bug, progress=asked.append)
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_PERTURBATION), r.summary()
    assert v.first_step == 1 and v.key is not None and v.key.startswith(channel), v.detail
    assert f"{F32_ONLY}@{PERTURBED}" in asked  # the bug is in both of the plugin's runs
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


# ---------------------------------------------------------------- the reordered rerun (summation order)


@pytest.mark.parametrize("shard", ["contiguous", "strided"])
def test_shard_permutation_reorders_each_shard_within_itself(shard: str) -> None:
    steps, batch, n = 3, 10, 4  # uneven shards (3, 3, 2, 2)
    idx = shard_permutation(steps, batch, n, shard, seed=5)
    base = np.arange(batch)
    parts = np.array_split(base, n) if shard == "contiguous" else [base[r::n] for r in range(n)]
    for k in range(steps):
        for rows in parts:  # every device keeps its rows (only their order changes)
            assert sorted(idx[k * batch + rows]) == list(k * batch + rows), (k, rows)
    assert (idx != np.arange(steps * batch)).any()
    assert (shard_permutation(steps, batch, n, shard, seed=5) == idx).all()  # seeded
    assert (shard_permutation(steps, batch, n, shard, seed=6) != idx).any()


def test_the_reordered_rerun_changes_the_rounding_not_the_computation() -> None:
    """The CNN (sync batch norm, dropout) at 2 devices: reordering each shard's rows leaves the
    float64 run within the float64 bound (the masks follow their rows), and moves the float32 run
    (the order of every sum over examples changed). Reordering the data without its masks is a
    different computation: the same check then fails by orders of magnitude."""
    c64 = make(CNN, parallel__devices=2, steps=2, data__global_batch=16)
    c32 = c64.replace(dtype="float32")
    idx = perturbed_case(c32).rows
    assert idx is not None

    def gap(x: dict, y: dict) -> float:  # the greatest relative gap over the parameters, state and loss
        keys = [k for k in x if k.startswith(("param/", "state/")) or k == "loss"]
        return max(float(np.abs(np.asarray(x[k], np.float64) - y[k]).max() / max(np.abs(y[k]).max(), 1e-2))
                   for k in keys)

    run64 = run_impl(c64, "tf.towers")
    same = gap(run_impl(_reordered(c64, idx), "tf.towers"), run64)
    assert same <= FLOAT64_RTOL, same
    moved = gap(run_impl(_reordered(c32, idx), "tf.towers"), run_impl(c32, "tf.towers"))
    assert moved > 0.0
    unmasked = dataclasses.replace(c64, x=c64.x[idx], y=c64.y[idx])  # the masks stay with the old row numbers
    assert gap(run_impl(unmasked, "tf.towers"), run64) > 1e3 * FLOAT64_RTOL


def test_the_detail_says_how_the_floor_was_made() -> None:
    v = compare_case(cases()[0], PAIR, floor="perturbation").pairs[0].verdict
    # the MLP's 4-device update is the full-batch one (grad_mean, equal shards): rows may change device
    assert ("moved by one float32 ulp and each step's rows reordered, the full batch computed on one device"
            in v.detail), v.detail
    # a sampler's rows are a dataset read through its own permutation, not one batch per step: not reordered
    sampler = cases()[0].replace(**{"data.order": "distributed_sampler", "parallel.shard": "strided"})
    assert getattr(perturbed_case(sampler), "rows", None) is None


def test_shard_permutation_across_devices_permutes_each_step_as_a_whole() -> None:
    steps, batch, n = 2, 12, 4
    idx = shard_permutation(steps, batch, n, "contiguous", seed=5, across=True)
    for k in range(steps):  # each step reads its own rows, now in any device's shard
        assert sorted(idx[k * batch:(k + 1) * batch]) == list(range(k * batch, (k + 1) * batch))
    shard_of = np.arange(batch) // (batch // n)
    assert (shard_of[idx[:batch]] != shard_of).any()  # some rows moved to another device


@pytest.mark.parametrize(("bn", "across"), [("sync", True), ("local", False)])
def test_rows_change_device_only_where_theory_says_the_update_is_the_full_batch_one(bn: str, across: bool) -> None:
    """Synchronized batch norm: the N-device update is the full-batch one, so the rerun may give every
    device other examples. Local batch norm: each device's statistics are its own rows', so they stay."""
    case = make(CNN, dtype="float32", parallel__devices=2, parallel__batch_norm=bn)
    moved = perturbed_case(case)
    batch = case.spec["data"]["global_batch"]
    first_half = np.arange(moved.rows.size) % batch < batch // 2  # contiguous: device 0 holds each step's first half
    assert moved.across is across
    assert bool(((moved.rows % batch < batch // 2) != first_half).any()) is across
    # and where they may, a built-in's rerun computes the whole batch on one device
    assert (moved.devices, moved.run_devices) == ((1, 2) if across else (2, None))


def test_a_plugins_rerun_keeps_its_device_count_and_row_order(declared: None) -> None:
    """An N-dependent bug (an extra 1/N) must reproduce in the buggy plugin's rerun: only a
    built-in's rerun, whose N-device update is checked against one device in float64, moves to one."""
    case = cases()[0]  # the MLP at 4 devices, grad_mean: the 4-device update is the full-batch one
    moved = perturbed_case(case)
    builtin, plugin = _rerun_of(moved, "torch.ddp"), _rerun_of(moved, F32_ONLY)
    assert builtin.devices == 1 and (builtin.x == moved.x).all()
    assert plugin.devices == case.devices == 4
    assert (plugin.y == case.y).all() and _one_ulp(case.x, plugin.x)  # the original rows, moved by one ulp


def test_a_reduction_of_repeated_terms_is_sampled_by_the_one_device_rerun() -> None:
    """The matrix's CNN with synchronized batch norm at 2 devices (28x28 digits): half of every
    batch-norm statistic's terms are one number (the conv bias at a blank window), and
    tf.towers' float32 sums round at each of them alike, in any order (its error on
    ``1.beta``, measured against float64: 1.8e-5 of the scale; torch.ddp's, which sums in
    double: 2.7e-7). The rows reordered across the devices sampled 4.0e-6 of it, so rule 3 put
    this pair at 2.2 times its bound where the float64 runs prove it equal. A rerun of the
    full batch on one device sums with other lengths, and the rules agree."""
    case = next(c for c in matrix_cases(devices=(2,), dtypes=("float32",), expected_rows=False)
                if c.name == "cnn-bn-sync:n2:grad_mean:float32")
    r = compare_case(case, PAIR, floor="perturbation")
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("parity", RULE_PERTURBATION), r.summary()
    assert "the full batch computed on one device" in v.detail, v.detail
    assert v.floor_a is not None and v.floor_a > 9e-6  # tf.towers' systematic rounding (1.8e-5) now in its floor


def _traj(params: np.ndarray, loss: np.ndarray, grads: np.ndarray | None) -> dict[str, np.ndarray]:
    t = {"param/0.kernel": params.astype(np.float32), "loss": loss.astype(np.float32)}
    if grads is not None:
        t["grad/0.kernel"] = grads.astype(np.float32)
    return t


def test_the_loss_bound_carries_the_parameter_gap_the_parameter_channel_accepts() -> None:
    """Two sides whose parameters part by rounding (within the parameter channel's bound) compute losses
    that part by S x that gap: the loss channel must accept what the parameters explain, and no more."""
    steps = 3
    base = np.ones((steps + 1, 4))
    pgap = np.array([0.0, 1e-6, 1e-6, 1e-6])[:, None]  # the two sides' parameter gap, row by row
    spread = np.array([0.0, 6e-7, 6e-7, 6e-7])[:, None]  # each side's rerun spread: bound 2 x 6e-7 + 2.4e-7
    grads = np.ones((steps, 4))  # ||g||_1 = 4 at parameters of size 1: S = 4 / L
    loss = np.array([1.0, 0.9, 0.8])
    carried = 4 / loss * pgap[:steps, 0]  # S[r] x pgap[r]: 0, 4.4e-6, 5e-6
    lb = loss * (1 + 0.8 * carried)  # within the carried term, 10 to 20 times the sampled loss bound
    a, b = _traj(base, loss, grads), _traj(base + pgap, lb, grads)
    ap, bp = _traj(base + spread, loss, grads), _traj(base + pgap - spread, lb, grads)
    v = judge_perturbation(a, b, a32p=ap, b32p=bp)
    assert v.status == "parity", v.detail
    # without recorded gradients nothing bounds the carried part: the same loss gap is a divergence
    no_grads = [{k: x for k, x in t.items() if not k.startswith("grad/")} for t in (a, b, ap, bp)]
    v = judge_perturbation(no_grads[0], no_grads[1], a32p=no_grads[2], b32p=no_grads[3])
    assert (v.status, v.key) == ("divergence", "loss"), v.detail
    # and a loss gap beyond what the parameters carry is still one
    worse = _traj(base + pgap, loss * (1 + 3 * carried), grads)
    v = judge_perturbation(a, worse, a32p=ap, b32p=_traj(base + pgap - spread, loss * (1 + 3 * carried), grads))
    assert (v.status, v.key) == ("divergence", "loss"), v.detail


POSITION_BUG = "test.position-bug-ddp"  # a float32-only DDP plugin that reads the wrong row at one place


def _position_bug(case: Case, progress=None) -> dict[str, np.ndarray]:
    """torch.ddp where each rank's last row is replaced by its first (an off-by-one slice, say)."""
    b, n = case.spec["data"]["global_batch"], case.devices
    x, y = case.x.copy(), case.y.copy()
    for k in range(case.spec["steps"]):
        for rows in np.array_split(np.arange(b), n):
            x[k * b + rows[-1]], y[k * b + rows[-1]] = x[k * b + rows[0]], y[k * b + rows[0]]
    return registry.resolve("torch.ddp").run(dataclasses.replace(case, x=x, y=y), progress)


@pytest.fixture
def position_bug() -> Iterator[None]:
    registry.register(registry.Implementation(EngineSpec(POSITION_BUG, "plugin", "torch", True, ("float32",)), _position_bug))
    yield
    registry._registry.pop(POSITION_BUG, None)


def test_a_plugins_rerun_keeps_its_row_order_so_a_position_bug_still_shows(position_bug: None) -> None:
    """Reordered, the plugin's rerun would read another row at the bug's place: a spread of the bug's
    size, not rounding (measured: parity at gap 6.1e-3 against a bound of 8.5e-3). In order, the bug
    reproduces in the rerun and stays out of the floor."""
    r = compare_case(cases()[0], ["tf.towers", POSITION_BUG])
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_PERTURBATION), r.summary()
    assert f"in a built-in's rerun only (kept in order: {POSITION_BUG})" in v.detail, v.detail
    assert v.floor_b is not None and v.floor_b < 1e-5  # rounding, not the bug


def test_a_hyperparameter_at_the_end_of_its_range_is_moved_inward():
    """momentum 1.0 (both frameworks accept it) moved one ulp up would be refused as bad input: it moves down."""
    case = make(MLP, dtype="float32", optimizer={"name": "momentum", "lr": 0.01, "momentum": 1.0})
    for seed in range(4):  # both coins of the perturbation: never out of range
        moved = perturbed_case(case.replace(seed=seed)).spec["optimizer"]["momentum"]
        assert moved == float(np.nextafter(np.float32(1.0), np.float32(0.0)))



# ---------------------------------------------------------------- the rule on synthetic runs


def test_perturb_ulp_moves_every_element_by_one_float32_ulp_seeded() -> None:
    init = {"0.kernel": np.random.default_rng(0).normal(size=(4, 3)), "0.bias": np.zeros(3)}
    p = perturb_ulp(init, seed=5)
    k32 = init["0.kernel"].astype(np.float32)
    moved = p["0.kernel"].astype(np.float32)
    assert p["0.kernel"].dtype == np.float64 and (moved.astype(np.float64) == p["0.kernel"]).all()
    ups = moved == np.nextafter(k32, np.float32(np.inf))
    downs = moved == np.nextafter(k32, np.float32(-np.inf))
    assert (ups | downs).all() and ups.any() and downs.any()
    assert (p["0.bias"] == 0).all()  # an exact zero is not rounded by storage: it stays
    assert all((perturb_ulp(init, seed=5)[k] == p[k]).all() for k in p)  # reproducible
    assert not (perturb_ulp(init, seed=6)["0.kernel"] == p["0.kernel"]).all()



def test_perturbation_floor_parity_and_figures() -> None:
    a32, b32, a32p, b32p = perturbation_runs()
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=b32p)
    assert (v.status, v.rule) == ("parity", RULE_PERTURBATION), v.detail
    assert v.floor_a is not None and 1e-7 < v.floor_a < 1e-5
    assert v.per_step_floor is not None and v.per_step_bound is not None
    np.testing.assert_allclose(v.per_step_bound, 2 * v.per_step_floor + FLOAT32_ABS_FLOOR)
    assert "one-ulp perturbation" in v.detail
    json.dumps(v.to_dict(), allow_nan=False)



def test_perturbation_floor_catches_what_is_above_float32_noise() -> None:
    # a bug is reproduced by the buggy side's perturbed rerun too
    a32, b32, a32p, b32p = perturbation_runs()
    for t in (b32, b32p):
        t["param/1.kernel"][3:] *= np.float32(1 + 1e-3)
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=b32p)
    assert (v.status, v.rule, v.first_step, v.key) == ("divergence", RULE_PERTURBATION, 3, "param/1.kernel")
    a32, b32, a32p, b32p = perturbation_runs()
    for t in (b32, b32p):
        t["loss"][1:] *= np.float32(1 + 1e-3)
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=b32p, expect_difference=True)
    assert (v.status, v.key, v.first_step) == ("expected_difference", "loss", 2)



def test_a_side_that_cannot_rerun_takes_the_other_sides_floor() -> None:
    a32, b32, a32p, _ = perturbation_runs()
    v = judge_perturbation(a32, b32, a32p=a32p, b32p=None)
    assert v.status == "parity" and v.floor_a == v.floor_b
    assert "side B cannot be re-run" in v.detail
    with pytest.raises(ValueError, match="needs a perturbed run"):
        judge_perturbation(a32, b32, a32p=None, b32p=None)
    with pytest.raises(ValueError, match=r"side A32 perturbed, param/0\.bias: expected float32"):
        judge_perturbation(a32, b32, a32p=truth(), b32p=None)

