"""Layers (conv2d, max_pool2d, flatten, batch_norm, dropout): TensorFlow vs torch, and the batch-norm differences.

Two levels:

* direct checks in this process of ``tfpar.models.forward`` against
  ``torchref.models.CaseModel`` (forward and gradient of a fixed random probe
  ``sum(out * R)`` with respect to the input and every parameter), and of
  each against the framework's own layer (Keras' ``Conv2D``, ``MaxPooling2D``,
  ``BatchNormalization``; ``tf.nn.dropout``, ``F.dropout``) or a numpy oracle;
* end to end with ``run_impl``: the CNN case on ``tf.towers`` vs ``torch.ddp``
  at 1, 2, 4 devices, ``sync`` vs ``local`` batch norm, and the detected
  differences (moving variance unbiased vs biased; local vs sync statistics).
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.contract.generators import draw_init, dropout_masks
from parity_tests.contract.model import validate_model
from parity_tests.contract.specs import param_specs, same_padding, spatial_output
from parity_tests.judging.compare import assert_trajectories_close, compare_trajectories
from parity_tests.judging.theory import predict
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import CNN, make, set_path

# float64: the same layer computed by two libraries agrees to ~1e-15 relative per
# op (different summation orders in conv and reductions); 1e-10 leaves five orders
# of magnitude for a few layers and steps, while every semantic difference tested
# here (a padding row on the wrong side, n/(n-1), per-shard statistics) is >= 1e-7.
RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture(autouse=True, scope="module")
def _tf_devices():
    """Configure TensorFlow's tower devices before the direct checks run their first op."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()


def _layers(input_shape: list[int], layers: list[dict]) -> list[dict]:
    """Validated (normalised) layers, as both packages receive them."""
    return validate_model({"input_shape": input_shape, "layers": layers, "loss": "mse"})[0]["layers"]


def _probe(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


def _tf_run(layers, params, x, *, masks=None, state=None, batch_norm="local"):
    """Output, and gradients of sum(out * R) wrt the input and each parameter (TensorFlow)."""
    import tensorflow as tf

    from tfpar.models import forward

    tparams = {k: tf.Variable(v) for k, v in params.items()}
    tstate = None if state is None else {k: tf.Variable(v) for k, v in state.items()}
    tx = tf.Variable(x)
    tmasks = None if masks is None else {k: tf.constant(m) for k, m in masks.items()}
    with tf.GradientTape() as tape:
        out = forward(layers, tparams, tx, masks=tmasks, state=tstate, batch_norm=batch_norm)
        probe = tf.reduce_sum(out * _probe(tuple(out.shape)))
    grads = tape.gradient(probe, [tx, *tparams.values()])
    result = {"out": out.numpy(), "grad/x": grads[0].numpy()}
    result.update({f"grad/{k}": g.numpy() for k, g in zip(tparams, grads[1:], strict=True)})
    if tstate is not None:
        result.update({f"state/{k}": v.numpy() for k, v in tstate.items()})
    return result


def _torch_run(layers, params, x, *, masks=None, state=None, batch_norm="local"):
    """The same with torchref's CaseModel (canonical layouts in and out)."""
    import torch

    from torchref.models import CaseModel

    model = CaseModel(layers, {**params, **(state or {})}, torch.float64, batch_norm=batch_norm)
    tx = torch.tensor(x, requires_grad=True)
    tmasks = None if masks is None else {k: torch.as_tensor(m) for k, m in masks.items()}
    out = model(tx, tmasks)
    (out * torch.as_tensor(_probe(tuple(out.shape)))).sum().backward()
    result = {"out": out.detach().numpy(), "grad/x": tx.grad.numpy()}
    result.update({f"grad/{k}": p.grad.numpy() for k, p in model.canonical().items()})
    result.update({f"state/{k}": b.numpy() for k, b in model.state().items()})
    return result


def _assert_same(a: dict, b: dict, *, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert set(a) <= set(b), sorted(set(a) ^ set(b))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


# ---------------------------------------------------------------- conv2d and SAME padding


@pytest.mark.parametrize(("n", "k", "s"), [(5, 2, 2), (7, 4, 2), (7, 3, 1), (8, 3, 2), (9, 4, 3), (5, 1, 2), (6, 5, 2)])
def test_same_padding_and_output_size_are_tensorflows(n, k, s):
    """Pin specs.same_padding against TensorFlow itself: a k x 1 kernel of ones over an
    input of ones counts, at output row 0, the input rows the first window covers,
    which is k minus the rows padded before."""
    import tensorflow as tf

    from torchref.models import same_padding as torch_side

    out = tf.nn.conv2d(tf.ones([1, n, 1, 1], tf.float64), tf.ones([k, 1, 1, 1], tf.float64), [1, s, 1, 1], "SAME").numpy()
    assert out.shape[1] == spatial_output(n, k, s, "same")
    before, after = same_padding(n, k, s)
    assert k - out[0, 0, 0, 0] == before
    last_window_rows = n - ((out.shape[1] - 1) * s - before)  # rows left for the last window
    assert out[0, -1, 0, 0] == min(k, last_window_rows)
    assert (before, after) == torch_side(n, k, s)
    valid = tf.nn.conv2d(tf.ones([1, n, 1, 1], tf.float64), tf.ones([k, 1, 1, 1], tf.float64), [1, s, 1, 1], "VALID")
    assert valid.shape[1] == spatial_output(n, k, s, "valid")


@pytest.mark.parametrize(
    ("hw", "k", "s"),
    [((7, 5), 3, 2), ((8, 7), 4, 2), ((9, 9), 2, 2), ((6, 5), 5, 3), ((5, 5), 1, 2), ((7, 7), 3, 1)],
    ids=["7x5-k3-s2", "8x7-k4-s2", "9x9-k2-s2", "6x5-k5-s3", "5x5-k1-s2", "7x7-k3-s1"],
)
def test_conv2d_same_tf_equals_torch(hw, k, s):
    h, w = hw
    layers = _layers([h, w, 2], [{"type": "conv2d", "filters": 3, "kernel_size": k, "strides": s, "padding": "same", "activation": "tanh"}])
    rng = np.random.default_rng(1)
    params = {"0.kernel": rng.normal(size=(k, k, 2, 3)), "0.bias": rng.normal(size=(3,))}
    x = rng.normal(size=(2, h, w, 2))
    tf_side, torch_side = _tf_run(layers, params, x), _torch_run(layers, params, x)
    assert tf_side["out"].shape == (2, spatial_output(h, k, s, "same"), spatial_output(w, k, s, "same"), 3)
    _assert_same(tf_side, torch_side)


def test_symmetric_torch_padding_would_be_wrong():
    """7 rows, kernel 4, stride 2: TF pads 1 before and 2 after; torch's padding=1 or 2 cannot."""
    import tensorflow as tf
    import torch
    import torch.nn.functional as F

    assert same_padding(7, 4, 2) == (1, 2)
    rng = np.random.default_rng(2)
    x, kernel = rng.normal(size=(1, 7, 7, 1)), rng.normal(size=(4, 4, 1, 1))
    want = tf.nn.conv2d(x, kernel, [1, 2, 2, 1], "SAME").numpy()[0, :, :, 0]
    xt, kt = torch.as_tensor(x).permute(0, 3, 1, 2), torch.as_tensor(kernel).permute(3, 2, 0, 1)
    for pad in (1, 2):
        got = F.conv2d(xt, kt, stride=2, padding=pad)[0, 0].numpy()
        assert got.shape != want.shape or not np.allclose(got, want, rtol=1e-3)
    ours = F.conv2d(F.pad(xt, (1, 2, 1, 2)), kt, stride=2)[0, 0].numpy()
    np.testing.assert_allclose(ours, want, rtol=RTOL, atol=ATOL)


def test_conv2d_valid_tf_equals_torch_and_keras():
    import keras

    layers = _layers([9, 7, 3], [{"type": "conv2d", "filters": 2, "kernel_size": [3, 2], "strides": [2, 1], "activation": "relu"}])
    rng = np.random.default_rng(3)
    params = {"0.kernel": rng.normal(size=(3, 2, 3, 2)), "0.bias": rng.normal(size=(2,))}
    x = rng.normal(size=(3, 9, 7, 3))
    tf_side = _tf_run(layers, params, x)
    _assert_same(tf_side, _torch_run(layers, params, x))
    conv = keras.layers.Conv2D(2, (3, 2), strides=(2, 1), activation="relu", dtype="float64")
    conv.build((None, 9, 7, 3))
    conv.set_weights([params["0.kernel"], params["0.bias"]])
    np.testing.assert_allclose(tf_side["out"], np.asarray(conv(x)), rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------- max_pool2d


@pytest.mark.parametrize(("hw", "pool", "s"), [((7, 5), 3, 2), ((5, 5), 2, 2), ((6, 7), 3, 3), ((9, 8), 2, 1)])
def test_max_pool_same_tf_equals_torch(hw, pool, s):
    """All-negative inputs: a zero padding would win every edge window; -inf never does."""
    h, w = hw
    layers = _layers([h, w, 2], [{"type": "max_pool2d", "pool_size": pool, "strides": s, "padding": "same"}])
    x = -np.abs(np.random.default_rng(4).normal(size=(2, h, w, 2))) - 0.1
    tf_side, torch_side = _tf_run(layers, {}, x), _torch_run(layers, {}, x)
    _assert_same(tf_side, torch_side)
    assert np.all(tf_side["out"] < 0)  # no padded zero selected


def test_max_pool_zero_padding_would_be_wrong_and_keras_agrees():
    import keras
    import torch
    import torch.nn.functional as F

    x = -np.abs(np.random.default_rng(5).normal(size=(1, 7, 7, 1))) - 0.1
    layers = _layers([7, 7, 1], [{"type": "max_pool2d", "pool_size": 2, "padding": "same"}])
    ours = _tf_run(layers, {}, x)["out"]
    keras_out = np.asarray(keras.layers.MaxPooling2D(2, padding="same", dtype="float64")(x))
    np.testing.assert_array_equal(ours, keras_out)
    zero_padded = F.max_pool2d(F.pad(torch.as_tensor(x).permute(0, 3, 1, 2), (0, 1, 0, 1)), 2).permute(0, 2, 3, 1).numpy()
    assert zero_padded.shape == ours.shape and np.any(zero_padded != ours)


def test_max_pool_with_ties_routes_gradient_alike():
    """relu'd inputs tie at 0 in whole windows; both frameworks send the gradient to the same element."""
    layers = _layers([6, 6, 1], [{"type": "max_pool2d", "pool_size": 2, "padding": "same"}])
    x = np.maximum(np.random.default_rng(6).normal(size=(3, 6, 6, 1)), 0.0)
    x[0, :2, :2, 0] = 0.0  # one all-tied window for sure
    _assert_same(_tf_run(layers, {}, x), _torch_run(layers, {}, x))


# ---------------------------------------------------------------- flatten


def test_flatten_is_channels_last_on_both_sides():
    layers = _layers([3, 4, 5], [{"type": "flatten"}])
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    want = x.reshape(2, -1)  # numpy's row-major NHWC order: channels fastest
    tf_side, torch_side = _tf_run(layers, {}, x), _torch_run(layers, {}, x)
    np.testing.assert_array_equal(tf_side["out"], want)
    np.testing.assert_array_equal(torch_side["out"], want)
    assert not np.array_equal(x.transpose(0, 3, 1, 2).reshape(2, -1), want)  # torch's NCHW order differs
    _assert_same(tf_side, torch_side)


def test_dense_after_conv_flatten_tf_equals_torch():
    layers = _layers([5, 6, 2], [
        {"type": "conv2d", "filters": 3, "kernel_size": 3, "strides": 2, "padding": "same", "activation": "sigmoid"},
        {"type": "flatten"},
        {"type": "dense", "units": 4, "activation": "tanh"},
    ])
    rng = np.random.default_rng(7)
    params = {"0.kernel": rng.normal(size=(3, 3, 2, 3)), "0.bias": rng.normal(size=(3,)),
              "2.kernel": rng.normal(size=(3 * 3 * 3, 4)), "2.bias": rng.normal(size=(4,))}
    x = rng.normal(size=(4, 5, 6, 2))
    _assert_same(_tf_run(layers, params, x), _torch_run(layers, params, x))


# ---------------------------------------------------------------- batch_norm


def _bn_setup(shape, momentum=0.9, semantics="native", seed=8):
    layers = _layers(list(shape[1:]), [{"type": "batch_norm", "momentum": momentum, "epsilon": 1e-3, "semantics": semantics}])
    rng = np.random.default_rng(seed)
    c = shape[-1]
    params = {"0.gamma": rng.uniform(0.5, 1.5, size=c), "0.beta": rng.normal(size=c)}
    state = {"0.moving_mean": rng.normal(size=c), "0.moving_variance": rng.uniform(0.5, 2.0, size=c)}
    x = rng.normal(2.0, 3.0, size=shape)
    return layers, params, state, x


def test_batch_norm_tf_side_is_keras_and_uses_the_biased_variance():
    import keras

    layers, params, state, x = _bn_setup((6, 4, 3, 2), momentum=0.9)
    ours = _tf_run(layers, params, x, state=state)
    bn = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3, dtype="float64")
    bn.build((None, 4, 3, 2))
    bn.set_weights([params["0.gamma"], params["0.beta"], state["0.moving_mean"], state["0.moving_variance"]])
    out = np.asarray(bn(x, training=True))
    np.testing.assert_allclose(ours["out"], out, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ours["state/0.moving_mean"], np.asarray(bn.moving_mean), rtol=1e-14)
    np.testing.assert_allclose(ours["state/0.moving_variance"], np.asarray(bn.moving_variance), rtol=1e-14)
    # the numpy statement of Keras' update: biased variance (ddof=0)
    biased = x.reshape(-1, 2).var(axis=0, ddof=0)
    np.testing.assert_allclose(np.asarray(bn.moving_variance), 0.9 * state["0.moving_variance"] + 0.1 * biased, rtol=1e-13)


@pytest.mark.parametrize("semantics", ["native", "torch", "tf"])
def test_batch_norm_moving_variance_rules(semantics):
    """torch's F.batch_norm keeps n/(n-1) times the batch variance; 'tf' semantics the variance itself."""
    layers, params, state, x = _bn_setup((5, 3, 3, 2), semantics=semantics)
    tf_side, torch_side = _tf_run(layers, params, x, state=state), _torch_run(layers, params, x, state=state)
    n = 5 * 3 * 3
    biased = x.reshape(-1, 2).var(axis=0, ddof=0)
    keras_rule = 0.9 * state["0.moving_variance"] + 0.1 * biased
    torch_rule = 0.9 * state["0.moving_variance"] + 0.1 * biased * n / (n - 1)
    want_torch = keras_rule if semantics == "tf" else torch_rule
    want_tf = torch_rule if semantics == "torch" else keras_rule
    np.testing.assert_allclose(torch_side["state/0.moving_variance"], want_torch, rtol=1e-13)
    np.testing.assert_allclose(tf_side["state/0.moving_variance"], want_tf, rtol=1e-13)
    np.testing.assert_allclose(tf_side["state/0.moving_mean"], 0.9 * state["0.moving_mean"] + 0.1 * x.reshape(-1, 2).mean(0), rtol=1e-13)
    # the training-mode output and every gradient agree whatever the moving statistics do
    for k in ("out", "grad/x", "grad/0.gamma", "grad/0.beta", "state/0.moving_mean"):
        np.testing.assert_allclose(tf_side[k], torch_side[k], rtol=RTOL, atol=ATOL, err_msg=k)


@pytest.mark.parametrize("shape", [(7, 3), (4, 5, 3)], ids=["features", "sequence"])
def test_batch_norm_on_non_image_inputs_tf_equals_torch(shape):
    layers, params, state, x = _bn_setup(shape, semantics="torch")
    _assert_same(_tf_run(layers, params, x, state=state), _torch_run(layers, params, x, state=state))


@pytest.mark.parametrize("semantics", ["torch", "tf"])
def test_sync_formula_on_one_device_equals_local(semantics):
    """One device: the summed-moments formula (sync) equals the two-pass one (local) to rounding."""
    layers, params, state, x = _bn_setup((6, 3, 3, 2), semantics=semantics)
    for run in (_tf_run, _torch_run):
        _assert_same(run(layers, params, x, state=state, batch_norm="sync"), run(layers, params, x, state=state, batch_norm="local"))


# ---------------------------------------------------------------- dropout


def test_dropout_arithmetic_is_each_frameworks_own():
    """Given the mask their own dropout drew, our formulas reproduce tf.nn.dropout and F.dropout to the bit."""
    import tensorflow as tf
    import torch
    import torch.nn.functional as F

    rate = 0.3
    layers = _layers([50], [{"type": "dropout", "rate": rate}])
    x = np.random.default_rng(9).normal(size=(40, 50))
    tf_drop = tf.nn.experimental.stateless_dropout(tf.constant(x), rate, seed=[1, 2]).numpy()
    tf_mask = tf_drop != 0
    np.testing.assert_array_equal(_tf_run(layers, {}, x, masks={"0": tf_mask})["out"], tf_drop)
    torch.manual_seed(3)
    torch_drop = F.dropout(torch.as_tensor(x), rate, training=True).numpy()
    torch_mask = torch_drop != 0
    np.testing.assert_array_equal(_torch_run(layers, {}, x, masks={"0": torch_mask})["out"], torch_drop)
    # with one mask for both, the two sides agree (and keep 1/(1-rate) x)
    a, b = _tf_run(layers, {}, x, masks={"0": tf_mask}), _torch_run(layers, {}, x, masks={"0": tf_mask})
    _assert_same(a, b)
    np.testing.assert_allclose(a["out"], np.where(tf_mask, x / (1 - rate), 0.0), rtol=1e-15)


def test_dropout_masks_come_from_the_case_seed():
    case = make(CNN)
    masks = dropout_masks(case.spec)
    rows = case.spec["steps"] * case.spec["data"]["global_batch"]
    assert list(masks) == ["3"] and masks["3"].shape == (rows, 4, 4, 4) and masks["3"].dtype == bool
    # keep fraction: binomial, 4.5 standard deviations either side of 1 - rate
    m = masks["3"].size
    assert abs(masks["3"].mean() - 0.75) < 4.5 * np.sqrt(0.75 * 0.25 / m)
    np.testing.assert_array_equal(dropout_masks(make(CNN).spec)["3"], masks["3"])
    assert not np.array_equal(dropout_masks(make(CNN, seed=8).spec)["3"], masks["3"])
    assert np.array_equal(case.payload()["masks"]["3"], masks["3"])


def test_a_dropout_layer_without_its_mask_is_refused():
    layers = _layers([4], [{"type": "dropout", "rate": 0.5}])
    with pytest.raises(ValueError, match="layer 0: a dropout layer needs its keep-mask"):
        _tf_run(layers, {}, np.ones((2, 4)))
    with pytest.raises(ValueError, match="layer 0: a dropout layer needs its keep-mask"):
        _torch_run(layers, {}, np.ones((2, 4)))


# ---------------------------------------------------------------- one table of layer probes (docs/layers.md)


def _probe_case(name: str):
    """(layers, params, state, x, batch_norm) of a typical use of each layer."""
    rng = np.random.default_rng(len(name))
    x_img = rng.normal(size=(6, 9, 7, 3))
    if name.startswith("conv2d"):
        padding, s = ("same", 2) if "same" in name else ("valid", 1)
        layers = _layers([9, 7, 3], [{"type": "conv2d", "filters": 4, "kernel_size": 3, "strides": s, "padding": padding, "activation": "relu"}])
        return layers, {"0.kernel": rng.normal(size=(3, 3, 3, 4)), "0.bias": rng.normal(size=4)}, None, x_img, "local"
    if name.startswith("max_pool2d"):
        padding = "same" if "same" in name else "valid"
        return _layers([9, 7, 3], [{"type": "max_pool2d", "pool_size": 3, "strides": 2, "padding": padding}]), {}, None, x_img, "local"
    if name == "flatten -> dense":
        layers = _layers([9, 7, 3], [{"type": "flatten"}, {"type": "dense", "units": 5}])
        return layers, {"1.kernel": rng.normal(size=(189, 5)), "1.bias": rng.normal(size=5)}, None, x_img, "local"
    if name.startswith("batch_norm"):
        mode, semantics = name.split()[1:]
        layers, params, state, x = _bn_setup((6, 9, 7, 3), semantics=semantics)
        return layers, params, state, x, mode
    if name == "dropout":
        return _layers([9, 7, 3], [{"type": "dropout", "rate": 0.4}]), {}, None, x_img, "local"
    raise KeyError(name)


LAYER_PROBES = ["conv2d same s2", "conv2d valid", "max_pool2d same", "max_pool2d valid", "flatten -> dense",
                "batch_norm local torch", "batch_norm local tf", "batch_norm sync torch", "dropout"]


def _probe_gaps(name: str) -> dict[str, float]:
    layers, params, state, x, mode = _probe_case(name)
    masks = {"0": np.random.default_rng(1).random(size=x.shape) >= 0.4} if name == "dropout" else None
    a = _tf_run(layers, params, x, masks=masks, state=state, batch_norm=mode)
    b = _torch_run(layers, params, x, masks=masks, state=state, batch_norm=mode)
    return {k: float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-300)) for k in a}


@pytest.mark.parametrize("name", LAYER_PROBES)
def test_layer_probe_tf_equals_torch(name):
    gaps = _probe_gaps(name)
    assert max(gaps.values()) <= RTOL, gaps


# ---------------------------------------------------------------- end to end: the CNN case


@pytest.fixture()
def _pool(pool):
    return pool


@pytest.mark.parametrize("semantics", ["tf", "torch"])
@pytest.mark.parametrize("batch_norm", ["sync", "local"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_cnn_towers_equal_ddp(_pool, n, batch_norm, semantics):
    """Every layer's forward and gradient, the loss and the moving statistics, under the BN mapping."""
    case = make(CNN, parallel__devices=n, parallel__batch_norm=batch_norm, model__layers__1__semantics=semantics)
    tf_side, ddp = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    assert {k for k in tf_side if k.startswith("state/")} == {"state/1.moving_mean", "state/1.moving_variance"}
    assert_trajectories_close(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.towers", "torch.ddp").expected == ()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sync_batch_norm_equals_the_full_batch(_pool, n):
    """With sync statistics and equal shards, N devices compute the single-device full-batch run."""
    case = make(CNN, parallel__devices=n, parallel__batch_norm="sync", model__layers__1__semantics="tf")
    assert_trajectories_close(run_impl(case, "tf.towers"), run_impl(case, "tf.single"), rtol=RTOL, atol=ATOL)
    assert_trajectories_close(run_impl(case, "torch.ddp"), run_impl(case, "torch.single"), rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.towers", "tf.single").expected == ()


@pytest.mark.parametrize(("parallel_impl", "single_impl"), [("tf.towers", "tf.single"), ("torch.ddp", "torch.single")])
def test_local_batch_norm_differs_from_the_full_batch(_pool, parallel_impl, single_impl):
    case = make(CNN, parallel__devices=4, parallel__batch_norm="local", model__layers__1__semantics="tf")
    par, single = run_impl(case, parallel_impl), run_impl(case, single_impl)
    result = compare_trajectories(par, single, rtol=RTOL, atol=ATOL)
    assert not result.ok and (result.mismatch.key, result.mismatch.step) == ("loss", 1)
    assert any("local batch-norm statistics" in e for e in predict(case.spec, parallel_impl, single_impl).expected)


def test_local_batch_norm_keeps_device_0s_moving_statistics(_pool):
    """After step 1 the kept moving statistics are exactly those of a run on device 0's shard alone."""
    case = make(CNN, parallel__devices=4, parallel__batch_norm="local", model__layers__1__semantics="torch", steps=1)
    raw = set_path(set_path(case.spec, "data", {"arrays": True, "global_batch": 8}), "init", {"arrays": True})
    shard0 = case_from_dict(set_path(raw, "parallel.devices", 1), x=case.x[:8], y=case.y[:8], init=case.init)
    for par_impl, single_impl in (("tf.towers", "tf.single"), ("torch.ddp", "torch.single")):
        par, alone = run_impl(case, par_impl), run_impl(shard0, single_impl)
        for k in ("state/1.moving_mean", "state/1.moving_variance"):
            np.testing.assert_allclose(par[k], alone[k], rtol=RTOL, atol=ATOL, err_msg=f"{par_impl} {k}")


def test_moving_variance_unbiased_vs_biased_is_detected(_pool):
    """native: TF keeps the biased batch variance, torch n/(n-1) times it; nothing else differs."""
    n_dev = 4
    case = make(CNN, parallel__devices=n_dev, parallel__batch_norm="local")  # semantics native
    tf_side, ddp = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    result = compare_trajectories(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert not result.ok and (result.mismatch.key, result.mismatch.step) == ("state/1.moving_variance", 1)
    rest = {k: v for k, v in tf_side.items() if k != "state/1.moving_variance"}
    assert_trajectories_close(rest, {k: ddp[k] for k in rest}, rtol=RTOL, atol=ATOL)
    # the predicted gap: the increments (1-m) var' stand in the ratio n/(n-1), n = values per channel on device 0
    m, count = 0.9, (32 // n_dev) * 8 * 8
    prev = tf_side["state/1.moving_variance"][0]
    ratio = (ddp["state/1.moving_variance"][1] - m * prev) / (tf_side["state/1.moving_variance"][1] - m * prev)
    np.testing.assert_allclose(ratio, count / (count - 1), rtol=1e-8)
    assert any("unbiased vs biased" in e for e in predict(case.spec, "tf.towers", "torch.ddp").expected)


# ---------------------------------------------------------------- validation


def _model(layers, input_shape=(8, 8, 1), **extra):
    return {"input_shape": list(input_shape), "layers": layers, "loss": "mse", **extra}


_BAD = [
    ("conv-on-1d", _model([{"type": "conv2d", "filters": 2, "kernel_size": 3}], (5,)),
     r"model\.layers\[0\]: expected an image input \[height, width, channels\] for a conv2d layer; the input here has shape \[5\]"),
    ("conv-kernel-too-big", _model([{"type": "conv2d", "filters": 2, "kernel_size": 9}]),
     r"model\.layers\[0\]\.kernel_size: expected a kernel window that fits the input height 8 with padding 'valid'"),
    ("conv-kernel-3-numbers", _model([{"type": "conv2d", "filters": 2, "kernel_size": [3, 3, 1]}]),
     r"model\.layers\[0\]\.kernel_size: expected a positive integer or a list of two"),
    ("conv-missing-filters", _model([{"type": "conv2d", "kernel_size": 3}]), r"model\.layers\[0\]\.filters: expected a value"),
    ("conv-bad-padding", _model([{"type": "conv2d", "filters": 1, "kernel_size": 3, "padding": "full"}]),
     r"model\.layers\[0\]\.padding: expected one of valid, same, got 'full'"),
    ("conv-zero-stride", _model([{"type": "conv2d", "filters": 1, "kernel_size": 3, "strides": 0}]),
     r"model\.layers\[0\]\.strides: expected a positive integer"),
    ("pool-too-big", _model([{"type": "max_pool2d", "pool_size": [2, 9]}]),
     r"model\.layers\[0\]\.pool_size: expected a pooling window that fits the input width 8"),
    ("pool-on-flat", _model([{"type": "flatten"}, {"type": "max_pool2d"}]),
     r"model\.layers\[1\]: expected an image input .* the input here has shape \[64\]"),
    ("dense-on-scalar", _model([{"type": "dense", "units": 2}], ()),
     r"model\.layers\[0\]: expected an input with at least one axis for a dense layer \(it acts on the last axis\)"),
    ("bn-momentum", _model([{"type": "batch_norm", "momentum": 1.5}]), r"model\.layers\[0\]\.momentum: expected a number >= 0 and <= 1, got 1\.5"),
    ("bn-epsilon", _model([{"type": "batch_norm", "epsilon": 0}]), r"model\.layers\[0\]\.epsilon: expected a number > 0"),
    ("bn-semantics", _model([{"type": "batch_norm", "semantics": "keras"}]), r"model\.layers\[0\]\.semantics: expected one of native, tf, torch"),
    ("bn-on-scalar", _model([{"type": "batch_norm"}], ()), r"model\.layers\[0\]: expected an input with a channel \(last\) axis"),
    ("dropout-rate-1", _model([{"type": "dropout", "rate": 1.0}]), r"model\.layers\[0\]\.rate: expected a number >= 0 and < 1, got 1\.0"),
    ("dropout-extra", _model([{"type": "dropout", "rate": 0.1, "seed": 3}]), r"model\.layers\[0\]\.seed: expected no such field"),
    ("flatten-extra", _model([{"type": "flatten", "order": "nchw"}]), r"model\.layers\[0\]\.order: expected no such field"),
]


@pytest.mark.parametrize(("model", "message"), [b[1:] for b in _BAD], ids=[b[0] for b in _BAD])
def test_bad_layers_name_the_field(model, message):
    with pytest.raises(CaseError, match=message):
        validate_model(model)


def test_bad_parallel_batch_norm_and_image_generator_name_the_field():
    with pytest.raises(CaseError, match=r"parallel\.batch_norm: expected one of local, sync, got 'global'"):
        make(CNN, parallel__batch_norm="global")
    flat = set_path(set_path(CNN, "model.input_shape", [64]), "model.layers", [{"type": "dense", "units": 3}])
    with pytest.raises(CaseError, match=r"model\.input_shape: expected an image shape \[height, width, channels\] for data\.generator 'images', got \[64\]"):
        case_from_dict(flat)


def test_defaults_are_filled_in():
    spec = make(CNN).spec
    conv, bn, pool, drop = spec["model"]["layers"][:4]
    assert conv == {"type": "conv2d", "filters": 4, "kernel_size": [3, 3], "strides": [1, 1], "padding": "same",
                    "activation": "relu", "use_bias": True}
    assert bn == {"type": "batch_norm", "momentum": 0.9, "epsilon": 1e-3, "semantics": "native"}
    assert pool == {"type": "max_pool2d", "pool_size": [2, 2], "strides": [2, 2], "padding": "valid"}
    assert drop == {"type": "dropout", "rate": 0.25}
    assert "batch_norm" not in make(CNN, parallel={"devices": 2}).spec["parallel"]  # absent means local
    names = sorted(make(CNN).init)
    assert names == ["0.bias", "0.kernel", "1.beta", "1.gamma", "1.moving_mean", "1.moving_variance", "5.bias", "5.kernel"]
    assert make(CNN).init["0.kernel"].shape == (3, 3, 1, 4) and make(CNN).init["5.kernel"].shape == (64, 3)


def test_cnn_case_round_trips_through_case_json(tmp_path):
    from parity_tests.contract.case import load_case, write_case

    case = make(CNN)
    back = load_case(write_case(case, tmp_path))
    for key in ("model", "parallel", "seed", "steps"):
        assert back.spec[key] == case.spec[key], key
    np.testing.assert_array_equal(back.x, case.x)
    np.testing.assert_array_equal(back.payload()["masks"]["3"], case.payload()["masks"]["3"])


def main() -> None:
    """Print each layer probe's largest normwise relative gap, TF vs torch (docs/layers.md)."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()
    print("| layer (probe) | largest gap TF vs torch (where) |")
    print("| --- | --- |")
    for name in LAYER_PROBES:
        gaps = _probe_gaps(name)
        worst = max(gaps, key=gaps.get)
        print(f"| {name} | {gaps[worst]:.2g} ({worst}) |")


if __name__ == "__main__":
    main()


def test_a_conv_with_one_filter_trains_on_torch():
    """Found by the nested-architecture property: one filter on a 2x2x2 image, one row. The weight handed to
    ``F.conv2d`` was a permuted view of the canonical HWIO kernel, and torch's ``slow_conv2d`` (float64 on
    CPU) refused to backpropagate into it ("grad_weight must be contiguous"); it is contiguous now, as
    ``nn.Conv2d``'s weight is. Both sides must agree on it."""
    layers = _layers([2, 2, 2], [{"type": "conv2d", "filters": 1, "kernel_size": 2}, {"type": "flatten"},
                                 {"type": "dense", "units": 1}])
    params = draw_init(param_specs([2, 2, 2], layers), 0, "normal", 0.5)
    x = np.random.default_rng(0).normal(size=(1, 2, 2, 2))
    _assert_same(_tf_run(layers, params, x), _torch_run(layers, params, x))
