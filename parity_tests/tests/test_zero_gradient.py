"""Parameters whose exact gradient is zero (the attention key bias): correct runs at parity, real bugs still caught.

Both directions at the smallest size that shows them: a one-block ViT (8x8 images cut into 16
tokens of 4, width 8, two heads of key_dim 4, so the scale is exact and nothing else differs) run
for 4 Adam steps in float64 by ``tf.towers`` and ``torch.ddp`` at 2 devices. The key bias there
moves only by each side's rounding, which Adam turns into steps of ``lr |g| / eps``: the float64
rule alone calls it a divergence (the premise, checked), the judge with the derived drift bound
(``judging.zero_gradient``) calls it parity and names it on its own line. A wrong update of that
same parameter (a weight decay one side applies to it) and an implementation whose key bias
gradient is not rounding (a bias not shared by a row's keys) are divergences at that parameter.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity_tests.judging.rules import judge_float32, judge_float64
from parity_tests.judging.zero_gradient import ROUNDING_STAGES, U64, zero_gradients
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import make

KEY_BIAS = "4.body.1.k.bias"


def _vit(opt: str = "adam", dtype: str = "float64", init: str = "glorot_uniform", layers: list | None = None,
         **optimizer) -> object:
    layers = layers or [{"type": "reshape", "shape": [16, 4]}, {"type": "dense", "units": 8}, {"type": "class_token"},
              {"type": "position_embedding", "length": 17},
              {"type": "residual", "body": [{"type": "layer_norm", "epsilon": 1e-5},
                                            {"type": "attention", "num_heads": 2, "key_dim": 4}]},
              {"type": "residual", "body": [{"type": "layer_norm", "epsilon": 1e-5},
                                            {"type": "dense", "units": 16, "activation": "relu"},
                                            {"type": "dense", "units": 8}]},
              {"type": "layer_norm", "epsilon": 1e-5}, {"type": "take_token"}, {"type": "dense", "units": 3}]
    raw = {"schema": "parity-case/1", "name": "tiny-vit", "dtype": dtype,
           "model": {"input_shape": [8, 8, 1], "layers": layers, "loss": "softmax_ce"},
           "init": {"seed": 8, "kind": init, **({"stddev": 0.3} if init == "normal" else {})},
           "data": {"generator": "images", "seed": 9, "global_batch": 8},
           "optimizer": {"name": opt, "lr": 1e-3, "semantics": "torch", **optimizer}, "parallel": {"devices": 2},
           "steps": 4}
    return make(raw)


@pytest.fixture(scope="module")
def runs(pool):
    """The tiny ViT in float64, Adam: ``tf.towers`` and ``torch.ddp`` (correct implementations)."""
    case = _vit()
    return case, run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")


# ---------------------------------------------------------------- which parameters, and the bound's pieces


def test_the_key_bias_of_every_attention_layer_is_found():
    case = _vit()
    (z,) = zero_gradients(case.spec).params
    assert z.name == KEY_BIAS and z.terms == 8 * 17 and "4.body.1.q.bias" in z.layer and KEY_BIAS not in z.layer
    spec = _vit().spec
    layers = [{"type": "reshape", "shape": [16, 4]},
              {"type": "repeat", "count": 2, "body": [{"type": "attention", "num_heads": 1, "key_dim": 4}]},
              {"type": "attention", "num_heads": 1, "key_dim": 4, "use_bias": False}, {"type": "flatten"},
              {"type": "dense", "units": 3}]
    other = _vit(layers=layers)
    assert [z.name for z in zero_gradients(other.spec).params] == ["1.0.0.k.bias", "1.1.0.k.bias"]
    assert zero_gradients(_vit(weight_decay=0.01).spec) is None  # torch Adam's L2: wd p is in the applied gradient
    assert zero_gradients(_vit("adamw", weight_decay=0.01).spec) is not None  # decoupled: the same on both sides
    assert spec["optimizer"]["name"] == "adam"


def test_adams_ratio_bound_holds_and_is_reached():
    """``|m_hat| / sqrt(v_hat) <= B_t`` (Cauchy-Schwarz), reached by ``g_j ~ (b1/b2)^(t-j)``; B_1 = 1, B_4 = 1.0068."""
    from parity_tests.judging.zero_gradient import ZeroGradients

    b1, b2 = 0.9, 0.999
    z = ZeroGradients((), {"name": "adam", "beta1": b1, "beta2": b2, "epsilon": 0.0})  # no eps: B_t decides
    bounds = z._ratios(np.ones((4, 1)))[:, 0]
    assert bounds[0] == pytest.approx(1.0, abs=1e-15) and bounds[3] == pytest.approx(1.0068, abs=1e-4)

    def ratio(g: np.ndarray) -> float:  # Adam's own averages, written out
        m = v = 0.0
        for gt in g:
            m, v = b1 * m + (1 - b1) * gt, b2 * v + (1 - b2) * gt * gt
        t = len(g)
        return abs(m / (1 - b1**t)) / math.sqrt(v / (1 - b2**t))

    rng = np.random.default_rng(0)
    worst = max(ratio(rng.normal(size=4) * rng.uniform(0, 3, size=4)) for _ in range(2000))
    extremal = ratio(np.array([(b1 / b2) ** (4 - j) for j in range(1, 5)]))
    assert worst <= bounds[3] and extremal == pytest.approx(bounds[3], rel=1e-12)


# ---------------------------------------------------------------- both directions on real runs


def test_premise_the_float64_rule_alone_calls_correct_runs_a_divergence(runs):
    case, a, b = runs
    v = judge_float64(a, b)
    assert v.status == "divergence" and v.key == f"param/{KEY_BIAS}", v.detail
    gmax = max(np.max(np.abs(t[f"grad/{KEY_BIAS}"])) for t in (a, b))
    gq = np.max(np.abs(a["grad/4.body.1.q.bias"]))
    assert gmax < 1e-14 * gq  # rounding: the exact gradient is zero


def test_correct_runs_are_parity_with_the_drift_named(runs):
    case, a, b = runs
    v = judge_float64(a, b, zero=zero_gradients(case.spec))
    assert v.status == "parity", v.detail
    (line,) = [x for x in v.detail.splitlines() if x.startswith(KEY_BIAS)]
    assert "exact gradient zero (softmax ignores a shift shared by a row)" in line and "<= bound" in line
    assert v.key != f"param/{KEY_BIAS}"


def test_correct_runs_are_parity_in_the_full_comparison(pool):
    """``compare_case`` (the report's verdict): parity, not a divergence and not inconclusive (the conditioning
    check would call the float64 runs ill-conditioned: their only gap is amplified rounding)."""
    from parity_tests.session.comparison import compare_case

    (pair,) = compare_case(_vit(), ["tf.towers", "torch.ddp"], stages=False).pairs
    assert pair.verdict.status == "parity", pair.verdict.detail
    assert KEY_BIAS in pair.verdict.detail


def _decayed(traj: dict, wd: float, lr: float = 1e-3) -> dict:
    """``traj`` with its key bias decayed by ``p <- p (1 - lr wd)`` every step: the bug of a side that applies weight
    decay to that parameter only (what a misnamed "no decay" list does)."""
    out = dict(traj)
    p = np.asarray(traj[f"param/{KEY_BIAS}"]).copy()
    p[1:] = p[1:] * (1 - lr * wd) ** np.arange(1, len(p)).reshape(-1, 1, 1)
    out[f"param/{KEY_BIAS}"] = p
    return out


@pytest.fixture(scope="module")
def normal_runs(pool):
    """The same with a non-zero key bias at the start (normal init, stddev 0.3)."""
    case = _vit(init="normal")
    return case, run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")


def test_a_wrong_key_bias_update_is_a_divergence(normal_runs):
    case, a, b = normal_runs
    zero = zero_gradients(case.spec)
    assert judge_float64(a, b, zero=zero).status == "parity"  # the premise: correct, at parity
    v = judge_float64(a, _decayed(b, 0.01), zero=zero)
    assert v.status == "divergence" and v.key == f"param/{KEY_BIAS}" and v.first_step == 1, v.detail
    assert "the most rounding can move it" in v.detail
    # decay 1e-3 x 0.01 x |p| ~ 1e-6 a step against a bound of ~1e-11: far beyond, and still caught at 100x less
    assert judge_float64(a, _decayed(b, 1e-4), zero=zero).status == "divergence"


def test_a_key_bias_gradient_that_is_not_rounding_is_judged_by_the_float64_rule(normal_runs):
    """An implementation where the key bias matters (its gradient the size of the layer's): no exemption."""
    case, a, b = normal_runs
    bad = dict(b)
    g = np.asarray(b[f"grad/{KEY_BIAS}"]).copy()
    g += 0.01 * np.max(np.abs(b["grad/4.body.1.q.bias"]))
    bad[f"grad/{KEY_BIAS}"] = g
    p = np.asarray(b[f"param/{KEY_BIAS}"]).copy()
    p[1:] -= 1e-3 * np.arange(1, len(p)).reshape(-1, 1, 1)  # Adam's sign steps of that gradient
    bad[f"param/{KEY_BIAS}"] = p
    v = judge_float64(a, bad, zero=zero_gradients(case.spec))
    assert v.status == "divergence" and v.key == f"param/{KEY_BIAS}" and v.rule == "float64 bound", v.detail
    assert "exact gradient zero" not in v.detail  # judged as every other parameter


def test_the_rounding_bound_is_what_the_evidence_uses(runs):
    """``gamma_t = D n u G_t``: the recorded key bias gradients are within it, with orders of magnitude to spare,
    and an O(G) gradient is not (the threshold is neither too tight for rounding nor loose enough for a bug)."""
    case, a, b = runs
    (z,) = zero_gradients(case.spec).params
    gq = max(np.max(np.abs(t[f"grad/{n}"])) for t in (a, b) for n in z.layer)
    gamma = ROUNDING_STAGES * z.terms * U64 * gq
    gmax = max(np.max(np.abs(t[f"grad/{KEY_BIAS}"])) for t in (a, b))
    assert gmax < gamma / 10 and gamma < 1e-10 * gq


def test_float32_runs_hold_the_drift_in_their_own_floors(pool):
    """Float32: each side's float32 floor contains its own full-size steps, so the float32 rule needs no exemption;
    the float64 runs it checks first do (parity, the key bias named)."""
    case = _vit(dtype="float32")
    f64 = case.replace(dtype="float64")
    a32, b32 = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    a64, b64 = run_impl(f64, "tf.towers"), run_impl(f64, "torch.ddp")
    v = judge_float32(a32, b32, a64=a64, b64=b64, zero=zero_gradients(f64.spec))
    assert v.status == "parity", v.detail
    assert judge_float32(a32, b32, a64=a64, b64=b64).status == "divergence"  # the premise, through its float64 runs


def test_lockstep_judges_the_key_bias_the_same_way(pool, monkeypatch):
    """``--lockstep`` (every step from the reference's state) judges each step through the same rule: parity;
    without it (the premise) one step's drift, ``lr |gA - gB| / eps``, already breaks the float64 bound."""
    from parity_tests.session import lockstep

    (pair,) = lockstep.lockstep_compare(_vit(), ["tf.towers", "torch.ddp"], free=False, stages=False).pairs
    assert pair.status == "parity"
    monkeypatch.setattr(lockstep, "zero_gradients", lambda spec: None)
    (pair,) = lockstep.lockstep_compare(_vit(), ["tf.towers", "torch.ddp"], free=False, stages=False).pairs
    assert pair.status != "parity"
