"""The bfloat16 rule (parity_tests.judging.bfloat16): each side within F x rho x spread of its float64 run.

Synthetic trajectories with values near 1, so relative gaps are the offsets written here; one
real pair (the error-rate hunt's pair 490, two 1-weight runs of about 3 s each) with and without
a seeded bfloat16-only bug.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parity_tests.judging.bfloat16 import (
    BF16_FACTOR,
    BF16_GRADIENT_FACTOR,
    BF16_SIGNATURE_FACTOR,
    RULE_BF16_FLOAT64,
    Side,
    float64_reference,
    judge_bfloat16,
    signature_bound,
)
from parity_tests.judging.bounds import FLOAT32_ABS_FLOOR
from parity_tests.judging.perturbation import BF16_SIGNATURE
from parity_tests.judging.verdict import RULE_FLOAT64
from parity_tests.tests.helpers import MLP, make

STEPS = 4
BASE = np.ones((STEPS + 1, 3))  # [steps + 1, 3]: every relative gap is the offset itself


def _traj(offset: float, dtype=np.float32, loss_offset: float = 0.0, semantic: float = 0.0) -> dict[str, np.ndarray]:
    p = BASE.copy()
    p[1:] += offset + semantic  # row 0: the initial values, the same on every run
    loss = 2.0 - 0.1 * np.arange(STEPS) + loss_offset
    return {"param/w": p.astype(dtype), "loss": loss.astype(dtype)}


def _side(name: str, distance: float, spread: float, *, rho: float = 1.0, loss_distance: float = 0.0,
          semantic: float = 0.0, loss64: float = 0.0) -> Side:
    """A side ``distance`` from its float64 run whose reruns are ``spread`` from it (both reruns); ``loss64``: its
    float64 runs' losses moved by that much (a difference of its program in the logged loss alone)."""
    run = _traj(distance, loss_offset=loss_distance + loss64)
    reruns = [_traj(distance + spread, loss_offset=loss_distance + loss64 + spread) for _ in range(2)]
    # each rerun's error: spread from the run's
    reruns64 = [_traj(0.0, np.float64, semantic=semantic, loss_offset=loss64) for _ in range(2)]
    return Side(name, run, _traj(0.0, np.float64, semantic=semantic, loss_offset=loss64), reruns, reruns64, rho,
                f"{name}: kernels")


def _bound(spread: float, rho: float = 1.0) -> float:
    return BF16_FACTOR * rho * spread + FLOAT32_ABS_FLOOR


def test_sides_within_what_bfloat16_explains_are_parity():
    v = judge_bfloat16(_side("A", 1e-3, 1e-3), _side("B", -1.5e-3, 1e-3))
    assert (v.status, v.rule) == ("parity", RULE_BF16_FLOAT64), v.detail
    assert v.floor_a == pytest.approx(1e-3, rel=1e-3) and v.floor_b == pytest.approx(1.5e-3, rel=1e-3)
    assert v.gap == pytest.approx(2.5e-3, rel=1e-3)  # the pair's gap: the two distances on opposite sides
    assert v.bound == pytest.approx(2 * _bound(1e-3), rel=1e-3)  # E_A + E_B (+ the float64 gap, 0 here)
    assert "each side within what its bfloat16 arithmetic explains" in v.detail


@pytest.mark.parametrize(("scale", "status"), [(0.99, "parity"), (1.01, "divergence")])
def test_a_side_just_beyond_its_bound_diverges_and_is_named(scale, status):
    b = _side("tf.single", scale * _bound(1e-3), 1e-3)
    v = judge_bfloat16(_side("tf.towers", 0.0, 1e-3), b)
    assert v.status == status, v.detail
    if status == "divergence":
        assert v.rule == RULE_BF16_FLOAT64 and v.key == "param/w" and v.first_step == 1
        assert v.detail.startswith("tf.single is farther from its float64 run than its bfloat16 arithmetic explains")
        assert v.gap > v.bound == pytest.approx(_bound(1e-3), rel=1e-3)


def test_the_spread_is_the_largest_of_both_sides_reruns():
    # side A's reruns spread little, B's much: A's distance is judged against B's spread too
    far = 1.5 * _bound(1e-3)
    v = judge_bfloat16(_side("A", far, 1e-4), _side("B", 0.0, 2e-3))
    assert v.status == "parity", v.detail
    v = judge_bfloat16(_side("A", far, 1e-4), _side("B", 0.0, 1e-3))
    assert v.status == "divergence" and v.detail.startswith("A is farther"), v.detail


def test_kernels_that_round_more_widen_only_their_sides_bound():
    far = 1.5 * _bound(1e-3)
    assert judge_bfloat16(_side("A", 0.0, 1e-3), _side("B", far, 1e-3)).status == "divergence"
    v = judge_bfloat16(_side("A", 0.0, 1e-3), _side("B", far, 1e-3, rho=2.0))
    assert v.status == "parity" and "rho A 1, B 2" in v.detail, v.detail
    assert judge_bfloat16(_side("A", far, 1e-3), _side("B", 0.0, 1e-3, rho=2.0)).status == "divergence"


def test_float64_runs_that_part_are_a_semantic_difference_on_any_cpu():
    v = judge_bfloat16(_side("A", 0.0, 1e-3), _side("B", 0.0, 1e-3, semantic=1e-6))
    assert (v.status, v.rule) == ("divergence", RULE_FLOAT64), v.detail
    v = judge_bfloat16(_side("A", 0.0, 1e-3), _side("B", 0.0, 1e-3, semantic=1e-6), expect_difference=True)
    assert v.status == "expected_difference"
    v = judge_bfloat16(_side("A", 0.0, 1e-3), _side("B", 0.0, 1e-3), expect_difference=True)
    assert v.status == "unexpected_parity"


def test_the_loss_channel_is_judged_per_side_unless_switched_off():
    far = _side("B", 0.0, 1e-3, loss_distance=3 * _bound(1e-3))
    v = judge_bfloat16(_side("A", 0.0, 1e-3), far)
    assert (v.status, v.key) == ("divergence", "loss") and v.first_step == 1, v.detail
    assert judge_bfloat16(_side("A", 0.0, 1e-3), far, loss=False).status == "parity"


@pytest.mark.parametrize(("loss64", "status"), [(5e-11, "parity"), (1e-6, "divergence")])
def test_the_float64_runs_loss_is_judged_where_the_mixed_loss_is_not(loss64, status):
    """``loss=False`` (a TensorFlow and a torch recipe, whose logits are a bfloat16 rounding apart:
    ``theory.reported_loss_differs``) leaves the mixed losses unjudged, not the float64 runs' losses: those round
    no logit, and step 1's is bounded by FLOAT64_RTOL = 1e-10 (both start from the same parameters; the losses
    are near 2, so an offset is its relative gap / 2). A logged-loss-only bug (a tower's loss logged for the mean)
    moves them by far more; 5e-11 is below the bound."""
    b = _side("B", 0.0, 1e-3, loss64=2 * loss64)  # relative: 2 * loss64 / 2
    v = judge_bfloat16(_side("A", 0.0, 1e-3), b, loss=False)
    assert v.status == status, v.detail
    if status == "divergence":
        assert (v.rule, v.key, v.first_step) == (RULE_FLOAT64, "loss", 1), v.detail
        assert v.detail.startswith("float64: loss relative gap"), v.detail


def test_a_float64_loss_apart_before_both_runs_turn_nan_is_a_divergence_not_an_error():
    """Both float64 runs NaN from step 1's update on (Adam with epsilon 0 divides 0 by 0), their step-1 losses,
    computed from the initial parameters before any update, apart: a divergence found on finite values (the
    non-finite checks turn only a non-finite divergence into ``error``); with the losses alike, ``error``. One
    element turns NaN (a dead unit's bias: its gradient exactly 0), the others move as the case trains."""
    from parity_tests.judging.pair import Side as PairSide
    from parity_tests.judging.pair import judge_sides
    from parity_tests.judging.verdict import RULE_NONFINITE

    def nan_after_step_1(s: Side) -> Side:
        def cut(t):
            p = np.array(t["param/w"], copy=True)
            p[1:, 1:] += 0.1 * np.arange(1, STEPS + 1)[:, None]  # training moves them, alike on every run
            p[1:, 0] = np.nan
            loss = np.array(t["loss"], copy=True)
            loss[1:] = np.nan  # the loss of step 2 on is computed from a NaN parameter
            return {"param/w": p, "loss": loss}

        return Side(s.name, cut(s.run), cut(s.float64), [cut(r) for r in s.reruns], [cut(r) for r in s.reruns64],
                    s.rho, s.kernels)

    for loss64, status, rule in ((0.0, "error", RULE_NONFINITE), (0.1, "divergence", RULE_FLOAT64)):
        a, b = nan_after_step_1(_side("A", 0.0, 1e-3)), nan_after_step_1(_side("B", 0.0, 1e-3, loss64=loss64))
        v = judge_sides("mixed_bfloat16", PairSide(a.run, a.float64, None), PairSide(b.run, b.float64, None),
                        rule="perturbation", perturbation={"loss": False}, bfloat16=(a, b))
        assert (v.status, v.rule) == (status, rule), v.detail
        if status == "divergence":
            assert (v.key, v.first_step) == ("loss", 1), v.detail


def test_bad_sides_are_refused():
    a = _side("A", 0.0, 1e-3)
    with pytest.raises(ValueError, match="rerun"):
        judge_bfloat16(a, Side("B", a.run, a.float64, [], []))
    with pytest.raises(ValueError, match="float64 run"):
        judge_bfloat16(a, Side("B", a.run, a.float64, a.reruns, a.reruns64[:1]))
    with pytest.raises(ValueError, match="rho"):
        judge_bfloat16(a, _side("B", 0.0, 1e-3, rho=0.5))


def test_the_float64_reference_keeps_the_float32_hyperparameters_the_mixed_runs_use():
    case = make(MLP, dtype="mixed_bfloat16", optimizer={"name": "momentum", "lr": 0.1, "momentum": 0.9})
    ref = float64_reference(case)
    assert ref.spec["dtype"] == "float64"
    assert ref.spec["optimizer"]["lr"] == float(np.float32(0.1)) != 0.1
    assert ref.spec["optimizer"]["momentum"] == float(np.float32(0.9))
    np.testing.assert_array_equal(ref.x, case.x)  # the same inputs: both sides round them at the first layer


def test_the_signature_bound_is_float32s_own_step_1_rounding_times_16():
    f64 = {"loss": np.array([2.0, 1.9]), "grad/w": np.array([[1.0, -1.0], [0.9, -0.9]])}
    f32 = {"loss": np.float32([2.0, 1.9]), "grad/w": np.float32([[1.0 + 2**-20, -1.0], [0.9, -0.9]])}  # exact in float32
    bound, how = signature_bound(f32, f64)
    assert bound == pytest.approx(BF16_SIGNATURE_FACTOR * 2**-20 + FLOAT32_ABS_FLOOR, rel=1e-5) and "grad/w" in how
    exact = {"loss": np.float32([2.0, 1.9]), "grad/w": np.float32([[1.0, -1.0], [0.9, -0.9]])}
    assert signature_bound(exact, f64)[0] == FLOAT32_ABS_FLOOR  # float32 exact at step 1: the absolute floor alone
    assert signature_bound(f32, None)[0] == BF16_SIGNATURE  # no float64 run: the fixed threshold


def test_the_storage_term_explains_what_the_rounded_inputs_and_weights_move():
    far = 1.5 * _bound(1e-3)  # 0.5 x _bound beyond what the spread explains
    b = _side("B", far, 1e-3)
    assert judge_bfloat16(_side("A", 0.0, 1e-3), b).status == "divergence"
    rounded = _traj(0.0, np.float64)
    rounded["param/w"] = rounded["param/w"] + 0.5 * far  # row 0 too: the arrays' own rounding is taken off
    rounded["param/w"][1:] += 0.25 * far  # the updates from rounded weights move by far / 4: twice that is enough
    v = judge_bfloat16(_side("A", 0.0, 1e-3), dataclasses.replace(b, rounded64=rounded))
    assert v.status == "parity" and "2 x storage" in v.detail, v.detail
    rounded["param/w"][1:] -= 0.15 * far  # far / 10: twice that is short of far - 3 x spread
    v = judge_bfloat16(_side("A", 0.0, 1e-3), dataclasses.replace(b, rounded64=rounded))
    assert v.status == "divergence" and "+ 2 x storage 4.50e-04" in v.detail, v.detail




def test_the_gradient_term_explains_what_rounding_the_gradients_moves():
    # the 10,000-pair run's mixed false alarms (docs/error-rates.md, "third session"): a side farther from its float64
    # run than 3 x its spread, by roundings of the loss's gradient and of each device's gradient that its reruns
    # repeat. Its float64 run rounding those gradients (grads64) moves the updates by G: 2 G is counted
    far = 1.5 * _bound(1e-3)  # 0.5 x _bound beyond what the spread explains
    b = _side("B", far, 1e-3)
    assert judge_bfloat16(_side("A", 0.0, 1e-3), b).status == "divergence"
    grads = _traj(0.0, np.float64)
    grads["param/w"][1:] += 0.25 * far  # the updates with rounded gradients move by far / 4: 2 x that is enough
    v = judge_bfloat16(_side("A", 0.0, 1e-3), dataclasses.replace(b, grads64=grads))
    assert v.status == "parity" and f"{BF16_GRADIENT_FACTOR:g} x gradients" in v.detail, v.detail  # must not fire
    assert "gradients of B" in v.detail and "gradients of A" not in v.detail, v.detail  # A has no such run: G_A = 0
    grads["param/w"][1:] -= 0.15 * far  # far / 10: twice that is short of far - 3 x spread
    v = judge_bfloat16(_side("A", 0.0, 1e-3), dataclasses.replace(b, grads64=grads))
    assert v.status == "divergence" and "+ 2 x gradients 4.50e-04" in v.detail, v.detail  # must fire
    assert v.detail.startswith("B is farther"), v.detail
    # without the run, the detail names no gradient term (the rule as before)
    assert "gradients" not in judge_bfloat16(_side("A", 0.0, 1e-3), b).detail
    # a gradient-rounding run that overflows from step 2 measures nothing there: no infinite bound from it; step 1's
    # G (enough for the distance, which does not grow) is carried, as every term's running maximum is
    grads["param/w"][1] += 0.15 * far
    grads["param/w"][2:] = np.inf
    v = judge_bfloat16(_side("A", 0.0, 1e-3), dataclasses.replace(b, grads64=grads))
    assert v.status == "parity" and np.isfinite(v.per_step_bound).all(), (v.per_step_bound, v.detail)


def _shared(name: str, distance: float, spread: float) -> Side:
    """A side ``distance`` from its float64 run whose reruns repeat that error (a rounding no rerun re-samples)
    but for ``spread``: what the hunt's pairs 419, 490 and 585 looked like (docs/error-rates.md)."""
    return _side(name, distance, spread)


def test_an_error_both_sides_share_is_no_difference_between_them():
    # must not fire: each side 3 bounds from float64, the same way, agreeing with each other (a torch and a
    # TensorFlow side bit for bit in the hunt): the side check holds only the error beyond the shared one
    far = 3 * _bound(1e-3)
    v = judge_bfloat16(_shared("torch.single", far, 1e-3), _shared("tf.single", far, 1e-3))
    assert (v.status, v.rule) == ("parity", RULE_BF16_FLOAT64), v.detail
    assert v.gap == 0.0 and f"share of up to {far:.2e}" in v.detail, v.detail
    assert v.floor_a == pytest.approx(far, rel=1e-3)  # the side's whole distance is still reported


@pytest.mark.parametrize(("b_distance", "status"), [(0.5, "parity"), (1.5, "divergence")])
def test_the_error_beyond_the_shared_one_is_judged_on_its_side(b_distance, status):
    # must fire: B carries, beyond the error it shares with A, more than its bound (a one-sided bfloat16-only
    # bug on top of a shared rounding); B's excess is what is compared, not the pair's looser E_A + E_B
    shared = 3 * _bound(1e-3)
    v = judge_bfloat16(_shared("A", shared, 1e-3), _shared("B", shared + b_distance * _bound(1e-3), 1e-3))
    assert v.status == status, v.detail
    if status == "divergence":
        assert v.detail.startswith("B is farther") and "beyond the error the other side shares" in v.detail
        assert v.gap == pytest.approx(1.5 * _bound(1e-3), rel=1e-3) and v.first_step == 1


def test_errors_of_opposite_signs_share_nothing():
    # must fire: the sides err in opposite directions, each beyond its bound: nothing is shared, both are whole
    far = 1.5 * _bound(1e-3)
    v = judge_bfloat16(_shared("A", far, 1e-3), _shared("B", -far, 1e-3))
    assert v.status == "divergence" and v.detail.startswith("A is farther"), v.detail
    assert "shares" not in v.detail.split(";")[0]


def test_a_clipped_gradient_keeps_its_bfloat16_signature():
    """The hunt's pairs 949 and 950: a gradient clipped to a norm of 1e-6 whose bfloat16 rounding (2^-9 relative)
    an absolute floor of 1e-2 hid (1e-6 x 2^-9 / 1e-2 = 2e-10), on a model whose step-1 loss (logits near 0)
    moves by 1e-6 relative: the gradient is measured against its own size."""
    from parity_tests.judging.perturbation import bfloat16_signature, round_bfloat16

    g64 = 1e-6 * np.array([[-0.8331925, -0.5060863, -0.2228609]])
    f64 = {"loss": np.array([0.692516]), "grad/0.kernel": g64}
    f32 = {"loss": np.float32([0.692516]), "grad/0.kernel": g64.astype(np.float32)}
    mixed = {"loss": np.float32([0.692516 * (1 + 2**-20)]),
             "grad/0.kernel": round_bfloat16(g64.astype(np.float32)).astype(np.float32)}
    bound = signature_bound(f32, f64)[0]
    gap, key = bfloat16_signature(mixed, f32)
    assert gap > bound and key == "grad/0.kernel", (gap, bound)  # must not fire: it computes in bfloat16
    assert bfloat16_signature(dict(f32), f32)[0] <= bound  # must fire: a side whose "mixed" run is its float32 run
    # an array small beside the rest of the gradient is measured against the gradient's size, not its own
    f32["grad/1.bias"] = mixed["grad/1.bias"] = np.float32([[3e-12]])
    mixed["grad/1.bias"] = np.float32([[6e-12]])
    assert bfloat16_signature(mixed, f32) == (gap, key)


#: the error-rate hunt's pair 490 (docs/error-rates.md): one weight, mse, Adam with beta1 = beta2 = 0, one step.
#: The backward matmul reads the residual ``w x - y`` rounded to bfloat16, dominated by the targets no rerun
#: moves, so both sides carry the same 0.8% gradient error that no rerun re-samples (each side 2.2 times its E)
SHARED_ROUNDING = {
    "schema": "parity-case/1", "name": "shared-rounding", "dtype": "mixed_bfloat16", "seed": 201,
    "model": {"input_shape": [1], "layers": [{"type": "dense", "units": 1, "activation": "none", "use_bias": False}],
              "loss": "mse", "reduction": "mean"},
    "init": {"seed": 0, "kind": "normal", "stddev": 0.1}, "data": {"generator": "gaussian", "seed": 0, "global_batch": 8},
    "optimizer": {"name": "adam", "semantics": "torch", "lr": 0.05, "beta1": 0.0, "beta2": 0.0, "epsilon": 0.001},
    "parallel": {"devices": 8, "combine": "grad_mean", "shard": "contiguous", "weighting": "by_size"}, "steps": 1}


def _lr_in_bfloat16(impl: str):
    """A runner whose ``impl`` holds its learning rate in bfloat16 under the mixed policy (a bfloat16-only bug:
    0.05 becomes 0.050048828125, 1e-3 relative; its float64 and float32 runs are right), the rest as registered."""
    from parity_tests.judging.perturbation import round_bfloat16
    from parity_tests.running.harness import run_impl

    def run(case, name):
        if name == impl and case.spec["dtype"] == "mixed_bfloat16":
            case = case.replace(**{"optimizer.lr": float(round_bfloat16(np.float32([case.spec["optimizer"]["lr"]]))[0])})
        return run_impl(case, name)

    return run


def test_the_hunts_shared_rounding_pair_is_parity_and_a_one_sided_bfloat16_bug_on_it_is_not():
    from parity_tests.session.comparison import compare_case

    case = make(SHARED_ROUNDING)
    v = compare_case(case, ["tf.single", "torch.single"], stages=False).pairs[0].verdict
    assert (v.status, v.rule) == ("parity", RULE_BF16_FLOAT64), v.detail  # must not fire (was a divergence)
    assert "both sides share" in v.detail, v.detail
    v = compare_case(case, ["tf.single", "torch.single"], runner=_lr_in_bfloat16("torch.single"),
                     stages=False).pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_BF16_FLOAT64), v.detail  # must fire, on the buggy side
    assert v.detail.startswith("torch.single is farther"), v.detail


def _with_loss_rows(side: Side, offsets: np.ndarray, *, repeat_rows: np.ndarray | None = None,
                    grads: bool = False) -> Side:
    """``side`` whose run's loss is moved by ``offsets`` per row; its mixed reruns log the run's loss bit for bit
    at ``repeat_rows`` (their float64 reruns' losses moved by 1e-4 there); ``grads``: every run records
    ``grad/w`` (ones: the loss's condition number is then 3 x 1 / |L|)."""
    run = {**side.run, "loss": (side.run["loss"] + offsets).astype(np.float32)}
    reruns, reruns64 = [], []
    for r, r64 in zip(side.reruns, side.reruns64, strict=True):
        loss, loss64 = (r["loss"] + offsets).astype(np.float32), r64["loss"].copy()
        if repeat_rows is not None:
            loss[repeat_rows] = run["loss"][repeat_rows]
            loss64[repeat_rows] += 1e-4
        reruns.append({**r, "loss": loss})
        reruns64.append({**r64, "loss": loss64})
    out = Side(side.name, run, side.float64, reruns, reruns64, side.rho, side.kernels)
    if grads:
        g = {"grad/w": np.ones((STEPS, 3))}
        out = Side(out.name, {**out.run, **g}, {**out.float64, **g}, [{**r, **g} for r in out.reruns],
                   [{**r, **g} for r in out.reruns64], out.rho, out.kernels)
    return out


def _framework(side: Side, framework: str) -> Side:
    """``side`` whose kernel line names ``framework``, as ``kernels.side_factor`` writes it."""
    return Side(side.name, side.run, side.float64, side.reruns, side.reruns64, side.rho,
                f"{framework}: every kernel of the recipe sums in float32 and rounds once here", side.rounded64)


def test_a_loss_rounding_no_rerun_reached_is_not_judged_at_that_step():
    # the hunt's pairs 464 and 465 (a Keras and a torch side, a hidden dense layer with a bias that Keras rounds
    # twice): step 1's loss 20 times its bound, where the reruns log the run's mixed loss bit for bit (sigmoid
    # outputs near 0.5: the move never crosses a bfloat16 step there). Must not fire there
    offsets = np.zeros(STEPS)
    offsets[0] = 20 * _bound(1e-3)
    first = np.arange(STEPS) == 0
    a = _framework(_side("A", 0.0, 1e-3), "torch")
    b = _framework(_with_loss_rows(_side("B", 0.0, 1e-3), offsets, repeat_rows=first), "tf")
    v = judge_bfloat16(a, b)
    assert v.status == "parity", v.detail
    assert any("the loss at step(s) 1" in u and "log the run's loss bit for bit" in u for u in v.unjudged), v.unjudged
    # must fire: the same pair of one recipe (two TensorFlow sides round the same values alike)
    v = judge_bfloat16(_framework(a, "tf"), b)
    assert (v.status, v.key, v.first_step) == ("divergence", "loss", 1), v.detail
    # must fire: the same gap where the reruns did re-round the loss (sampled: 1e-3 apart)
    v = judge_bfloat16(a, _framework(_with_loss_rows(_side("B", 0.0, 1e-3), offsets), "tf"))
    assert (v.status, v.key, v.first_step) == ("divergence", "loss", 1), v.detail
    # must fire: a loss wrong at every step is still judged at the steps whose rounding the reruns sampled
    v = judge_bfloat16(a, _framework(_with_loss_rows(_side("B", 0.0, 1e-3), offsets + 20 * _bound(1e-3),
                                                     repeat_rows=first), "tf"))
    assert (v.status, v.key, v.first_step) == ("divergence", "loss", 2), v.detail


def test_the_kernel_line_begins_with_the_sides_framework():
    # the loss rule reads each side's framework from this line (judging.bfloat16._recipes_differ)
    from parity_tests.running import kernels

    for framework in ("tf", "torch"):
        assert kernels.side_factor(MLP["model"]["layers"], framework)[1].startswith(f"{framework}: ")


def test_the_parameters_gap_is_carried_into_the_loss():
    # sides 0.9 E from float64 on either side (the pair's parameter gap 1.8 E, accepted) whose losses from step 2
    # part by 2 E: the loss's condition number 3 / |L| ~ 1.6 carries 1.8 E x 1.6 ~ 2.9 E. Must not fire
    d = 0.9 * _bound(1e-3)
    offsets = np.where(np.arange(STEPS) >= 1, 2 * _bound(1e-3) * 1.8, 0.0)  # |L| ~ 1.8: relative 2 E
    a = _with_loss_rows(_side("A", d, 1e-3), np.zeros(STEPS), grads=True)
    v = judge_bfloat16(a, _with_loss_rows(_side("B", -d, 1e-3), offsets, grads=True))
    assert v.status == "parity" and "S x (parameter gap of the step before)" in v.detail, v.detail
    # must fire: three times that gap, beyond what the carried term and the spread explain
    v = judge_bfloat16(a, _with_loss_rows(_side("B", -d, 1e-3), 3 * offsets, grads=True))
    assert (v.status, v.key, v.first_step) == ("divergence", "loss", 2), v.detail
