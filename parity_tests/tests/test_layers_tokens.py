"""The GPT input/output path: token inputs, ``embedding``, ``tied_logits``, per-token ``softmax_ce`` with ``ignore_label``.

Levels, as ``test_layers_vocabulary.py``:

* the case: fields, parameter names, integer ``x`` end to end, one-line refusals (an
  out-of-range id names ``data.x``; a shard without a labelled position names ``data.y``);
* direct, in this process: ``tfpar.tokens`` against Keras' ``Embedding`` and
  ``SparseCategoricalCrossentropy(ignore_class=)``, ``torchref.tokens`` against ``nn.Embedding`` and
  ``nn.CrossEntropyLoss(ignore_index=)``, and the two sides against each other (output and
  every gradient of a fixed random probe);
* Keras' sparse second moment: the premise on the installed Keras (Adam, RMSprop, Adagrad
  square an ``IndexedSlices`` per occurrence; closed form of Adam's first step), the formula
  optimizers and the combine keeping what they should; theory predicting it where, and only
  where, it is real;
* end to end: ``tf.towers`` vs ``torch.ddp`` at 2 devices in float64 on a tiny GPT
  (embedding, position embedding, pre-LN residual, tied logits, ignored label), every other
  engine, and the verdicts: ``expected_difference`` with a repeated id (named, mapped to parity),
  ``parity`` without one and with ``gradient: dense``.

Tolerances (float64): as ``test_layers_vocabulary.py``: one layer computed by two libraries
agrees to about 1e-15 relative per op; 1e-10 leaves five orders of magnitude for a few
layers and three steps, while the sparse second moment is O(lr) (Adagrad first step below:
about 4e-2) and the premises below are checked against their closed forms to 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.case import case_from_dict, with_changes
from parity_tests.contract.generators import draw_init
from parity_tests.contract.model import validate_model
from parity_tests.contract.specs import param_specs
from parity_tests.judging.compare import assert_trajectories_close
from parity_tests.judging.theory import mapping_changes, predict
from parity_tests.protocol.errors import CaseError
from parity_tests.running.harness import run_impl

RTOL, ATOL = 1e-10, 1e-12
V, D, T = 6, 3, 3


@pytest.fixture(autouse=True, scope="module")
def _tf_devices():
    """Configure TensorFlow's tower devices before the direct checks run their first op."""
    from parity_tests.running.backends import tf_device_count

    tf_device_count()


def _gpt(tied: bool = True, gradient: str = "native", vocab: int = V) -> list[dict]:
    """A pre-LN decoder without attention: embedding, position embedding, one residual MLP block, logits."""
    head = {"type": "tied_logits", "embedding": "0"} if tied else {"type": "dense", "units": vocab}
    return [{"type": "embedding", "input_dim": vocab, "output_dim": D, "gradient": gradient},
            {"type": "position_embedding", "length": T + 1},
            {"type": "residual", "body": [{"type": "layer_norm", "epsilon": 1e-5},
                                          {"type": "dense", "units": D, "activation": "gelu", "semantics": "torch"}]},
            {"type": "layer_norm", "epsilon": 1e-5}, head]


def _raw(layers: list[dict], *, optimizer: dict | None = None, devices: int = 2, batch: int = 4, steps: int = 3,
         ignore: int | None = None, data: dict | None = None, **parallel) -> dict:
    model = {"input_shape": [T], "layers": layers, "loss": "softmax_ce"}
    if ignore is not None:
        model["ignore_label"] = ignore
    return {"schema": "parity-case/1", "name": "tokens", "dtype": "float64", "model": model,
            "init": {"seed": 3, "stddev": 0.5}, "data": data or {"generator": "tokens", "seed": 5, "global_batch": batch},
            "optimizer": optimizer or {"name": "sgd", "lr": 0.5, "semantics": "torch"},
            "parallel": {"devices": devices, **parallel}, "steps": steps}


# ---------------------------------------------------------------- the case


def test_token_case_names_shapes_and_integer_inputs():
    case = case_from_dict(_raw(_gpt()))
    specs = param_specs([T], case.spec["model"]["layers"])
    assert [(s.name, s.shape) for s in specs][:2] == [("0.embeddings", (V, D)), ("1.embeddings", (T + 1, D))]
    assert "tied" not in " ".join(s.name for s in specs) and not any(s.name.startswith("4.") for s in specs)
    assert case.x.dtype == np.int64 and case.x.shape == (12, T) and case.y.shape == (12, T)
    assert case.x.min() >= 0 and case.x.max() < V
    np.testing.assert_array_equal(case.x[:, 1:], case.y[:, :-1])  # next-token task: y is x shifted by one
    assert validate_model(_raw(_gpt())["model"])[2] == (T, V)
    assert case.replace(**{"parallel.devices": 1}).x.dtype == np.int64  # re-validation keeps the ids
    # glorot: fans of a dense kernel [V, D]
    init = draw_init(specs, 0, "glorot_uniform", 0.0)
    assert np.max(np.abs(init["0.embeddings"])) <= np.sqrt(6 / (V + D))


def test_token_ids_from_npz_and_arrays(tmp_path):
    x = np.array([[0, 1, 2], [3, 4, 5]] * 2)
    y = np.roll(x, -1, axis=1)
    np.savez(tmp_path / "data.npz", x=x.astype(np.int32), y=y)
    raw = _raw(_gpt(), data={"npz": "data.npz", "global_batch": 2}, steps=2)
    case = case_from_dict(raw, tmp_path)
    assert case.x.dtype == np.int64
    np.testing.assert_array_equal(case.x, x)
    np.savez(tmp_path / "data.npz", x=x.astype(np.float64) + 0.5, y=y)
    with pytest.raises(CaseError) as e:
        case_from_dict(raw, tmp_path)
    assert e.value.field == "data.x" and "integer token ids" in str(e.value)


def test_plugins_receive_token_ids_as_integers():
    """An external model's integer x (token ids for a plugin's embedding) stays int64 up to ``run.dataset()``;
    float x still arrives in the case dtype."""
    from parity_tests.protocol.plugin_run import RunBase

    raw = {"schema": "parity-case/1", "name": "ext", "dtype": "float32", "model": {"external": "a plugin's GPT"},
           "init": {"arrays": True}, "data": {"arrays": True, "global_batch": 2},
           "optimizer": {"name": "sgd", "lr": 0.1}, "parallel": {"devices": 2}, "steps": 1}
    ids = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    for x, want in ((ids, np.int64), (ids.astype(np.float64), np.float32)):
        case = case_from_dict(raw, x=x, y=np.roll(ids, -1, axis=1), init={"e": np.zeros((6, 3))})
        got, labels = RunBase(case.payload()).dataset()
        assert got.dtype == want and labels.dtype == np.int64
        np.testing.assert_array_equal(got, ids)


def _bad(**changes):
    raw = _raw(_gpt(), data={"arrays": True, "global_batch": 2}, steps=1)
    x = changes.pop("x", np.array([[0, 1, 2], [3, 4, 5]]))
    y = changes.pop("y", np.array([[1, 2, 3], [4, 5, 0]]))
    return case_from_dict(with_changes(raw, **changes), x=x, y=y)


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"x": np.array([[0, 1, 2], [3, 4, V]])}, "data.x", f"token ids in [0, {V})"),
    ({"x": np.array([[0, -1, 2], [3, 4, 5]])}, "data.x", "input_dim"),
    ({"y": np.array([[1, 2, 3], [4, 5, V]])}, "data.y", f"class labels in [0, {V})"),
    ({"y": np.array([1, 2])}, "data.y", "per row and token"),
    ({"model.layers.4.embedding": "1"}, "model.layers[4].embedding", "path of an embedding layer"),
    ({"model.layers.3": {"type": "dense", "units": D + 1}}, "model.layers[4]", f"output_dim {D}"),
    ({"model.layers.1": {"type": "embedding", "input_dim": V, "output_dim": D}}, "model.layers[1].type", "only as model.layers[0]"),
    ({"model.layers.2.body.0": {"type": "tied_logits", "embedding": "0"}}, "model.layers[2].body[0].type", "top level"),
    ({"model.layers.0.gradient": "sparse"}, "model.layers[0].gradient", "native, dense"),
    ({"model.ignore_label": 2, "model.label_smoothing": 0.1}, "model.ignore_label", "one weighting"),
    ({"model.ignore_label": "x"}, "model.ignore_label", "integer"),
    ({"model.ignore_label": 1, "y": np.array([[1, 2, 3], [1, 1, 1]])}, "data.y", "step 1, device 1 of 2 has none"),
    ({"data.sample_weights": {"seed": 1}}, "data.sample_weights", "per-token"),
])
def test_bad_token_cases_are_refused_in_one_line(changes, field, words):
    with pytest.raises(CaseError) as e:
        _bad(**changes)
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ignored_labels_may_lie_outside_the_classes():
    """torch's default ignore_index is -100: a label the case accepts only as the ignored one."""
    case = _bad(**{"model.ignore_label": -100, "y": np.array([[1, -100, 3], [4, 5, -100]])})
    assert case.spec["model"]["ignore_label"] == -100
    with pytest.raises(CaseError):
        _bad(**{"model.ignore_label": -100, "y": np.array([[1, -99, 3], [4, 5, 0]])})


# ---------------------------------------------------------------- direct: each side is its framework's class


def _ids(rows: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, size=(rows, T))


def test_embedding_is_keras_embedding_with_its_sparse_gradient():
    import keras
    import tensorflow as tf

    from tfpar.tokens import embed

    table = np.random.default_rng(1).normal(size=(V, D))
    ids = _ids()
    layer = keras.layers.Embedding(V, D, dtype="float64")
    layer.build((None, T))
    layer.embeddings.assign(table)
    probe = np.random.default_rng(2).normal(size=(*ids.shape, D))
    outs = {}
    for name, fn in (("keras", lambda v: layer(ids)), ("native", lambda v: embed(tf.constant(ids), v, "native")),
                     ("dense", lambda v: embed(tf.constant(ids), v, "dense"))):
        var = layer.embeddings.value if name == "keras" else tf.Variable(table)
        with tf.GradientTape() as tape:
            out = fn(var)
            loss = tf.reduce_sum(out * probe)
        grad = tape.gradient(loss, layer.trainable_variables[0] if name == "keras" else var)
        outs[name] = (out.numpy(), grad)
    assert isinstance(outs["keras"][1], tf.IndexedSlices) and isinstance(outs["native"][1], tf.IndexedSlices)
    assert not isinstance(outs["dense"][1], tf.IndexedSlices)
    np.testing.assert_array_equal(outs["native"][0], outs["keras"][0])
    np.testing.assert_array_equal(outs["native"][1].indices.numpy(), outs["keras"][1].indices.numpy())  # one per occurrence
    assert len(outs["native"][1].indices) == ids.size
    np.testing.assert_allclose(tf.convert_to_tensor(outs["native"][1]).numpy(), outs["dense"][1].numpy(), rtol=1e-15)


def test_embedding_is_nn_embedding():
    import torch

    from torchref.tokens import embed

    table = np.random.default_rng(1).normal(size=(V, D))
    ids = torch.as_tensor(_ids())
    probe = torch.as_tensor(np.random.default_rng(2).normal(size=(*ids.shape, D)))
    module = torch.nn.Embedding(V, D, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(torch.as_tensor(table))
    ours = torch.tensor(table, requires_grad=True)
    (module(ids) * probe).sum().backward()
    (embed(ids, ours) * probe).sum().backward()
    assert torch.equal(embed(ids, ours), module(ids))
    assert torch.equal(ours.grad, module.weight.grad) and module.weight.grad.layout == torch.strided


def _both_sides(layers, params, ids):
    """Output and every parameter gradient of ``sum(out * R)``, TensorFlow and torch (canonical layouts)."""
    import tensorflow as tf
    import torch

    from tfpar.models import forward
    from torchref.models import CaseModel

    tparams = {k: tf.Variable(v) for k, v in params.items()}
    with tf.GradientTape() as tape:
        out = forward(layers, tparams, tf.constant(ids))
        probe = np.random.default_rng(7).normal(size=tuple(out.shape))
        loss = tf.reduce_sum(out * probe)
    grads = tape.gradient(loss, list(tparams.values()))
    tf_side = {"out": out.numpy(), **{f"grad/{k}": tf.convert_to_tensor(g).numpy() for k, g in zip(tparams, grads, strict=True)}}
    kinds = {k: type(g).__name__ for k, g in zip(tparams, grads, strict=True)}
    model = CaseModel(layers, params, torch.float64)
    tout = model(torch.as_tensor(ids))
    (tout * torch.as_tensor(probe)).sum().backward()
    torch_side = {"out": tout.detach().numpy(), **{f"grad/{k}": p.grad.numpy() for k, p in model.canonical().items()}}
    return tf_side, torch_side, kinds


@pytest.mark.parametrize("tied", [True, False])
def test_tf_equals_torch_on_a_tiny_gpt(tied):
    layers = validate_model(_raw(_gpt(tied))["model"])[0]["layers"]
    params = draw_init(param_specs([T], layers), 0, "normal", 0.5)
    tf_side, torch_side, kinds = _both_sides(layers, params, _ids())
    assert set(tf_side) == set(torch_side) == {"out", *(f"grad/{k}" for k in params)}
    for k in tf_side:
        np.testing.assert_allclose(tf_side[k], torch_side[k], rtol=RTOL, atol=ATOL, err_msg=k)
    # tied: TensorFlow adds the logits' dense gradient to the lookup's slices, which makes the sum dense
    assert kinds["0.embeddings"] == ("EagerTensor" if tied else "IndexedSlices")


def test_tied_logits_gradient_flows_from_both_uses():
    """Against the two uses computed apart: d/dE of sum((E[ids] ... ) @ E^T * R) = lookup part + logits part."""
    layers = validate_model({"input_shape": [T], "layers": [{"type": "embedding", "input_dim": V, "output_dim": D},
                                                            {"type": "tied_logits", "embedding": "0"}],
                             "loss": "softmax_ce"})[0]["layers"]
    table = np.random.default_rng(4).normal(size=(V, D))
    ids = _ids(2)
    tf_side, torch_side, _ = _both_sides(layers, {"0.embeddings": table}, ids)
    r = np.random.default_rng(7).normal(size=(2, T, V))
    h = table[ids]  # [2, T, D]
    want = np.einsum("btv,btd->vd", r, h)  # the logits' use: dL/dE = R^T h
    np.add.at(want, ids.reshape(-1), (r @ table).reshape(-1, D))  # the lookup's use: row ids gets R E
    np.testing.assert_allclose(tf_side["grad/0.embeddings"], want, rtol=1e-13)
    np.testing.assert_allclose(torch_side["grad/0.embeddings"], want, rtol=1e-13)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [None, 2, -100])
def test_per_token_cross_entropy_is_keras_and_torchs(reduction, ignore):
    import keras
    import tensorflow as tf
    import torch

    from tfpar.losses import device_loss
    from torchref.losses import shard_loss

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 4, V))
    labels = rng.integers(0, V, size=(3, 4))
    if ignore is not None:
        labels[0, :2] = labels[2, 3] = ignore
    tlog = tf.Variable(logits)
    with tf.GradientTape() as tape:
        ours = device_loss("softmax_ce", reduction, tlog, tf.constant(labels), ignore_label=ignore)
    g_ours = tape.gradient(ours, tlog).numpy()
    cls = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore, dtype="float64",
                                                     reduction="sum_over_batch_size" if reduction == "mean" else "sum")
    with tf.GradientTape() as tape:
        keras_value = cls(tf.constant(labels), tlog)
    g_keras = tape.gradient(keras_value, tlog).numpy()
    np.testing.assert_allclose(ours.numpy(), keras_value.numpy(), rtol=1e-14)
    np.testing.assert_allclose(g_ours, g_keras, rtol=1e-13, atol=1e-16)
    # torch: nn.CrossEntropyLoss on the sequence layout it documents ([N, C, T]), and torchref's flattened form
    tl = torch.tensor(logits, requires_grad=True)
    module = torch.nn.CrossEntropyLoss(ignore_index=-100 if ignore is None else ignore, reduction=reduction)
    ref = module(tl.permute(0, 2, 1), torch.as_tensor(labels))
    (g_ref,) = torch.autograd.grad(ref, tl)
    tl2 = torch.tensor(logits, requires_grad=True)
    mine = shard_loss("softmax_ce", reduction, tl2, torch.as_tensor(labels), ignore_label=ignore)
    mine.backward()
    np.testing.assert_allclose(mine.item(), ref.item(), rtol=1e-14)
    np.testing.assert_allclose(tl2.grad.numpy(), g_ref.numpy(), rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(ours.numpy(), mine.item(), rtol=1e-13)  # and the two sides agree
    if ignore is not None:
        valid = labels != ignore
        assert valid.sum() < labels.size  # the premise: positions really were excluded
        per = -np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))[valid, labels[valid]]
        np.testing.assert_allclose(ours.numpy(), per.mean() if reduction == "mean" else per.sum(), rtol=1e-13)


def test_a_shard_without_labels_is_nan_in_torch_and_zero_in_keras():
    """Why the case refuses it: the frameworks disagree (the refusal above names the step and device)."""
    import keras
    import tensorflow as tf
    import torch

    logits = np.random.default_rng(0).normal(size=(2, V))
    labels = np.array([1, 1])
    keras_value = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=1, dtype="float64")(
        tf.constant(labels), tf.constant(logits))
    assert keras_value.numpy() == 0.0
    assert np.isnan(torch.nn.functional.cross_entropy(torch.as_tensor(logits), torch.as_tensor(labels), ignore_index=1).item())


# ---------------------------------------------------------------- Keras' sparse second moment


#: first step from a zero state, per element of a row with slice gradients g_i (G = sum g_i, S = sum g_i^2):
#: the update is ``lr G / sqrt(c q + e)`` with q = S (Keras on IndexedSlices) or G^2 (dense); (c, e) per optimizer.
#: Adam with beta1 = beta2 = 1/2 (exact in float32, in which Keras' bias correction holds them) and epsilon 0:
#: m = G/2, v = q/2, alpha = lr sqrt(1/2) / (1/2), so lr G / sqrt(q). RMSprop (rho 0.9): v = 0.1 q, epsilon
#: inside the root; epsilon 1e-7, not 0: Keras' RMSprop raises InvalidArgumentError on duplicate indices with
#: epsilon exactly 0 (measured; docs/layers.md). Adagrad (initial accumulator 0): a = q, epsilon inside.
_FIRST_STEP = {"adam": (1.0, 0.0), "rmsprop": (0.1, 1e-7), "adagrad": (1.0, 1e-30)}


def _keras_step(name: str, grad, table: np.ndarray, lr: float) -> np.ndarray:
    import keras
    import tensorflow as tf

    eps = _FIRST_STEP[name][1]
    opt = {"adam": lambda: keras.optimizers.Adam(learning_rate=lr, beta_1=0.5, beta_2=0.5, epsilon=0.0),
           "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=lr, rho=0.9, epsilon=eps),
           "adagrad": lambda: keras.optimizers.Adagrad(learning_rate=lr, initial_accumulator_value=0.0, epsilon=eps)}[name]()
    var = tf.Variable(table)
    opt.apply_gradients([(grad, var)])
    return var.numpy()


@pytest.mark.parametrize("name", ["adam", "rmsprop", "adagrad"])
def test_keras_squares_indexed_slices_per_occurrence(name):
    """The premise, on the installed Keras: row 1 looked up twice with slice gradients a, b gets its second
    moment from a^2 + b^2, not (a + b)^2 (closed forms in ``_FIRST_STEP``)."""
    import tensorflow as tf

    lr = 0.125  # exact in float32, which Keras keeps learning_rate in
    table = np.zeros((3, 2))
    a, b = np.array([0.3, -0.2]), np.array([0.5, 0.6])
    grads = tf.IndexedSlices(tf.constant(np.stack([a, b])), tf.constant([1, 1]), tf.constant([3, 2]))
    sparse = _keras_step(name, grads, table, lr)
    dense = _keras_step(name, tf.convert_to_tensor(grads), table, lr)
    g, c, e = a + b, *_FIRST_STEP[name]
    np.testing.assert_allclose(-sparse[1], lr * g / np.sqrt(c * (a**2 + b**2) + e), rtol=1e-12)
    np.testing.assert_allclose(-dense[1], lr * g / np.sqrt(c * g**2 + e), rtol=1e-12)
    assert np.max(np.abs(sparse[1] - dense[1])) > 1e-2


@pytest.mark.parametrize("name", ["adam", "rmsprop", "adagrad", "momentum"])
def test_formula_optimizers_apply_the_summed_gradient(name):
    """tfpar's exact rules (semantics tf/torch) on an IndexedSlices give what they give on its dense sum
    (before, Adagrad's ``g * g`` raised TypeError on one)."""
    import tensorflow as tf

    from tfpar.optimizers import make_optimizer

    spec = {"name": name, "lr": 0.1, "semantics": "torch", "schedule": {"kind": "constant"}, "weight_decay": 0.0,
            "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "rho": 0.9, "momentum": 0.9, "centered": False,
            "initial_accumulator": 0.0}
    grads = tf.IndexedSlices(tf.constant([[0.3, -0.2], [0.5, 0.6]], tf.float64), tf.constant([1, 1]), tf.constant([3, 2]))
    out = []
    for g in (grads, tf.convert_to_tensor(grads)):
        opt, var = make_optimizer(spec), tf.Variable(np.ones((3, 2)))
        opt.build([var])
        opt.apply([g], [var])
        out.append(var.numpy())
    np.testing.assert_array_equal(out[0], out[1])


def test_tower_combine_concatenates_slices_as_tf_distribute_does():
    import tensorflow as tf

    from tfpar.combine import average_gradients

    def slices(rows, ids):
        return tf.IndexedSlices(tf.constant(rows, tf.float64), tf.constant(ids), tf.constant([4, 1]))

    g0, g1 = slices([[1.0], [2.0]], [0, 3]), slices([[4.0]], [3])
    (mean,) = average_gradients([[g0], [g1]])
    assert isinstance(mean, tf.IndexedSlices)
    np.testing.assert_array_equal(mean.indices.numpy(), [0, 3, 3])  # id 3 once per tower: a repeat to the optimizer
    np.testing.assert_array_equal(mean.values.numpy()[:, 0], [0.5, 1.0, 2.0])
    np.testing.assert_array_equal(tf.convert_to_tensor(mean).numpy()[:, 0], [0.5, 0, 0, 3.0])
    (one,) = average_gradients([[g0]])
    assert one is g0  # one device: Keras' optimizer gets the lookup's own slices
    (mixed,) = average_gradients([[g0], [tf.convert_to_tensor(g1)]])
    np.testing.assert_array_equal(mixed.numpy()[:, 0], [0.5, 0, 0, 3.0])


# ---------------------------------------------------------------- theory


def _arrays_case(x, *, layers=None, optimizer=None, devices=2, **parallel):
    y = (np.asarray(x) + 1) % V
    raw = _raw(layers or _gpt(tied=False), data={"arrays": True, "global_batch": 2}, steps=len(x) // 2,
               optimizer=optimizer or ADAGRAD, devices=devices, **parallel)
    return case_from_dict(raw, x=np.asarray(x), y=y)


#: Adagrad with epsilon 0 and float32-exact numbers: Keras' and torch's rules are then the same formula,
#: so the sparse second moment is the only difference theory can predict between the frameworks
ADAGRAD = {"name": "adagrad", "lr": 0.25, "initial_accumulator": 0.5, "epsilon": 0.0, "semantics": "native"}
REPEAT_ACROSS = [[0, 1, 2], [3, 4, 2]]  # id 2 once on each device: a repeat in the global batch only
NO_REPEAT = [[0, 1, 2], [3, 4, 5]]


def _sparse(pred) -> list[str]:
    return [t for t in pred.expected if "sparse embedding second moment" in t]


def test_sparse_moment_is_predicted_where_it_is_real():
    case = _arrays_case(REPEAT_ACROSS)
    for a, b in (("tf.towers", "torch.ddp"), ("tf.single", "torch.single"), ("tf.mirrored", "torch.ddp"),
                 ("tf.towers", "tf.v1")):
        (d,) = [d for d in predict(case.spec, a, b).differences if "sparse" in d.text]
        assert d.expected and not d.certain and d.mapping == "embedding_gradient" and d.stage == "update", (a, b)
        assert "global batch" in d.text and "model.layers.0" in d.text
    assert not _sparse(predict(case.spec, "tf.towers", "tf.single"))  # both Keras' class
    assert not _sparse(predict(case.spec, "torch.ddp", "tf.v1"))  # tf.compat.v1 deduplicates
    changes = mapping_changes("embedding_gradient", case.spec, "tf.towers", "torch.ddp")
    assert changes == {"model.layers.0.gradient": "dense"}
    assert mapping_changes("embedding_gradient", case.spec, "torch.ddp", "tf.towers") is None
    assert not _sparse(predict(case.replace(**changes).spec, "tf.towers", "torch.ddp"))


@pytest.mark.parametrize(("what", "build", "reason"), [
    ("no repeated id", lambda: _arrays_case(NO_REPEAT), "no token id repeats"),
    ("dense gradient", lambda: _arrays_case(REPEAT_ACROSS, layers=_gpt(tied=False, gradient="dense")), "dense"),
    ("tied embeddings", lambda: _arrays_case(REPEAT_ACROSS, layers=_gpt(tied=True)), "tied"),
    ("learning rate 0", lambda: _arrays_case(REPEAT_ACROSS, optimizer={**ADAGRAD, "lr": 0.0}), "no step moves"),
    ("param_mean, repeat across devices only", lambda: _arrays_case(REPEAT_ACROSS, combine="param_mean", period=1),
     "a device's shard"),
])
def test_sparse_moment_vanishes_with_its_condition(what, build, reason):
    pred = predict(build().spec, "tf.towers", "torch.ddp")
    assert not _sparse(pred), what
    assert any("sparse embedding second moment" in t and reason in t for t in pred.absent), pred.absent


def test_sparse_moment_needs_a_second_moment_optimizer():
    case = _arrays_case(REPEAT_ACROSS, optimizer={"name": "momentum", "lr": 0.25, "momentum": 0.5, "semantics": "native"})
    assert not _sparse(predict(case.spec, "tf.towers", "torch.ddp"))
    torch_rule = _arrays_case(REPEAT_ACROSS, optimizer={**ADAGRAD, "semantics": "torch"})  # the formula densifies
    assert not _sparse(predict(torch_rule.spec, "tf.towers", "torch.ddp"))


def test_param_mean_sees_a_repeat_within_a_shard():
    case = _arrays_case([[0, 1, 1], [3, 4, 5]], combine="param_mean", period=1)
    assert "a device's shard" in _sparse(predict(case.spec, "tf.towers", "torch.ddp"))[0]


SGD_TF = {"name": "sgd", "lr": 0.5, "semantics": "tf"}
SHARD_REPEAT = [[0, 1, 1], [3, 4, 5]]  # id 1 twice on device 0


def _clip_text(pred) -> list[str]:
    return [t for t in pred.expected if "sparse embedding clipping norm" in t]


def test_sparse_clipping_norm_is_predicted_where_it_is_real():
    """TensorFlow's global norm of an IndexedSlices is over its slices: after_combine sees the global batch's
    slices (tf.v1's classic average_gradients densifies them under grad_mean), per_device a shard's."""
    after = _arrays_case(REPEAT_ACROSS, optimizer=SGD_TF, clip={"global_norm": 0.05, "where": "after_combine"})
    for a, b in (("tf.towers", "torch.ddp"), ("tf.mirrored", "torch.ddp"), ("tf.towers", "tf.v1")):
        (d,) = [d for d in predict(after.spec, a, b).differences if "clipping norm" in d.text]
        assert d.expected and not d.certain and d.stage == "clip" and d.mapping == "embedding_gradient", (a, b)
    assert mapping_changes("embedding_gradient", after.spec, "tf.v1", "tf.towers") is None  # v1 clips the dense sum
    assert mapping_changes("embedding_gradient", after.spec, "tf.towers", "tf.v1") == {"model.layers.0.gradient": "dense"}
    per_device = after.replace(**{"parallel.clip": {"global_norm": 0.05, "where": "per_device"}})
    pred = predict(per_device.spec, "tf.towers", "torch.ddp")
    assert not _clip_text(pred) and any("clipping norm" in t and "a device's shard" in t for t in pred.absent)
    shard = _arrays_case(SHARD_REPEAT, optimizer=SGD_TF, clip={"global_norm": 0.05, "where": "per_device"})
    assert _clip_text(predict(shard.spec, "tf.towers", "torch.ddp"))
    assert not _clip_text(predict(shard.spec, "tf.towers", "tf.v1"))  # both clip each tower's slices
    torch_rule = after.replace(**{"optimizer.semantics": "torch"})  # torch's clipping densifies first
    assert not _clip_text(predict(torch_rule.spec, "tf.towers", "torch.ddp"))


def test_labelled_counts_are_predicted_between_n_devices_and_one():
    uneven = _bad(**{"model.ignore_label": 0, "y": np.array([[1, 2, 3], [4, 0, 0]])})
    even = _bad(**{"model.ignore_label": 0, "y": np.array([[1, 2, 0], [4, 0, 5]])})
    (d,) = predict(uneven.spec, "tf.towers", "tf.single").differences
    # not certain: a step whose shards hold equal counts has no gap (lockstep judges steps alone)
    assert "per-device labelled counts" in d.text and not d.certain and d.stage == "combined_grads"
    assert predict(uneven.spec, "tf.towers", "torch.ddp").differences == ()  # both average per-device means
    assert predict(even.spec, "torch.ddp", "torch.single").differences == ()


def _micro(y: np.ndarray, accumulate: int):
    """4 rows of 3 tokens on 2 devices, ignore_label 0, ``parallel.accumulate`` micro-batches per step."""
    raw = _raw(_gpt(), data={"arrays": True, "global_batch": 4}, steps=1)
    changes = {"model.ignore_label": 0, "parallel.devices": 2, "parallel.accumulate": accumulate}
    return case_from_dict(with_changes(raw, **changes), x=np.arange(12).reshape(4, 3) % V, y=y)


# labelled positions per row: 2, 1, 2, 1 (device 0 holds rows 0-1, device 1 rows 2-3)
MICRO_Y = np.array([[1, 2, 0], [3, 0, 0], [4, 5, 0], [1, 0, 0]])


def test_each_accumulated_micro_batch_needs_a_labelled_position():
    y = np.array([[1, 2, 3], [0, 0, 0], [4, 5, 1], [2, 3, 4]])
    assert _micro(y, 1).spec["parallel"]["accumulate"] == 1  # each device's whole shard has a label
    with pytest.raises(CaseError, match=r"micro-batch 2 of 2 of step 1, device 0 of 2 has none"):
        _micro(y, 2)


def test_labelled_counts_under_accumulation_weigh_positions_as_one_device_does():
    # one micro-batch: 3 labelled positions on each device, as one device's mean weighs them
    assert predict(_micro(MICRO_Y, 1).spec, "tf.towers", "tf.single").differences == ()
    # two: device r's micro-batches hold 2 and 1, one device's (rows 0-1, rows 2-3) 3 and 3
    (d,) = predict(_micro(MICRO_Y, 2).spec, "tf.towers", "tf.single").differences
    assert "per-device labelled counts" in d.text
    # every position labelled: equal weights again
    assert predict(_micro(np.arange(12).reshape(4, 3) % 5 + 1, 2).spec, "tf.towers", "tf.single").differences == ()


@pytest.mark.parametrize(("accumulate", "differ"), [(1, False), (2, True)])
def test_the_micro_batch_counts_prediction_is_what_the_engines_do(accumulate, differ):
    case = _micro(MICRO_Y, accumulate)
    towers, single = run_impl(case, "tf.towers"), run_impl(case, "tf.single")
    gap = max(float(np.max(np.abs(towers[k] - single[k]))) for k in towers if k.startswith("grad/"))
    assert (gap > 1e-6) == differ, gap  # float64: agreeing runs differ by rounding only (~1e-16)


# ---------------------------------------------------------------- end to end


@pytest.fixture()
def _pool(pool):
    return pool


def test_towers_equal_ddp_on_a_tiny_gpt(_pool):
    """Embedding, position embedding, residual pre-LN block, tied logits, an ignored label; SGD (exact rule)."""
    case = case_from_dict(_raw(_gpt(), ignore=0))
    assert (case.y == 0).any()
    tf_side, ddp = run_impl(case, "tf.towers"), run_impl(case, "torch.ddp")
    assert {k for k in tf_side if k.startswith("param/")} == {f"param/{s.name}" for s in param_specs([T], case.spec["model"]["layers"])}
    assert_trajectories_close(tf_side, ddp, rtol=RTOL, atol=ATOL)
    assert predict(case.spec, "tf.towers", "torch.ddp").differences == ()


@pytest.mark.parametrize(("impl", "ref"), [("tf.mirrored", "tf.towers"), ("tf.v1", "tf.towers"),
                                           ("tf.single", "torch.single")])
def test_every_engine_runs_the_token_path(_pool, impl, ref):
    """Untied (the sparse gradient through each engine's combine), an ignored label, per-token mean."""
    case = case_from_dict(_raw(_gpt(tied=False), ignore=0))
    assert_trajectories_close(run_impl(case, ref), run_impl(case, impl), rtol=RTOL, atol=ATOL)


def test_per_token_mean_combines_as_the_contract_says(_pool):
    """loss_mean with an ignored label (each device's mean over its labelled positions, averaged), and
    by_size weighting of uneven shards with label smoothing (tf.mirrored flattens the positions for
    compute_average_loss): tf.towers, tf.mirrored and torch.ddp agree."""
    loss_mean = case_from_dict(_raw(_gpt(tied=False), ignore=0, combine="loss_mean"))
    assert_trajectories_close(run_impl(loss_mean, "tf.towers"), run_impl(loss_mean, "torch.ddp"), rtol=RTOL, atol=ATOL)
    raw = _raw(_gpt(tied=False), batch=5, weighting="by_size")
    raw["model"]["label_smoothing"] = 0.1
    smoothed = case_from_dict(raw)
    ref = run_impl(smoothed, "tf.towers")
    for impl in ("tf.mirrored", "torch.ddp"):
        assert_trajectories_close(ref, run_impl(smoothed, impl), rtol=RTOL, atol=ATOL)


def test_lockstep_judges_labelled_counts_step_by_step(_pool):
    """Step 1's shards hold equal labelled counts, step 2's do not: judged alone, step 1 is parity (not an
    unexpected parity: the prediction is not certain) and step 2 the predicted difference."""
    from parity_tests.session.lockstep import lockstep_compare

    x = np.array([[0, 1, 2], [3, 4, 5]] * 2)
    y = np.array([[1, 0, 3], [4, 5, 0], [1, 2, 3], [0, 0, 5]])
    raw = _raw(_gpt(tied=False), ignore=0, data={"arrays": True, "global_batch": 2}, steps=2)
    case = case_from_dict(raw, x=x, y=y)
    (pair,) = lockstep_compare(case, ["tf.towers", "tf.single"], free=False, stages=False).pairs
    assert list(pair.step_status) == ["parity", "expected_difference"], pair.step_status


def test_sparse_clipping_norm_verdict(_pool):
    """SGD with after_combine clipping at 0.05 (reached): expected_difference, parity once mapped."""
    from parity_tests.session.comparison import compare_case

    case = _arrays_case(REPEAT_ACROSS, optimizer=SGD_TF, clip={"global_norm": 0.05, "where": "after_combine"})
    (pair,) = compare_case(case, ["tf.towers", "torch.ddp"]).pairs
    assert pair.verdict.status == "expected_difference", pair.verdict.detail
    assert "model.layers.0.gradient dense): parity" in pair.verdict.detail, pair.verdict.detail


@pytest.mark.parametrize(("x", "layers", "status"), [
    (REPEAT_ACROSS, _gpt(tied=False), "expected_difference"),
    (NO_REPEAT, _gpt(tied=False), "parity"),
    (REPEAT_ACROSS, _gpt(tied=False, gradient="dense"), "parity"),
])
def test_verdict_names_the_sparse_moment_and_maps_it(_pool, x, layers, status):
    from parity_tests.session.comparison import compare_case

    case = _arrays_case(x, layers=layers)
    (pair,) = compare_case(case, ["tf.towers", "torch.ddp"]).pairs
    assert pair.verdict.status == status, pair.verdict.detail
    if status == "expected_difference":
        assert _sparse(pair.prediction) and "sparse embedding second moment" in pair.verdict.detail
        assert "model.layers.0.gradient dense): parity" in pair.verdict.detail, pair.verdict.detail


def _gap(a: dict, b: dict, prefix: str = "") -> tuple[float, str]:
    """Largest per-key ``max |a - b| / max |b|`` over the shared keys starting with ``prefix``."""
    gaps = {k: float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(b[k])), 1e-300))
            for k in a if k in b and k.startswith(prefix) and np.asarray(a[k]).dtype.kind == "f"}
    where = max(gaps, key=gaps.get)
    return gaps[where], where


def main() -> None:
    """The figures of docs/layers.md "Token layers": direct gaps, then tf.towers vs torch.ddp (2 devices,
    float64, 3 steps, lr 0.25) with a repeated id, natively and with ``gradient: dense``."""
    from parity_tests.running.backends import tf_device_count
    from torchref.pool import shutdown_pool

    tf_device_count()
    print("| tiny GPT (probe) | largest gap TF vs torch (where) |\n| --- | --- |")
    for tied in (True, False):
        layers = validate_model(_raw(_gpt(tied))["model"])[0]["layers"]
        params = draw_init(param_specs([T], layers), 0, "normal", 0.5)
        a, b, _ = _both_sides(layers, params, _ids())
        gap, where = _gap(a, b)
        print(f"| {'tied' if tied else 'untied'} | {gap:.2g} ({where}) |")
    optimizers = {
        "Adam": {"name": "adam", "lr": 0.25, "semantics": "native"},
        "RMSprop": {"name": "rmsprop", "lr": 0.25, "semantics": "native"},
        "Adagrad (epsilon 0, initial accumulator 0.5)": ADAGRAD,
    }
    print("\n| optimizer | native | `gradient: dense` (and the optimizer mapped) |\n| --- | --- | --- |")
    try:
        for name, opt in optimizers.items():
            row = []
            for gradient in ("native", "dense"):
                case = _arrays_case(REPEAT_ACROSS * 3, layers=_gpt(tied=False, gradient=gradient), optimizer=opt)
                if gradient == "dense" and opt is not ADAGRAD:  # Adam's, RMSprop's epsilon placement mapped too
                    case = case.replace(**{"optimizer.semantics": "torch"})
                row.append(_gap(run_impl(case, "tf.towers"), run_impl(case, "torch.ddp"), "param/"))
            print(f"| {name} | {row[0][0]:.3g} ({row[0][1]}) | {row[1][0]:.2g} ({row[1][1]}) |")
    finally:
        shutdown_pool()


if __name__ == "__main__":
    main()
