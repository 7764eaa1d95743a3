"""The float64 run rounding a mixed recipe's gradients to bfloat16 (parity_tests.protocol.grad_rounding).

Which cases it covers; on each built-in that makes it, its step-1 gradient against the same roundings written out
in numpy (a one-layer softmax model on 3 devices: the rounding of the loss's gradient at each device's scale, then
of each device's gradient, then the combine), and its forward pass unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parity_tests.judging.perturbation import round_bfloat16
from parity_tests.protocol.grad_rounding import GRADS_BF16, check_rounds_gradients, rounds_gradients
from parity_tests.protocol.shards import shard_rows
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, MLP, make

pytestmark = pytest.mark.usefixtures("pool")

#: one dense layer, softmax_ce over 3 classes, 6 rows on 3 devices weighted by size (2 each): torch.ddp rounds the
#: loss's gradient at N w_r = 1 times it, tf.towers at w_r = 1/3 (docs/error-rates.md, pair 432)
LINEAR = {
    "schema": "parity-case/1", "name": "linear", "dtype": "float64", "seed": 11,
    "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 3}], "loss": "softmax_ce", "reduction": "mean"},
    "init": {"seed": 5, "kind": "normal", "stddev": 0.1}, "data": {"generator": "blobs", "seed": 6, "global_batch": 6},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "parallel": {"devices": 3, "combine": "loss_mean", "shard": "contiguous", "weighting": "by_size"}, "steps": 2}


def _bf(a) -> np.ndarray:
    """Rounded to float32 and then to bfloat16 (what the run's identity does backward), in float64."""
    return round_bfloat16(np.asarray(a, np.float32)).astype(np.float64)


def _step1(case, devices: int, scale: float, divide: float) -> dict[str, np.ndarray]:
    """The combined step-1 gradient of the one-layer model with the roundings of ``protocol.grad_rounding``: device
    ``r`` differentiates ``scale * n_r / B`` times its mean loss (``scale``: ``N`` for torch's differentiable
    all-reduce, 1 for TensorFlow's weighted sum of the towers' losses), its loss gradient ``g`` and then its kernel
    and bias gradients rounded to bfloat16, summed over the devices in float64 and divided by ``divide``."""
    batch = case.spec["data"]["global_batch"]
    x, y = np.asarray(case.x, np.float64)[:batch], np.asarray(case.y)[:batch]
    w, b = case.init["0.kernel"], case.init["0.bias"]
    out = {"0.kernel": 0.0, "0.bias": 0.0}
    for r in range(devices):
        ix = list(shard_rows(batch, devices, r, "contiguous")) if devices > 1 else list(range(batch))
        z = x[ix] @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = _bf(scale * len(ix) / batch * (p - np.eye(3)[y[ix]]) / len(ix))
        out["0.kernel"] = out["0.kernel"] + _bf(x[ix].T @ g)
        out["0.bias"] = out["0.bias"] + _bf(g.sum(0))
    return {k: v / divide for k, v in out.items()}


def test_the_run_covers_models_of_dense_layers_only():
    assert rounds_gradients(make(LINEAR).spec) and rounds_gradients(make(MLP).spec)
    assert not rounds_gradients(make(CNN).spec)  # conv, batch norm, pooling, dropout: not every place is covered
    assert not rounds_gradients(make(MLP, parallel__combine="param_mean", parallel__period=1).spec)
    payload = {**make(CNN).payload(), GRADS_BF16: True}
    with pytest.raises(ValueError, match="grads_bf16 asks for a float64 run of a model of dense layers"):
        check_rounds_gradients(payload, "tf.towers")
    assert not check_rounds_gradients(make(CNN).payload(), "tf.towers")  # not asked: every other run as before
    assert GRADS_BF16 not in make(LINEAR).payload()


@pytest.mark.parametrize(("impl", "devices", "scale", "divide"), [
    ("torch.ddp", 3, 3.0, 3.0),  # rank r backpropagates N w_r l_r; DDP divides the float64 sum by N
    ("tf.towers", 3, 1.0, 1.0),  # the tape differentiates sum_r w_r l_r
    ("torch.single", 1, 1.0, 1.0),
    ("tf.single", 1, 1.0, 1.0),
])
def test_the_run_rounds_the_loss_gradient_and_each_devices_gradient_and_nothing_else(impl, devices, scale, divide):
    case = make(LINEAR)
    plain, rounded = run_impl(case, impl), run_impl(dataclasses.replace(case, grads_bf16=True), impl)
    want = _step1(case, devices, scale, divide)
    for k, v in want.items():
        got = np.asarray(rounded[f"grad/{k}"][0], np.float64)
        # float64 sums of bfloat16 values: equal up to float64 rounding (the matmuls' order), far below 2^-8
        np.testing.assert_allclose(got, v, rtol=1e-12, atol=1e-15, err_msg=f"{impl} {k}")
        assert not np.array_equal(got, plain[f"grad/{k}"][0]), k  # it did round
    assert rounded["loss"][0] == plain["loss"][0]  # the forward pass is the float64 run's, bit for bit
    assert rounded["loss"].dtype == np.float64


#: the 10,000-pair run's pair s2-0591 (docs/error-rates.md, "third session"): torch.ddp on 4 ranks (rows 3 each,
#: strided, loss_mean by size: each rank rounds the loss's gradient at N w_r = 1 times it) against torch.single (at
#: 1/12 of the sum), 2 steps. Before the gradient term: divergence, torch.ddp 3.25e-4 beyond the shared error >
#: its bound 1.15e-4 at step 2 (param 2.bias), an error its two reruns repeated 98 % and 99 %
UNSAMPLED = {
    "schema": "parity-case/1", "name": "s2-0591", "dtype": "mixed_bfloat16", "seed": 1663,
    "model": {"input_shape": [2], "layers": [{"type": "dense", "units": 2, "activation": "tanh", "use_bias": True},
                                             {"type": "dense", "units": 3, "activation": "none", "use_bias": True},
                                             {"type": "dense", "units": 1, "activation": "none", "use_bias": True}],
              "loss": "sigmoid_ce", "reduction": "mean"},
    "init": {"seed": 129, "kind": "normal", "stddev": 0.1}, "data": {"generator": "gaussian", "seed": 2873, "global_batch": 12},
    "optimizer": {"name": "momentum", "semantics": "native", "lr": 0.05, "momentum": 0.0},
    "parallel": {"devices": 4, "combine": "loss_mean", "shard": "strided", "weighting": "by_size"}, "steps": 2}


def _lr_scaled(impl: str, factor: float):
    """A runner whose ``impl`` trains its mixed runs at ``factor`` times the case's learning rate (a bfloat16-only
    bug: its float64 runs, the gradient-rounding one included, are right), the rest as registered."""

    def run(case, name):
        if name == impl and case.spec["dtype"] == "mixed_bfloat16":
            case = case.replace(**{"optimizer.lr": case.spec["optimizer"]["lr"] * factor})
        return run_impl(case, name)

    return run


def test_a_pair_of_unsampled_gradient_roundings_is_parity_and_a_mixed_only_bug_on_it_is_not():
    from parity_tests.judging.bfloat16 import RULE_BF16_FLOAT64
    from parity_tests.session.comparison import compare_case

    case = make(UNSAMPLED)
    v = compare_case(case, ["torch.ddp", "torch.single"], stages=False).pairs[0].verdict
    assert (v.status, v.rule) == ("parity", RULE_BF16_FLOAT64), v.detail  # must not fire (was a divergence)
    assert "gradients of torch.ddp" in v.detail and "gradients of torch.single" in v.detail, v.detail
    # a 10 % learning-rate error in torch.ddp's mixed runs alone (a bug the float64 rule cannot see): must fire
    v = compare_case(case, ["torch.ddp", "torch.single"], runner=_lr_scaled("torch.ddp", 1.1), stages=False).pairs[0].verdict
    assert (v.status, v.rule) == ("divergence", RULE_BF16_FLOAT64), v.detail
    assert v.detail.startswith("torch.ddp is farther") and "x gradients" in v.detail, v.detail


def test_the_session_asks_a_built_in_for_the_run_on_a_mixed_dense_case_only():
    from parity_tests.judging.run_kinds import GRADS64
    from parity_tests.session.plan import _can, _mapped_needs

    mixed = make(LINEAR, dtype="mixed_bfloat16")
    assert _can("tf.towers", mixed).grads_bf16 and _can("torch.ddp", mixed).grads_bf16
    assert not _can("tf.v1", mixed).grads_bf16  # declares no such run (it runs no mixed_bfloat16)
    assert not _can("tf.towers", make(LINEAR)).grads_bf16  # a float64 case: the bfloat16 rule does not judge it
    assert not _can("tf.towers", make(CNN, dtype="mixed_bfloat16")).grads_bf16  # not a model of dense layers
    # a mapped side, and a stand-in's unmapped run (no mapping: the case itself; was an AttributeError)
    assert GRADS64 in _mapped_needs(mixed, "perturbation", "torch.ddp", None)
    assert GRADS64 not in _mapped_needs(make(CNN, dtype="mixed_bfloat16"), "perturbation", "torch.ddp", None)
