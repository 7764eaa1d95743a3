"""Loss options (class weights, label smoothing, probabilities) and the table of layer/loss differences.

``DIFFERENCES`` is the table the docs quote: for each difference between the
frameworks (or between N devices and one), a case that shows it, the two
implementations compared, and the case change that maps it away. Two tests
run every row: the difference is detected (and named by ``theory.predict``),
and the mapped case agrees at the float64 tolerance. Its gaps are measured by

    .venv/bin/python -m parity_tests.tests.test_losses

which prints the markdown table in ``docs/layers.md``.

The direct checks compare ``tfpar.losses.device_loss`` and
``torchref.losses.shard_loss`` with plain-numpy statements of Keras' and
torch's formulas (written here, independently of both packages), value and
gradient (the gradient against central differences of the numpy formula).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from parity_tests.contract.case import Case
from parity_tests.contract.model import validate_model
from parity_tests.judging.compare import (
    assert_trajectories_close,
    compare_trajectories,
    relative_gap,
)
from parity_tests.judging.theory import predict
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, MLP, SOFTMAX, make

RTOL, ATOL = 1e-10, 1e-12  # see test_layers.py for the derivation
CW = [1.0, 3.0, 0.5]  # class weights for the 3-class SOFTMAX case
SGD = {"name": "sgd", "lr": 0.05, "semantics": "torch"}  # exact on both sides: only the loss differs


# ---------------------------------------------------------------- numpy statements of the formulas


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def np_softmax_ce(rule: str, z: np.ndarray, y: np.ndarray, reduction: str, smoothing: float, cw: list[float] | None) -> float:
    """Keras' (``rule="tf"``) or torch's (``"torch"``) weighted, smoothed cross entropy."""
    n, k = z.shape
    logp = _log_softmax(z)
    w_c = np.ones(k) if cw is None else np.asarray(cw)
    w = w_c[y]
    if rule == "tf":  # CategoricalCrossentropy(label_smoothing) with sample_weight = cw[y], sum_over_batch_size
        t = (1 - smoothing) * np.eye(k)[y] + smoothing / k
        total = (w * -(t * logp).sum(axis=1)).sum()
        return total / n if reduction == "mean" else total
    nll = -logp[np.arange(n), y]  # F.cross_entropy(weight=cw, label_smoothing)
    total = (1 - smoothing) * (w * nll).sum() + smoothing / k * -(logp * w_c).sum()
    return total / w.sum() if reduction == "mean" else total


def np_sigmoid_ce(z: np.ndarray, y: np.ndarray, reduction: str, smoothing: float) -> float:
    t = y * (1 - smoothing) + 0.5 * smoothing
    per = np.maximum(z, 0) - z * t + np.log1p(np.exp(-np.abs(z)))
    return per.mean() if reduction == "mean" else per.sum()


def _numeric_grad(f, z: np.ndarray, h: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(z)
    for idx in np.ndindex(z.shape):
        zp, zm = z.copy(), z.copy()
        zp[idx] += h
        zm[idx] -= h
        g[idx] = (f(zp) - f(zm)) / (2 * h)
    return g


def _tf_loss(z, y, **kw):
    import tensorflow as tf

    from tfpar.losses import device_loss

    zt = tf.Variable(z)
    with tf.GradientTape() as tape:
        loss = device_loss(kw.pop("loss"), kw.pop("reduction"), zt, tf.constant(y), **kw)
    return float(loss), tape.gradient(loss, zt).numpy()


def _torch_loss(z, y, **kw):
    import torch

    from torchref.losses import shard_loss

    zt = torch.tensor(z, requires_grad=True)
    logits = kw.pop("logits", None)
    loss = shard_loss(kw.pop("loss"), kw.pop("reduction"), zt, torch.as_tensor(y), logits=logits, **kw)
    loss.backward()
    return float(loss.detach()), zt.grad.numpy()


@pytest.fixture(autouse=True, scope="module")
def _tf_devices():
    from parity_tests.running.backends import tf_device_count

    tf_device_count()


# ---------------------------------------------------------------- direct checks


@pytest.mark.parametrize("semantics", ["native", "tf", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("smoothing", "cw"), [(0.0, None), (0.2, None), (0.0, CW), (0.2, CW)],
                         ids=["plain", "smoothing", "class-weights", "both"])
def test_softmax_ce_each_side_computes_its_rule(semantics, reduction, smoothing, cw):
    rng = np.random.default_rng(0)
    z, y = rng.normal(0, 2, size=(7, 3)), rng.integers(0, 3, size=7)
    opts = {"loss": "softmax_ce", "reduction": reduction, "label_smoothing": smoothing, "class_weights": cw, "semantics": semantics}
    tf_rule = "tf" if semantics == "native" else semantics
    torch_rule = "torch" if semantics == "native" else semantics
    for run, rule in ((_tf_loss, tf_rule), (_torch_loss, torch_rule)):
        value, grad = run(z, y, **opts)
        want = np_softmax_ce(rule, z, y, reduction, smoothing, cw)
        np.testing.assert_allclose(value, want, rtol=1e-13, err_msg=f"{run.__name__} value")
        # central differences: error ~h^2 f''' + eps f / h ~ 1e-10 here
        num = _numeric_grad(lambda zz, rule=rule: np_softmax_ce(rule, zz, y, reduction, smoothing, cw), z)
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-8, err_msg=f"{run.__name__} gradient")
    if tf_rule == torch_rule:
        _, g_tf = _tf_loss(z, y, **opts)
        _, g_torch = _torch_loss(z, y, **opts)
        np.testing.assert_allclose(g_tf, g_torch, rtol=RTOL, atol=ATOL)


def _graph_loss_and_grad(loss_fn, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``loss_fn(z)`` and the gradient of ``sum_i c_i loss_i`` in a ``tf.function``, as the towers trace it."""
    import tensorflow as tf

    c = tf.constant(np.linspace(-1.0, 2.0, z.shape[0]), z.dtype)  # unequal, signed upstream gradients

    @tf.function(autograph=False)
    def run(zt):
        with tf.GradientTape() as tape:
            tape.watch(zt)
            loss = loss_fn(zt)
            total = tf.reduce_sum(loss * c) if loss.shape.rank else loss
        return loss, tape.gradient(total, zt)

    return tuple(t.numpy() for t in run(tf.constant(z)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sparse_softmax_ce_is_tensorflows_op_bit_for_bit(dtype):
    """``tfpar.losses.sparse_softmax_ce`` (one-hot sum, cheap to trace) is TensorFlow's deterministic op, bit for bit.

    Under op determinism ``tf.nn.sparse_softmax_cross_entropy_with_logits`` is ``log_softmax``
    then ``gather(batch_dims=1)``; the one-hot sum must give the same loss and gradient,
    saturated rows (logits +-300) included. The torch rule's ``-log p_iy`` (label smoothing,
    class weights) takes its entry the same way: checked against the gather form too.
    """
    import tensorflow as tf
    from tensorflow.python.framework import config as tf_config

    from tfpar.losses import device_loss, sparse_softmax_ce

    assert tf_config.is_op_determinism_enabled(), "the towers run TensorFlow with op determinism on"
    rng = np.random.default_rng(11)
    z, y = rng.normal(0, 8, size=(40, 5)).astype(dtype), rng.integers(0, 5, size=40)
    z[0], z[1] = [300, -300, 0, 1, 2], [-300, 300, 5, -5, 0]
    yt = tf.constant(y)
    ours = _graph_loss_and_grad(lambda zt: sparse_softmax_ce(yt, zt), z)
    theirs = _graph_loss_and_grad(lambda zt: tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yt, logits=zt), z)
    for a, b, what in zip(ours, theirs, ("loss", "gradient"), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=what)

    cw = tf.constant(CW + [2.0, 0.25], dtype)

    def torch_rule_with_gather(zt):  # the torch rule with the entry taken by gather, as TensorFlow would
        logp = tf.nn.log_softmax(zt, axis=-1)
        w = tf.gather(cw, yt)
        nll = -tf.gather(logp, yt, axis=1, batch_dims=1)
        total = 0.8 * tf.reduce_sum(w * nll) + (0.2 / 5) * tf.reduce_sum(-tf.reduce_sum(logp * cw, axis=-1))
        return total / tf.reduce_sum(w)

    ours = _graph_loss_and_grad(lambda zt: device_loss("softmax_ce", "mean", zt, yt, label_smoothing=0.2,
                                                       class_weights=CW + [2.0, 0.25], semantics="torch"), z)
    theirs = _graph_loss_and_grad(torch_rule_with_gather, z)
    for a, b, what in zip(ours, theirs, ("torch-rule loss", "torch-rule gradient"), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=what)


def test_the_two_softmax_rules_differ_exactly_by_the_weight_normaliser():
    rng = np.random.default_rng(1)
    z, y = rng.normal(size=(9, 3)), rng.integers(0, 3, size=9)
    keras_value, _ = _tf_loss(z, y, loss="softmax_ce", reduction="mean", class_weights=CW)
    torch_value, _ = _torch_loss(z, y, loss="softmax_ce", reduction="mean", class_weights=CW)
    np.testing.assert_allclose(keras_value / torch_value, np.asarray(CW)[y].sum() / len(y), rtol=1e-13)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_sigmoid_ce_from_logits_agrees_with_smoothing(reduction, smoothing):
    """torch has no label smoothing for BCE: torchref smooths the labels as Keras does, so the sides agree."""
    rng = np.random.default_rng(2)
    z, y = rng.normal(0, 3, size=(6, 2)), rng.uniform(size=(6, 2))
    opts = {"loss": "sigmoid_ce", "reduction": reduction, "label_smoothing": smoothing}
    (v_tf, g_tf), (v_torch, g_torch) = _tf_loss(z, y, **opts), _torch_loss(z, y, **opts)
    np.testing.assert_allclose([v_tf, v_torch], np_sigmoid_ce(z, y, reduction, smoothing), rtol=1e-13)
    np.testing.assert_allclose(g_tf, g_torch, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(g_tf, _numeric_grad(lambda zz: np_sigmoid_ce(zz, y, reduction, smoothing), z), rtol=1e-6, atol=1e-9)


def test_keras_recovers_logits_in_a_graph_and_clips_eagerly():
    """keras.ops.binary_crossentropy on probabilities: from a Sigmoid op in a tf.function it uses the
    logits (exact); on an eager tensor it clips p to [1e-7, 1 - 1e-7], capping the loss at -log(1e-7)."""
    import keras
    import tensorflow as tf

    z = tf.constant([[20.0], [-40.0], [3.0]], tf.float64)
    y = tf.constant([[0.0], [1.0], [1.0]], tf.float64)
    exact = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=z).numpy()
    graph = tf.function(lambda z, y: keras.ops.binary_crossentropy(y, tf.sigmoid(z)))(z, y).numpy()
    eager = keras.ops.binary_crossentropy(y, tf.sigmoid(z)).numpy()
    np.testing.assert_array_equal(graph, exact)
    # 20 and 40 become 16.118: p clipped to 1 - 1e-7 (y = 0) and to 1e-7 (y = 1)
    np.testing.assert_allclose(eager[:2], [[-np.log(1 - (1 - 1e-7))], [-np.log(1e-7)]], rtol=1e-14)
    np.testing.assert_allclose(eager[2], exact[2], rtol=1e-12)  # unsaturated: the same


def test_torch_bce_rule_in_tensorflow_matches_torch_on_the_same_probabilities():
    """Clamped logs (-100) and torch's backward (p - t) / max(p (1 - p), 1e-12 as a float)."""
    p = np.array([[1.0], [1 - 1e-14], [0.3], [1e-50], [0.0], [0.999]])
    t = np.array([[0.0], [0.0], [1.0], [1.0], [0.6], [0.2]])
    opts = {"loss": "sigmoid_ce", "reduction": "sum", "from_logits": False, "semantics": "torch"}
    (v_tf, g_tf), (v_torch, g_torch) = _tf_loss(p, t, **opts), _torch_loss(p, t, **opts)
    np.testing.assert_allclose(v_tf, v_torch, rtol=1e-14)
    np.testing.assert_allclose(g_tf, g_torch, rtol=1e-14)
    assert g_torch[0, 0] == pytest.approx(1 / float(np.float32(1e-12)), rel=1e-12)  # the float epsilon, measured
    with np.errstate(divide="ignore"):  # log(0) = -inf, which the clamp turns into -100
        want = -(t * np.maximum(np.log(p), -100) + (1 - t) * np.maximum(np.log1p(-p), -100)).sum()
    np.testing.assert_allclose(v_torch, want, rtol=1e-14)


# ---------------------------------------------------------------- the table of differences


@dataclass(frozen=True)
class Difference:
    """One difference: ``make(base, **changes)`` shows it between ``a`` and ``b``; ``mapped`` maps it away."""

    name: str
    base: dict[str, Any]
    changes: dict[str, Any]
    a: str
    b: str
    mapped: dict[str, Any]
    predicted: str  # a phrase of theory.predict's explanation
    note: str = field(default="")

    def case(self, **more: Any) -> Case:
        return make(self.base, **{**self.changes, **more})


PROBS = {"optimizer": SGD, "model__layers__1__activation": "sigmoid", "model__from_logits": False, "parallel__devices": 2}

DIFFERENCES = [
    Difference("moving variance: unbiased vs biased", CNN, {"parallel__batch_norm": "local", "parallel__devices": 4},
               "tf.towers", "torch.ddp", {"model__layers__1__semantics": "torch"}, "unbiased vs biased",
               "only state/*.moving_variance differs; training itself is identical"),
    Difference("local vs sync batch-norm statistics", CNN,
               {"parallel__batch_norm": "local", "parallel__devices": 4, "model__layers__1__semantics": "tf"},
               "torch.ddp", "torch.single", {"parallel__batch_norm": "sync"}, "local batch-norm statistics"),
    Difference("class-weight normalisation", SOFTMAX, {"optimizer": SGD, "model__class_weights": CW, "parallel__devices": 2},
               "tf.towers", "torch.ddp", {"model__loss_semantics": "tf"}, "class-weight normalisation"),
    Difference("per-device class-weight sums", SOFTMAX,
               {"optimizer": SGD, "model__class_weights": CW, "model__loss_semantics": "torch", "parallel__devices": 4},
               "torch.ddp", "torch.single", {"model__loss_semantics": "tf"}, "per-device weight sums"),
    Difference("label smoothing with class weights", SOFTMAX,
               {"optimizer": SGD, "model__class_weights": CW, "model__label_smoothing": 0.1, "parallel__devices": 2},
               "tf.towers", "torch.ddp", {"model__loss_semantics": "torch"}, "label smoothing with class weights"),
    Difference("probabilities: logits recovered vs clamped logs", MLP, {**PROBS, "init__stddev": 3.0},
               "tf.towers", "torch.ddp", {"model__loss_semantics": "tf"}, "probabilities",
               "saturated sigmoid (init stddev 3); unsaturated (stddev 0.5) the sides agree"),
]
_IDS = [d.name.split(":")[0].replace(" ", "-") for d in DIFFERENCES]


def _gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[str, float]:
    """The largest per-row normwise relative gap over the trajectory, and where."""
    gaps = {k: float(np.nanmax(relative_gap(np.atleast_1d(a[k]), np.atleast_1d(b[k])))) for k in a}
    worst = max(gaps, key=gaps.get)
    return worst, gaps[worst]


@pytest.fixture()
def _pool(pool):
    return pool


@pytest.mark.parametrize("diff", DIFFERENCES, ids=_IDS)
def test_difference_is_detected_and_predicted(_pool, diff):
    case = diff.case()
    ta, tb = run_impl(case, diff.a), run_impl(case, diff.b)
    result = compare_trajectories(ta, tb, rtol=RTOL, atol=ATOL)
    assert not result.ok, f"{diff.name}: no divergence found"
    p = predict(case.spec, diff.a, diff.b)
    assert any(diff.predicted in text for text in p.expected + p.known), (diff.name, p)


@pytest.mark.parametrize("diff", DIFFERENCES, ids=_IDS)
def test_mapping_agrees(_pool, diff):
    case = diff.case(**diff.mapped)
    assert_trajectories_close(run_impl(case, diff.a), run_impl(case, diff.b), rtol=RTOL, atol=ATOL)
    p = predict(case.spec, diff.a, diff.b)
    assert p.expected == () and not any(diff.predicted in k for k in p.known), p


def test_class_weight_gap_is_the_weight_normaliser_on_one_device(_pool):
    """One device, step 1: Keras' loss / torch's = sum_i w_{y_i} / B over the batch's labels."""
    case = make(SOFTMAX, optimizer=SGD, model__class_weights=CW, parallel__devices=1, steps=1)
    keras_side, torch_side = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    labels = case.y[: case.spec["data"]["global_batch"]]
    np.testing.assert_allclose(keras_side["loss"][0] / torch_side["loss"][0], np.asarray(CW)[labels].mean(), rtol=1e-12)


@pytest.mark.parametrize("smoothing_case", [
    {"model__label_smoothing": 0.1},
    {"model__label_smoothing": 0.1, "model__class_weights": [1.0, 1.0, 1.0]},
], ids=["smoothing", "smoothing-unit-weights"])
def test_label_smoothing_alone_agrees_natively(_pool, smoothing_case):
    case = make(SOFTMAX, optimizer=SGD, parallel__devices=2, **smoothing_case)
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)
    mlp = make(MLP, optimizer=SGD, parallel__devices=2, model__label_smoothing=0.2)
    assert_trajectories_close(run_impl(mlp, "tf.towers"), run_impl(mlp, "torch.ddp"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("semantics", ["native", "torch"])
def test_unsaturated_probabilities_agree(_pool, semantics):
    """Away from saturation the probability and logits formulas agree in float64 (a known, not expected, difference)."""
    case = make(MLP, **PROBS, init__stddev=0.5, model__loss_semantics=semantics)
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- validation


def _m(**extra):
    base = {"input_shape": [4], "layers": [{"type": "dense", "units": 3}], "loss": "softmax_ce"}
    return {**base, **extra}


_BAD = [
    ("weights-length", _m(class_weights=[1.0, 2.0]), r"model\.class_weights: expected a list of 3 positive numbers, one per class"),
    ("weights-zero", _m(class_weights=[1.0, 0.0, 2.0]), r"model\.class_weights\[1\]: expected a number > 0, got 0\.0"),
    ("weights-for-mse", _m(loss="mse", class_weights=[1.0, 1.0, 1.0]), r"model\.class_weights: expected null for mse"),
    ("smoothing-1", _m(label_smoothing=1.0), r"model\.label_smoothing: expected a number >= 0 and < 1, got 1\.0"),
    ("smoothing-mse", _m(loss="mse", label_smoothing=0.1), r"model\.label_smoothing: expected 0 for mse"),
    ("probs-softmax", _m(from_logits=False), r"model\.from_logits: expected true for softmax_ce"),
    ("probs-no-sigmoid", _m(loss="sigmoid_ce", from_logits=False),
     r"model\.from_logits: expected true, or a last layer with activation 'sigmoid' .*model\.layers\[0\] is a dense with activation 'none'"),
    ("from-logits-type", _m(from_logits="no"), r"model\.from_logits: expected true or false, got 'no'"),
    ("semantics", _m(loss_semantics="keras"), r"model\.loss_semantics: expected one of native, tf, torch, got 'keras'"),
    ("unknown-field", _m(sample_weights=[1.0]), r"model\.sample_weights: expected no such field"),
]


@pytest.mark.parametrize(("model", "message"), [b[1:] for b in _BAD], ids=[b[0] for b in _BAD])
def test_bad_loss_options_name_the_field(model, message):
    with pytest.raises(CaseError, match=message):
        validate_model(model)


def test_loss_defaults_are_filled_in():
    model = validate_model(_m())[0]
    assert {k: model[k] for k in ("from_logits", "label_smoothing", "class_weights", "loss_semantics")} == {
        "from_logits": True, "label_smoothing": 0.0, "class_weights": None, "loss_semantics": "native"}


# ---------------------------------------------------------------- the measured table (docs/layers.md)


def main() -> None:
    """Print the measured gaps of every row of DIFFERENCES as a markdown table."""
    print("| difference | compared | gap (largest, where) | mapped by | gap after mapping |")
    print("| --- | --- | --- | --- | --- |")
    for d in DIFFERENCES:
        case = d.case()
        key, gap = _gap(run_impl(case, d.a), run_impl(case, d.b))
        mapped = d.case(**d.mapped)
        key_m, gap_m = _gap(run_impl(mapped, d.a), run_impl(mapped, d.b))
        how = ", ".join(f"`{k.replace('__', '.')}: {v}`" for k, v in d.mapped.items())
        print(f"| {d.name} | {d.a} vs {d.b} | {gap:.3g} ({key}) | {how} | {gap_m:.2g} ({key_m}) |")
    extra = [("probabilities, unsaturated (init stddev 0.5), native", make(MLP, **PROBS, init__stddev=0.5)),
             ("probabilities, saturated, `loss_semantics: torch`", make(MLP, **PROBS, init__stddev=3.0, model__loss_semantics="torch"))]
    for label, case in extra:
        key, gap = _gap(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"))
        print(f"| {label} | tf.towers vs torch.ddp | {gap:.3g} ({key}) | | |")


if __name__ == "__main__":
    main()
