"""``session.scale_rerun``: theory's sum reduction held to its exact ratio on the parallel plugin rerun where it is exact.

The 10,000-pair hunt's misses behind a predicted sum reduction (``unshared_towers``, ``missing_activation``,
``unscoped_loss_collection``, ``same_shard`` against one device, ``by_size`` on uneven shards or a clip per
device): the stand-in is no equivalent run, the plugin is not mapped on itself (``weighting: sum`` is no value
every program runs) and the ratio is not exact on those cases, so nothing checked the prediction. On the plugin
rerun with ``weighting: equal`` (and the clip after the combine) it is: each rule with a case where it must fire
and one where it must not.
"""

from __future__ import annotations

import copy
from fractions import Fraction
from pathlib import Path

import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.theory import predict
from parity_tests.running import registry
from parity_tests.session.comparison import compare_case
from parity_tests.session.scale_rerun import ratio_rerun
from parity_tests.tests.helpers import MLP, make

HUNT_TF = str(Path(__file__).parent / "hunt" / "tf_side.py")
MAPPING_TORCH = str(Path(__file__).parent / "plugins" / "mapping_torch.py")

#: two dense layers (tanh, so a forgotten activation changes the gradient), 3 devices on 4 rows (2, 1, 1: uneven),
#: ``by_size``, ``reduction: sum``: the parallel side's step-1 gradient is sum_r (n_r / 4) g_r, no multiple of the
#: one-device side's sum_r g_r; a warmup_cosine under native (Keras' CosineDecay a step late in tf.single and in
#: tf.towers, the plugins' written-out rules on the curve) makes the stand-in no equivalent run of any plugin
UNEVEN = {"schema": "parity-case/1", "name": "ratio", "dtype": "float64", "seed": 0,
          "model": {"input_shape": [3], "layers": [{"type": "dense", "units": 2, "activation": "tanh", "use_bias": True},
                                                   {"type": "dense", "units": 1, "activation": "none", "use_bias": True}],
                    "loss": "mse", "reduction": "sum"},
          "init": {"seed": 1, "kind": "normal", "stddev": 0.5},
          "data": {"generator": "gaussian", "seed": 2, "global_batch": 4},
          "optimizer": {"name": "sgd", "semantics": "native", "lr": 0.1,
                        "schedule": {"kind": "warmup_cosine", "warmup_steps": 1, "decay_steps": 2, "min_lr": 0.01}},
          "parallel": {"devices": 3, "combine": "grad_mean", "shard": "contiguous", "weighting": "by_size"},
          "steps": 2}


def _rerun(raw, a="torch.single", b="torch.ddp"):
    for name in (a, b):  # declared, as the session resolves every name before theory reads its kind
        registry.resolve(name, "impls")
    case = case_from_dict(raw)
    return ratio_rerun(case, predict(case.spec, a, b), a, b)


def test_no_rerun_where_the_ratio_is_exact_already_or_a_built_in_is_mapped():
    """Not asked where it adds nothing: the parallel side a built-in (its mapped run is the residual), even shards
    under ``by_size`` (the ratio is exact on the case as given: ``residual.scale_checked`` reads it), a ``mean``
    reduction (no sum reduction predicted), one device on both sides."""
    plain = {k: v for k, v in UNEVEN.items() if k != "optimizer"} | {"optimizer": {"name": "sgd", "lr": 0.1}}
    assert _rerun(plain) is None  # torch.ddp, a built-in
    even = copy.deepcopy(plain)
    even["data"]["global_batch"] = 6
    assert _rerun(even, b=f"{HUNT_TF}:add_n") is None
    mean = copy.deepcopy(plain)
    mean["model"]["reduction"] = "mean"
    assert _rerun(mean, b=f"{HUNT_TF}:add_n") is None


def test_the_rerun_is_the_plugin_itself_with_equal_weighting_and_the_clip_after_the_combine():
    """``by_size`` on uneven shards: ``weighting: equal`` on the plugin itself (either side of the pair), the ratio 1/3
    (3 where the plugin is the reference); with a clip per device, the clip after the combine too. Not across the
    frameworks' clip rules (torch's ``clip_grad_norm_`` adds 1e-6 to the norm: a difference at the clip, so the
    direction-and-bounds identity of ``predicted_scale`` is not claimed there)."""
    plain = {k: v for k, v in UNEVEN.items() if k != "optimizer"} | {"optimizer": {"name": "sgd", "lr": 0.1}}
    rr = _rerun(plain, b=f"{HUNT_TF}:add_n")
    assert rr is not None and rr.mapping.itself and rr.mapping.side == f"{HUNT_TF}:add_n"
    assert rr.mapping.changes == {"parallel.weighting": "equal"} and rr.scale[0] == Fraction(1, 3)
    assert not rr.reference_is_parallel and rr.clip is None
    swapped = _rerun(plain, a=f"{HUNT_TF}:add_n", b="torch.single")
    assert swapped is not None and swapped.reference_is_parallel and swapped.scale[0] == Fraction(3)
    clipped = copy.deepcopy(plain)
    clipped["parallel"]["clip"] = {"global_norm": 0.5, "where": "per_device"}
    rr = _rerun(clipped, a="tf.single", b=f"{HUNT_TF}:add_n")
    assert rr is not None and rr.clip == 0.5
    assert rr.mapping.changes == {"parallel.weighting": "equal",
                                  "parallel.clip": {"global_norm": 0.5, "where": "after_combine"}}
    assert _rerun(clipped, a="torch.single", b=f"{HUNT_TF}:add_n") is None


@pytest.mark.usefixtures("pool")
def test_bugs_behind_the_sum_reduction_on_uneven_shards_are_divergences_and_correct_plugins_are_not():
    """tf.single against the hunt's TensorFlow plugins on :data:`UNEVEN`. ``unshared_towers`` (each tower updates its
    own copy) was ``expected_difference`` (its stand-in parts from it, so no residual, and the ratio is no constant
    on these shards); rerun with ``weighting: equal`` its step-1 gradient is not 1/3 of tf.single's: a divergence
    naming the rerun. ``add_n`` and ``stack_mean`` (correct, their stand-in as far from them by Keras' late
    CosineDecay) hold the ratio on the same rerun (to 1e-16): ``expected_difference`` stays."""
    r = compare_case(case_from_dict(UNEVEN), ["tf.single", f"{HUNT_TF}:add_n", f"{HUNT_TF}:stack_mean",
                                              f"{HUNT_TF}:unshared_towers"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    for name in ("add_n", "stack_mean"):
        assert pairs[name].verdict.status == "expected_difference", summary
        assert pairs[name].residual is None, summary
        assert any("run with parallel.weighting equal" in n and n.endswith("it holds") for n in pairs[name].notes), summary
    bug = pairs["unshared_towers"]
    assert bug.verdict.status == "divergence", summary
    assert "run with parallel.weighting equal" in bug.verdict.detail, summary
    assert "predicted 0.3333x (1/3)" in bug.verdict.detail, summary
    assert bug.localisation["predicted_scale"]["rerun"].endswith("run with parallel.weighting equal"), summary


@pytest.mark.usefixtures("pool")
def test_a_plugin_that_fails_on_the_rerun_keeps_its_verdict_and_one_that_runs_it_is_checked():
    """DDP ports whose rank loss is its shard's mean where the case sums (the hunt's ``reduction_flipped``) on the
    MLP case at 5 devices on 48 rows (10, 10, 10, 9, 9), ``by_size``, ``reduction: sum``: the stand-in torch.ddp
    parts from them at the loss (no residual) and the ratio is no constant on these shards. The port that honours
    ``weighting: equal`` is rerun so and its step-1 gradient is 1/B of the single side's where 1/5 is predicted: a
    divergence. The one that raises on any weighting but ``by_size`` cannot be rerun: the compare still ends, with a
    note that the ratio was not checked (a check of the prediction fails no compare); it is a divergence all the same,
    by the stand-in's leg (torch.single, a built-in, computes the case: ``mapping.stand_in_leg``'s ``computes``; it
    was ``expected_difference`` before that rule)."""
    case = make(MLP, parallel__devices=5, parallel__weighting="by_size", model__reduction="sum", steps=1)
    r = compare_case(case, ["torch.single", f"{MAPPING_TORCH}:sgd_shard_mean_weighted",
                            f"{MAPPING_TORCH}:sgd_shard_mean_by_size_only"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    checked = pairs["sgd_shard_mean_weighted"]
    assert checked.verdict.status == "divergence", summary
    assert "run with parallel.weighting equal" in checked.verdict.detail, summary
    failed = pairs["sgd_shard_mean_by_size_only"]
    assert any("not checked" in n and "its rerun failed" in n for n in failed.notes), summary
    assert failed.verdict.status == "divergence" and "the other side computes the case" in failed.verdict.detail, summary
