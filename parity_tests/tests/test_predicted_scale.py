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
    assert _scale(make(MLP, model__reduction="sum", parallel__devices=4,
                       parallel__clip={"global_norm": 1.0, "where": "after_combine"}).spec) is None
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
