"""``judging.predicted_scale``: a predicted constant-scale difference held against the step-1 gradients.

The hunt's misses 1109-1111 (``reduction_flipped@torch.ddp``, ``mixed_bfloat16``): a DDP side whose shard
losses are means where the case sums them, against one device, hidden behind theory's "sum reduction" (the
DDP side's gradient is the full-batch sum / N) because the mapping's stand-in is no equivalent run. Theory
predicts the ratio itself, so the runs' step-1 gradients check it: each rule with a case where it must fire
and one where it must not.
"""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.predicted_scale import check_scale, predicted_scale
from parity_tests.judging.theory import engine, predict
from parity_tests.session.comparison import NOT_EQUIVALENT, compare_case
from parity_tests.tests.helpers import MLP, make

TORCH = str(Path(__file__).parent / "plugins" / "mapping_torch.py")

#: the hunt's pair 332, as drawn: mixed_bfloat16, 3 devices on 10 rows (uneven), sum reduction, equal weighting
HUNT_332 = {"schema": "parity-case/1", "name": "hunt", "dtype": "mixed_bfloat16", "seed": 358,
            "model": {"input_shape": [3], "layers": [{"type": "dense", "units": 3, "activation": "none",
                                                      "use_bias": True}], "loss": "mse", "reduction": "sum"},
            "init": {"seed": 7210, "kind": "glorot_uniform"},
            "data": {"generator": "gaussian", "seed": 201, "global_batch": 10},
            "optimizer": {"name": "sgd", "semantics": "torch", "lr": 0.05},
            "parallel": {"devices": 3, "combine": "grad_mean", "shard": "contiguous", "weighting": "equal"},
            "steps": 1}


def _scale(spec, a="torch.single", b="torch.ddp"):
    return predicted_scale(spec, predict(spec, a, b), engine(a), engine(b))


def test_theory_predicts_the_sum_reductions_constant_only_where_it_is_one():
    """1/N for the DDP side against one device (N the other way round), on uneven shards too under ``equal``
    weighting (the device mean of shard sums is the full sum / N whatever the shards); none where the combined
    gradient is no constant multiple (``by_size`` on uneven shards: sum_r n_r/B g_r), where the recorded gradient
    is a clipped one, where a layer mixes rows (batch norm), under ``mean``, or between two parallel sides."""
    spec = make(MLP, model__reduction="sum", parallel__devices=5).spec  # 48 rows on 5 devices: uneven
    assert _scale(spec)[0] == Fraction(1, 5)
    assert _scale(spec, "torch.ddp", "torch.single")[0] == Fraction(5)
    assert _scale(make(MLP, model__reduction="sum", parallel__devices=5, parallel__weighting="by_size").spec) is None
    assert _scale(make(MLP, model__reduction="sum", parallel__devices=4, parallel__weighting="by_size").spec)[0] \
        == Fraction(1, 4)  # even shards: n_r / B = 1 / N
    # a clip after the combine keeps the ratio before it (the check then bounds the clipped ratio); one per device
    # clips each shard's own gradient, no constant multiple of anything
    assert _scale(make(MLP, model__reduction="sum", parallel__devices=4,
                       parallel__clip={"global_norm": 1.0, "where": "after_combine"}).spec)[0] == Fraction(1, 4)
    assert _scale(make(MLP, model__reduction="sum", parallel__devices=4,
                       parallel__clip={"global_norm": 1.0, "where": "per_device"}).spec) is None
    assert _scale(make(MLP, parallel__devices=4).spec) is None  # mean: no sum reduction predicted
    assert _scale(spec, "torch.ddp", "tf.towers") is None
    bn = make(MLP, model__reduction="sum", parallel__devices=4,
              model__layers=[{"type": "dense", "units": 10, "activation": "relu"}, {"type": "batch_norm"},
                             {"type": "dense", "units": 1}]).spec
    assert _scale(bn) is None


def test_the_step_1_gradients_hold_the_predicted_constant_or_not():
    """Unit (check_scale): G_B = G_A / N within float64 rounding passes; the shard means of a flipped reduction on
    even shards (G_A / B: a constant, another one) and on uneven ones (no constant at all) do not, each with the
    measured factor beside the predicted one; gradients not recorded on both sides are no check."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((10, 4, 3))  # per-row gradients of a [4, 3] kernel, 10 rows
    full = rows.sum(axis=0)
    run = lambda g: {"grad/0.kernel": g[None], "loss": np.ones(1)}  # noqa: E731
    shards = np.array_split(rows, 3)  # 4, 3, 3 rows
    ddp = sum(s.sum(axis=0) for s in shards) / 3
    assert check_scale(run(full), run(ddp), Fraction(1, 3)) is None
    assert check_scale(run(ddp), run(full), Fraction(3)) is None
    even = sum(s.mean(axis=0) for s in np.array_split(rows, 2)) / 2   # = full / 10
    found = check_scale(run(full), run(even), Fraction(1, 2))
    assert found is not None and found["measured"] == pytest.approx(0.1) and "(1/2)" in found["text"]
    flipped = sum(s.mean(axis=0) for s in shards) / 3                 # uneven: 1/4 and 1/3 of the rows' sums
    found = check_scale(run(full), run(flipped), Fraction(1, 3))
    assert found is not None and found["measured"] is None and "not a constant multiple" in found["text"]
    assert check_scale({"loss": np.ones(1)}, run(flipped), Fraction(1, 3)) is None


def test_behind_a_clip_after_the_combine_the_direction_and_bounds_hold():
    """Unit (check_scale with ``clip``): a clip after the combine scales each side by a positive factor, so the
    gradients keep one direction and the parallel side's is 1/N to 1 times the single side's; where the single
    side's norm is below the threshold (less torch's 1e-6) nothing was clipped and the ratio is 1/N exactly. Rank 0's
    rows read by every rank (the hunt's ``same_shard``: another direction), a ratio below 1/N, and 1/2 where
    nothing was clipped (N = 3) are not what theory predicts."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((9, 4, 3))
    full = rows.sum(axis=0)
    x = float(np.linalg.norm(full))
    run = lambda g: {"grad/0.kernel": g[None], "param/0.kernel": g[None], "loss": np.ones(1)}  # noqa: E731

    def clipped(g, c):  # TensorFlow's rule: g c / max(||g||, c)
        return g * c / max(float(np.linalg.norm(g)), c)

    third = Fraction(1, 3)
    for c in (x / 10, x / 2, 2 * x):  # both clipped; only the single side; neither
        assert check_scale(run(clipped(full, c)), run(clipped(full / 3, c)), third, clip=c) is None, c
        assert check_scale(run(clipped(full / 3, c)), run(clipped(full, c)), Fraction(3), clip=c) is None, c
    shard0 = rows[0::3].sum(axis=0)  # every rank reads rank 0's rows: another direction
    found = check_scale(run(clipped(full, x / 2)), run(clipped(shard0, x / 2)), third, clip=x / 2)
    assert found is not None and found["measured"] is None and "another direction" in found["text"]
    found = check_scale(run(clipped(full, x / 2)), run(clipped(full, x / 2) / 4), third, clip=x / 2)
    assert found is not None and found["measured"] == pytest.approx(0.25)  # below 1/N: no clip makes it
    found = check_scale(run(full), run(full / 2), third, clip=2 * x)  # nothing clipped (norm x < 2x): exactly 1/3
    assert found is not None and found["measured"] == pytest.approx(0.5) and "(1/3)" in found["text"]
    # the same 1/2 where the single side was clipped is within the bounds: the clip may make it
    assert check_scale(run(clipped(full, x / 2)), run(clipped(full, x / 2) / 2), third, clip=x / 2) is None
    # a gradient not recorded for every parameter: its norm is not the clip's, so no exact 1/N is read from it
    partial = {**run(full), "param/1.bias": np.zeros((1, 2))}
    assert check_scale(partial, run(full / 2), third, clip=2 * x) is None


@pytest.mark.usefixtures("pool")
def test_a_shard_mean_behind_the_sum_reduction_is_a_divergence():
    """A DDP port whose rank losses are shard means under ``reduction: sum`` (the hunt's ``reduction_flipped``)
    against one device: its stand-in torch.ddp parts from it at the loss (no equivalent run), so no residual is
    judged, and its step-1 gradient is the full sum / 48 where theory predicts / 2: a divergence naming both
    factors (was: expected_difference). The faithful port is expected_difference with its residual at parity."""
    case = make(MLP, dtype="float64", parallel__devices=2, model__reduction="sum")
    r = compare_case(case, ["torch.single", f"{TORCH}:sgd", f"{TORCH}:sgd_shard_mean"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    assert pairs["sgd"].verdict.status == "expected_difference", summary
    assert pairs["sgd"].residual is not None and pairs["sgd"].residual.status == "parity", summary
    bug = pairs["sgd_shard_mean"]
    assert bug.verdict.status == "divergence", summary
    assert bug.residual_not_judged.startswith(NOT_EQUIVALENT), summary
    assert "predicted 0.5x (1/2)" in bug.verdict.detail and "measured 0.02083x" in bug.verdict.detail, summary
    assert bug.localisation["predicted_scale"]["measured"] == pytest.approx(1 / 48), summary
    assert json.loads(json.dumps(bug.to_dict()))["verdict"]["localisation"]["predicted_scale"]["predicted_exact"] == "1/2"


@pytest.mark.usefixtures("pool")
def test_a_correct_pair_with_no_residual_keeps_its_expected_difference():
    """The hunt's pair 332: tf.single against torch.ddp in mixed_bfloat16, sum reduction on uneven shards. No side
    the tool controls can map both the sum reduction and the bfloat16 bias gradient, so no residual is judged;
    the float64 runs' step-1 gradients are in the ratio 1/3 (to 1e-16), as predicted: expected_difference stays
    (and with the two sides swapped, 3)."""
    case = case_from_dict(HUNT_332)
    r = compare_case(case, ["tf.single", "torch.ddp"])
    p = r.pairs[0]
    assert p.verdict.status == "expected_difference", r.summary()
    assert p.residual is None and "predicted_scale" not in (p.localisation or {}), r.summary()
    # the check applied (theory's constant is 1/3 here) and found the ratio it predicts
    assert predicted_scale(case.spec, p.prediction, engine("tf.single"), engine("torch.ddp"))[0] == Fraction(1, 3)
    swapped = compare_case(dataclasses.replace(case), ["torch.ddp", "tf.single"]).pairs[0]
    assert swapped.verdict.status == "expected_difference", swapped.verdict.detail


@pytest.mark.usefixtures("pool")
def test_lockstep_holds_each_step_to_the_predicted_ratio_too():
    """The same two ports under ``--lockstep``: each step's one-step runs start from one state, so the sum reduction's
    ratio holds at every step; the shard-mean port is a divergence at step 1 there too (it was an expected
    difference at every step: its stand-in parts at the loss, so no residual), the faithful one is not."""
    from parity_tests.session.lockstep import lockstep_compare

    case = make(MLP, dtype="float64", parallel__devices=2, model__reduction="sum")
    result = lockstep_compare(case, ["torch.single", f"{TORCH}:sgd", f"{TORCH}:sgd_shard_mean"])
    pairs = {p.impl.rsplit(":", 1)[-1]: p for p in result.pairs}
    assert pairs["sgd"].status == "expected_difference", result.summary()
    bug = pairs["sgd_shard_mean"]
    assert (bug.status, bug.first_bad_step) == ("divergence", 1), result.summary()
    assert "predicted 0.5x (1/2)" in bug.detail, bug.detail


#: the hunt's pair 1096 of seed 1, as drawn: float32, 3 devices on 3 rows, sum reduction, a clip after the combine
HUNT_1096 = {"schema": "parity-case/1", "name": "hunt", "dtype": "float32", "seed": 0,
             "model": {"input_shape": [1], "layers": [{"type": "dense", "units": 3, "activation": "none",
                                                       "use_bias": False}], "loss": "sigmoid_ce", "reduction": "sum"},
             "init": {"seed": 0, "kind": "normal", "stddev": 0.1},
             "data": {"generator": "gaussian", "seed": 0, "global_batch": 3},
             "optimizer": {"name": "sgd", "semantics": "native", "lr": 1.0},
             "parallel": {"devices": 3, "combine": "grad_mean", "shard": "strided", "weighting": "by_size",
                          "clip": {"global_norm": 0.5, "where": "after_combine"}},
             "steps": 1}
HUNT_TORCH = str(Path(__file__).parent / "hunt" / "torch_side.py")


@pytest.mark.usefixtures("pool")
def test_every_rank_reading_rank_0s_rows_behind_a_clipped_sum_reduction_is_a_divergence():
    """The hunt's pair 1096 (seed 1): ``same_shard`` (every rank reads rank 0's rows) against torch.single behind
    theory's sum reduction, with a clip after the combine. torch.ddp, standing in for it, parts at the loss (no
    equivalent run) and the plugin does not run ``weighting: sum``, so no residual is judged; the step-1 gradient
    is not even in the full batch's direction (torch.single's norm 0.405 < 0.5: nothing clipped, so 1/3 exactly):
    a divergence (was: expected_difference). The faithful DDP port keeps its expected difference (its stand-in is
    equivalent and the residual is at parity)."""
    case = case_from_dict(HUNT_1096)
    r = compare_case(case, ["torch.single", f"{HUNT_TORCH}:ddp", f"{HUNT_TORCH}:same_shard"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    assert pairs["ddp"].verdict.status == "expected_difference", summary
    bug = pairs["same_shard"]
    assert bug.verdict.status == "divergence", summary
    assert "predicted 0.3333x (1/3)" in bug.verdict.detail and "not a constant multiple" in bug.verdict.detail, summary


@pytest.mark.usefixtures("pool")
def test_a_correct_pair_with_a_clip_after_the_combine_keeps_its_expected_difference():
    """Pair 332's sides (tf.single, torch.ddp; mixed_bfloat16, no residual) with a clip after the combine that the
    step-1 gradient reaches on the single side only (threshold 30: its float64 norm is 52.6, the DDP side's 17.5,
    so the ratio is 17.5 / 30 = 0.58, between 1/3 and 1) and on neither (1e3: 1/3 exactly): expected_difference
    stays in both. (Where both are clipped, 1e-3, the two sides agree: parity, the prediction below the bound.)"""
    for threshold in (30.0, 1e3):
        raw = {**HUNT_332, "parallel": {**HUNT_332["parallel"],
                                        "clip": {"global_norm": threshold, "where": "after_combine"}}}
        case = case_from_dict(raw)
        r = compare_case(case, ["tf.single", "torch.ddp"])
        p = r.pairs[0]
        assert p.verdict.status == "expected_difference", (threshold, r.summary())
        assert p.residual is None and "predicted_scale" not in (p.localisation or {}), (threshold, r.summary())
        assert predicted_scale(case.spec, p.prediction, engine("tf.single"), engine("torch.ddp")) is not None
