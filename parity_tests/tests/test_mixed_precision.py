"""Mixed precision: case dtype ``mixed_bfloat16`` (docs/mixed-precision.md).

Keras' ``mixed_bfloat16`` policy on the TensorFlow side (``tfpar.models``), ``torch.autocast("cpu",
dtype=torch.bfloat16)`` around the DDP forward on the torch side (``torchref.ddp``), float32 master
weights on both; judged by the bfloat16 perturbation floor plus each side's bfloat16 signature
(``parity_tests.judging.tolerance``, "Mixed precision"). Every expected figure below comes from
the bfloat16 format itself (unit roundoff ``u_b = 2**-9``) or from torch/TensorFlow's own casts,
never from the code under test.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from parity_tests.contract.errors import CaseError
from parity_tests.judging.judge import BF16_CHECK, compare_case
from parity_tests.judging.theory import BFLOAT16_OPS, predict, reported_loss_differs, stage_of
from parity_tests.judging.tolerance import (
    BF16_SIGNATURE,
    RULE_BF16_PERTURBATION,
    RULE_BF16_SIGNATURE,
    bfloat16_signature,
    perturb_bf16_ulp,
    round_bfloat16,
)
from parity_tests.reporting.matrix import matrix_cases
from parity_tests.running.harness import run_impl, tf_module
from parity_tests.tests.helpers import CNN, MLP, make

pytestmark = pytest.mark.usefixtures("pool")

U_B = 2.0**-9  # bfloat16 unit roundoff: 8 significant bits


def _mixed(base: dict = MLP, **changes):
    return make(base, dtype="mixed_bfloat16", **changes)


# ------------------------------------------------------------------ the case field


def test_dtype_mixed_bfloat16_validates_and_bad_values_name_their_field():
    assert _mixed().spec["dtype"] == "mixed_bfloat16"
    with pytest.raises(CaseError) as e:
        make(MLP, dtype="bfloat16")
    assert e.value.field == "dtype" and "mixed_bfloat16" in str(e.value)
    with pytest.raises(CaseError) as e:  # the local-update rules have no mixed-precision path
        _mixed(parallel__combine="param_mean", parallel__period=1)
    assert e.value.field == "parallel.combine" and "mixed_bfloat16" in str(e.value)


@pytest.mark.parametrize("impl", ["tf.v1", "tf.mirrored"])
def test_paths_without_mixed_precision_refuse_naming_dtype(impl):
    with pytest.raises(CaseError) as e:
        run_impl(_mixed(parallel__devices=2), impl)
    assert e.value.field == "dtype" and impl in str(e.value)


def test_lockstep_refuses_a_mixed_case_naming_dtype():
    from parity_tests.running.lockstep import lockstep_compare

    with pytest.raises(CaseError) as e:  # its per-step rule holds float32 runs against float64 ones
        lockstep_compare(_mixed(parallel__devices=2), ["tf.towers", "torch.ddp"])
    assert e.value.field == "dtype" and "--lockstep" in str(e.value)


# ------------------------------------------------------------------ bfloat16 arithmetic of the judge


def test_round_bfloat16_and_the_one_ulp_move_agree_with_torch():
    import torch

    rng = np.random.default_rng(0)
    x = rng.normal(size=2000).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4, 2000)
    ties = np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-8 + 2**-17])  # halfway cases: ties to even
    x = np.concatenate([x, ties, np.float32([0.0, 1.0, -2.0])])
    want = torch.from_numpy(x).bfloat16().float().numpy()  # torch's own cast (round to nearest even)
    np.testing.assert_array_equal(round_bfloat16(x), want)
    moved = perturb_bf16_ulp({"x": x.astype(np.float64)}, seed=3)["x"]
    base = torch.from_numpy(want).bfloat16()
    up = torch.nextafter(base, torch.full_like(base, float("inf"))).float().numpy()
    down = torch.nextafter(base, torch.full_like(base, -float("inf"))).float().numpy()
    nz = want != 0
    assert np.all((moved[nz] == up[nz]) | (moved[nz] == down[nz]))  # exactly one bfloat16 neighbour
    assert 0.3 < np.mean(moved[nz] == up[nz]) < 0.7  # a fair coin per element
    assert np.all(moved[~nz] == 0)  # zeros are not moved


# ------------------------------------------------------------------ the two sides


def test_theory_names_the_op_lists_and_the_stage():
    spec = _mixed().spec
    assert predict(spec, "tf.towers", "tf.single").known == ()  # same framework, same op list
    known = predict(spec, "tf.towers", "torch.ddp").known
    assert any(k.startswith("mixed precision, dense bias") for k in known), known
    assert any(k.startswith("mixed precision, logits") for k in known), known
    assert all(stage_of(k) == "forward" for k in known if k.startswith("mixed precision"))
    assert reported_loss_differs(spec, "tf.towers", "torch.ddp") and not reported_loss_differs(spec, "tf.towers", "tf.single")
    assert set(BFLOAT16_OPS) == {"tf", "torch"}


def test_torch_autocast_runs_the_ops_theory_says():
    """What BFLOAT16_OPS['torch'] states, read from torch's CPU autocast itself."""
    import torch
    import torch.nn.functional as F

    x, w, b = torch.randn(4, 5), torch.randn(5, 3), torch.randn(3)
    img, k = torch.randn(2, 1, 6, 6), torch.randn(4, 1, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prod = x @ w
        assert prod.dtype == torch.bfloat16 and (prod + b).dtype == torch.float32  # bias in float32
        assert F.conv2d(img, k, torch.randn(4)).dtype == torch.bfloat16  # bias inside the conv
        assert torch.pow(x[:, :1], torch.arange(2.0)).dtype == torch.float32  # on no list


def test_towers_and_ddp_keep_float32_masters_and_differ_by_bfloat16_sized_gaps():
    case = _mixed(parallel__devices=2, steps=2)
    f32 = case.replace(dtype="float32")
    tm, dm = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    tf32, d32 = run_impl(f32, "tf.towers"), run_impl(f32, "torch.ddp")
    for traj in (tm, dm):
        assert all(v.dtype == np.float32 for k, v in traj.items() if k.startswith(("param/", "grad/", "loss")))
    # each side computes in bfloat16: its step-1 loss/gradients are >= 2^-12 from its own float32 run
    # (two float32 computations of one step differ by <= 2.4e-4 ~ 2^-12, tolerance.py "signature")
    assert bfloat16_signature(tm, tf32)[0] >= BF16_SIGNATURE
    assert bfloat16_signature(dm, d32)[0] >= BF16_SIGNATURE
    # and the two frameworks' mixed runs part by bfloat16-sized amounts: above float32 rounding (4 float32 unit
    # roundoffs, 2.4e-7), below a few bfloat16 unit roundoffs per step carried over 2 steps (4 * 2 * u_b)
    gap = max(np.abs(tm[k] - dm[k]).max() / max(np.abs(tm[k]).max(), 1e-2) for k in tm if k.startswith("param/"))
    loss_gap = float(np.abs(tm["loss"][0] - dm["loss"][0]) / abs(dm["loss"][0]))
    assert 4 * 2.0**-24 < max(gap, loss_gap) < 4 * 2 * U_B, (gap, loss_gap)


# ------------------------------------------------------------------ the verdicts


def test_seed_mlp_at_2_devices_is_parity_with_the_op_list_differences_named():
    """The matrix's row: theory predicts no divergence and names the dense-bias and logits differences."""
    (case,) = [c for c in matrix_cases(devices=(2,), dtypes=("mixed_bfloat16",), expected_rows=False)
               if c.name.startswith("mlp-sgd:")]
    r = compare_case(case, ["tf.towers", "torch.ddp", "tf.single"])
    for p in r.pairs:
        assert (p.verdict.status, p.verdict.rule) == ("parity", RULE_BF16_PERTURBATION), r.summary()
        assert p.prediction.expected == ()
    ddp = r.pairs[0]
    assert any(k.startswith("mixed precision, dense bias") for k in ddp.prediction.known)
    assert "loss reported, not judged" in ddp.verdict.detail
    assert f"tf.towers@{BF16_CHECK}" in r.trajectories and r.trajectories[f"tf.towers@{BF16_CHECK}"]["loss"].shape == (1,)


def _side_runner(buggy: str, run):
    """A runner that runs ``buggy`` through ``run(case, impl)`` and every other implementation normally."""
    return lambda c, impl: run(c, impl) if impl == buggy else run_impl(c, impl)


def test_a_side_computing_in_float32_is_caught_by_its_bfloat16_signature():
    # the buggy side ignores the policy: its "mixed" run is a float32 run. By the triangle inequality it is within
    # the bfloat16 noise of a correct side, so the floor cannot see it; the signature check must
    runner = _side_runner("tf.single", lambda c, impl: run_impl(c.replace(dtype="float32"), impl))
    r = compare_case(_mixed(parallel__devices=2, steps=2), ["tf.towers", "tf.single"], runner=runner, stages=False)
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_BF16_SIGNATURE), r.summary()
    assert v.detail.startswith("tf.single does not compute in bfloat16") and v.gap < 1e-6


def test_a_bfloat16_bias_gradient_summed_in_bfloat16_is_a_divergence(monkeypatch):
    """Seeded bug: a conv bias added with tf.nn.bias_add, whose gradient sums bfloat16 in bfloat16."""
    tf_module()
    import tensorflow as tf

    models = sys.modules["tfpar.models"]

    def buggy(c, impl):
        with monkeypatch.context() as m:
            m.setattr(models, "_mixed_bias_add", tf.nn.bias_add)
            return run_impl(c, impl)

    case = _mixed(CNN, parallel__devices=2, parallel__batch_norm="sync", steps=2)
    good = compare_case(case, ["tf.towers", "tf.single"], stages=False)
    assert good.pairs[0].verdict.status == "parity", good.summary()
    r = compare_case(case, ["tf.towers", "tf.single"], runner=_side_runner("tf.single", buggy), stages=False)
    v = r.pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_BF16_PERTURBATION), r.summary()
    assert v.key == "param/0.bias", r.summary()
