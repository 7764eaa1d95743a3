"""Per-device capture (CONTRACT §6 stages): what each implementation records at one step, and the chain it feeds.

A case with ``capture = k`` makes the built-ins record step k's per-device
values (``device/x``, ``device/sizes``, ``device/loss``, ``device/act/<layer>``,
``device/grad/<name>``, ``device/combined/<name>``): TensorFlow from inside the
traced tower step, torch DDP through a communication hook before the all-reduce.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parity_tests.judging.localise import _gap
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

# 18 rows over 4 devices: shards 5, 5, 4, 4, so weighting and shard sizes matter; semantics tf: the
# same formula on both sides in float64 (native Keras rounds the learning rate to float32)
UNEVEN = {"data__global_batch": 18, "parallel__weighting": "by_size", "steps": 3,
          "optimizer": {"name": "sgd", "lr": 0.01, "semantics": "tf"}}


@pytest.mark.parametrize("combine", ["grad_mean", "loss_mean"])
def test_tf_towers_and_ddp_capture_the_same_per_device_values(pool, combine):
    case = dataclasses.replace(make(MLP, **UNEVEN, parallel__combine=combine), capture=2)
    tf_side, torch_side = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    keys = sorted(k for k in tf_side if k.startswith("device/"))
    assert keys == sorted(k for k in torch_side if k.startswith("device/"))
    assert {"device/x", "device/loss", "device/act/0", "device/grad/0.kernel", "device/combined/0.kernel"} <= set(keys)
    assert tf_side["device/sizes"].tolist() == torch_side["device/sizes"].tolist() == [5, 5, 4, 4]
    # float64, one step from parameters that agree to ~1e-16: rounding of a few dozen operations
    # is below 1e-13; a missing weight (DDP's rank backpropagates N w_r l_r, the hook's copy is
    # divided by it) would be a gap of 0.1 or more
    for k in keys:
        assert _gap(tf_side[k], torch_side[k]) < 1e-12, k
    # each device's gradient is d l_r / d param: weighted by n_r / B they sum to the combined one
    w = np.array([5, 5, 4, 4]) / 18
    for side in (tf_side, torch_side):
        mixed = np.tensordot(w, side["device/grad/0.kernel"], axes=1)
        assert _gap(mixed, side["device/combined/0.kernel"]) < 1e-12


def test_one_device_captures_the_whole_batch(pool):
    case = dataclasses.replace(make(MLP, **UNEVEN), capture=1)
    for impl in ("tf.single", "torch.single"):
        t = run_impl(case, impl)
        assert t["device/sizes"].tolist() == [18] and t["device/x"].shape == (18, 5)
        assert _gap(t["device/combined/0.kernel"], t["grad/0.kernel"][0]) == 0.0  # no clipping: the one applied


def test_a_capture_run_trains_as_the_free_run(pool):
    case = make(MLP, **UNEVEN)
    for impl in ("tf.towers", "torch.ddp"):
        free, captured = run_impl(case, impl), run_impl(dataclasses.replace(case, capture=2), impl)
        for k in free:
            assert _gap(free[k], captured[k]) < 1e-14, (impl, k)


@pytest.mark.parametrize(("changes", "impls", "stage"), [
    ({"model__reduction": "sum", "parallel__devices": 2}, ["tf.towers", "torch.single"], "combined_grads"),
    ({"parallel__clip": {"global_norm": 0.05, "where": "per_device"}, "parallel__devices": 2,
      "optimizer": {"name": "sgd", "lr": 0.01, "semantics": "tf"}}, ["tf.towers", "tf.single"], "clip"),
])
def test_a_predicted_difference_appears_first_at_the_stage_theory_names(pool, changes, impls, stage):
    pair = compare_case(make(MLP, **changes), impls).pairs[0]
    where = pair.localisation
    assert pair.verdict.status == "expected_difference"
    assert where["predicted_stage"] == stage and where["stage"] == stage and where["as_predicted"]
    assert f"theory predicted it first at {stage}: it appeared there" in where["explanation"]
    assert [c["stage"] for c in where["chain"]][0] == "inputs"


def test_without_stages_nothing_is_run_again(pool):
    calls = []

    def runner(case, impl):
        calls.append(case.capture)
        return run_impl(case, impl)

    compare_case(make(MLP, model__reduction="sum", parallel__devices=2), ["tf.towers", "torch.single"],
                 runner=runner, stages=False)
    assert calls and all(c is None for c in calls)  # the free runs only (float64, Keras-mapped)


def test_the_report_draws_the_stage_chain_and_writes_it_to_json(tmp_path):
    import json

    from parity_tests.reporting.report import write_case_report

    result = compare_case(make(MLP, model__reduction="sum", parallel__devices=2, steps=2), ["tf.towers", "tf.single"])
    write_case_report(result, tmp_path)
    figures = sorted(p.name for p in tmp_path.glob("stages-*.png"))
    assert figures == ["stages-mlp-tf.towers-tf.single.png"]
    assert (tmp_path / figures[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert f"]({figures[0]})" in md and "| combined_grads |" in md
    loc = json.loads((tmp_path / "report.json").read_text())["cases"][0]["pairs"][0]["verdict"]["localisation"]
    assert loc["stage"] == "combined_grads" and loc["predicted_stage"] == "combined_grads"
    assert [c["stage"] for c in loc["chain"]] == ["inputs", "forward", "combined_grads"]


def test_a_plugin_without_recorded_gradients_is_localised_by_its_device_gradients(pool):
    """Without ``grads=`` the recorded channels can only say "update"; the rank gradients it reports through
    ``run.hook_gradients`` name the stage: every rank's gradient is N (= 4) times the towers'."""
    from pathlib import Path

    plugin = f"{Path(__file__).parent / 'plugins' / 'ddp_no_grads.py'}:train"
    case = make(MLP, steps=2, optimizer={"name": "sgd", "lr": 0.01, "semantics": "tf"})
    where = compare_case(case, ["tf.towers", plugin]).pairs[0].localisation
    assert (where["first_bad_step"], where["stage"], where["device"]) == (1, "device_grads", None)
    assert "by 4x" in where["explanation"] and "per-device losses agree" in where["explanation"]
    assert compare_case(case, ["tf.towers", plugin], stages=False).pairs[0].localisation["stage"] == "update"


def test_a_known_difference_at_an_earlier_stage_is_named_where_the_runs_part_first():
    """GPT-2 small, tf.towers vs torch.ddp: Adam's epsilon placement (expected, in the update) and the float64 GELU
    constants (known, in the forward pass, 3.3e-10 > 1e-10 at the first MLP) -- the runs part first in the forward."""
    from parity_tests.judging.theory import Prediction, _diff
    from parity_tests.session.comparison import _against_theory

    pred = Prediction.of([_diff("Adam epsilon placement: Keras adds eps to sqrt(v)", mapping="optimizer"),
                          _diff("float64 GELU constants: tf.nn.gelu rounds 0.044715 through float32", expected=False,
                                mapping="gelu_semantics")], [])
    where = _against_theory({"stage": "forward", "explanation": "step 1: layer 2.0.1.body.1 differs"}, pred)
    assert where["predicted_stage"] == "update" and where["as_predicted"]
    assert where["explanation"].endswith("theory predicted it first at update: it appeared first at forward,"
                                         " where the known difference 'float64 GELU constants' acts")
    elsewhere = _against_theory({"stage": "loss", "explanation": "step 1: the loss differs"}, pred)
    assert not elsewhere["as_predicted"] and elsewhere["explanation"].endswith("it appeared first at loss")


def test_a_difference_of_the_bfloat16_roundings_alone_places_no_float64_divergence():
    """Seed 1's 1168: a mutant summing where the case means, behind Keras' bias gradient summed in bfloat16, parts
    1.16 in the float64 runs, which compute no bfloat16: the prediction explains none of it (``pair.resolve``),
    so the where-line names no stage of it; the bfloat16 rule's verdict (the mixed runs) keeps the note."""
    from parity_tests.judging.theory import BFLOAT16_ONLY, Prediction, _diff
    from parity_tests.judging.verdict import RULE_FLOAT64
    from parity_tests.session.comparison import _against_theory

    pred = Prediction.of([_diff("Keras' bias gradient summed in bfloat16: ...", only_in=BFLOAT16_ONLY)], [])
    where = {"stage": "loss", "explanation": "step 1: the loss differs"}
    assert _against_theory(where, pred, RULE_FLOAT64) == where
    mixed = _against_theory(where, pred, "bfloat16 against float64")
    assert mixed["predicted_stage"] == "device_grads" and not mixed["as_predicted"], mixed
    assert mixed["explanation"].endswith("theory predicted it first at device_grads: it appeared first at loss")


def _resnet_case():
    """The matrix's small ResNet (convolutions, batch norm with moving statistics, residual blocks) in float64, 1
    device: the case whose gradients another trace of the step moved in the last bits (trajectory_hashes.py
    --quick --capture 1, 2026-11-29: 13 tf.towers and tf.single runs of ResNet, ViT and GPT cases moved)."""
    from parity_tests.reporting.matrix import matrix_cases

    return next(c for c in matrix_cases(devices=(1,), dtypes=("float64",), combines=("grad_mean",))
                if c.name == "resnet-a-native:n1:grad_mean:float64")


@pytest.mark.parametrize("impl", ["tf.towers", "tf.single", "torch.ddp", "torch.single"])
def test_a_run_that_captures_in_place_trains_bit_for_bit_as_without(pool, impl):
    """``EngineSpec.captures_in_place``: the session makes a pair's float64 run and its step-1 capture as one run,
    so the run with the capture must be the run without it, every array bit for bit (the moving statistics too)."""
    from parity_tests.running import registry

    assert registry.resolve(impl).spec.captures_in_place
    case = _resnet_case()
    free, captured = run_impl(case, impl), run_impl(dataclasses.replace(case, capture=1), impl)
    assert int(captured["device/step"]) == 1
    assert sorted(free) == sorted(k for k in captured if not k.startswith("device/"))
    moved = [k for k in free if not np.array_equal(np.asarray(free[k]), np.asarray(captured[k]))]
    assert moved == []


def test_a_pairs_float64_runs_capture_step_1_in_place(pool):
    """A pair with an expected difference (sum reduction, at combined_grads) whose engines capture in place: its
    float64 runs record step 1 as they go and no capture run of its own is made (each side runs once, whole),
    and the localisation is the one the separate capture runs gave (the stage chain, as theory predicts)."""
    calls = []

    def runner(case, impl):
        calls.append((impl, case.capture, case.spec["steps"], case.spec["dtype"]))
        return run_impl(case, impl)

    case = make(MLP, model__reduction="sum", parallel__devices=2, steps=2, dtype="float64")
    result = compare_case(case, ["tf.towers", "torch.single"], runner=runner)
    pair = result.pairs[0]
    assert pair.verdict.status == "expected_difference"
    assert sorted(c for c in calls if c[1] is not None) == [("tf.towers", 1, 2, "float64"), ("torch.single", 1, 2, "float64")]
    where = pair.localisation
    assert where["stage"] == "combined_grads" and where["as_predicted"]
    assert [c["stage"] for c in where["chain"]] == ["inputs", "forward", "combined_grads"]
    # the trajectories kept with the comparison hold no per-device values (the capture is kept apart)
    assert result.trajectories and not any(k.startswith("device/") for t in result.trajectories.values() for k in t)


def test_a_programs_exact_scale_rerun_has_a_capture_of_its_own():
    """A program rerun with Keras' loss scale exact (``loss_scale.ExactScaleCase``) has its plain run's spec: its
    capture must not be found as the plain run's (which a pair's float64 run may have recorded in place)."""
    from parity_tests.session.keys import capture_run
    from parity_tests.session.loss_scale import ExactScaleCase

    case = make(MLP, dtype="float64")
    exact = ExactScaleCase(**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)})
    assert exact.spec == case.spec
    assert capture_run("p.py:fit", 1, exact) != capture_run("p.py:fit", 1, case)
