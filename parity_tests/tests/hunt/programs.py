"""TensorFlow programs written the way users write them, for the error-rate hunt (issue 35, item 8).

The rewrites of ``tf_side.py`` are careful tower loops; the false alarms users met live
elsewhere: in Keras programs set up by the docs' recipe or by ``set_floatx`` alone, in
``model.fit`` under ``MirroredStrategy``, in TF1 ``tf.compat.v1.losses`` (which reduce in
float32 whatever the graph's dtype), and in loss terms the case cannot express. Each plugin
here honours the case within what :data:`parity_tests.tests.hunt.corpus.IMPLS` says it
runs, so a pair's right verdict is known by construction (``corpus.truth``):

* :func:`keras_fit` -- ``keras.config.set_floatx(run.dtype)`` and ``set_dtype_policy(run.dtype)``
  (docs/plugins.md's recipe), a ``Sequential`` of ``Dense`` layers, a Keras optimizer, and
  ``model.fit`` under ``MirroredStrategy(run.devices)``: one epoch of one step per optimizer step
  (the iterator runs on across epochs), the logged loss Keras' own. Keras keeps ``learning_rate``
  as a variable of floatx (float64 here) and rounds momentum and Adam's betas through float32
  (``corpus.Impl.rounded``). Even contiguous shards (``MirroredStrategy`` splits a global batch
  into equal contiguous slices), ``reduction: mean``, no clip, ``semantics: native``.
* :func:`keras_fit_floatx` -- the same with ``set_floatx`` alone, which works in a fresh
  interpreter (Keras makes its global policy from floatx at first use) and so must under the tool.
* :func:`keras_fit_l2` -- :func:`keras_fit` with ``kernel_regularizer=L2(L2)`` on every layer: a
  loss term the case cannot express. Its equivalent port is ``torch_side.ddp_l2``; a built-in
  trains without the term, so such a pair is never drawn against one.
* :func:`keras_fit_l2_user` -- :func:`keras_fit_l2` with the factor users write, ``L2(1e-3)``, which Keras
  holds as float32(1e-3) even in a float64 run (``L2.__call__`` casts it through float32): its port is
  ``torch_side.ddp_l2_user`` (``1e-3`` exact in float64). Drawn in float32 cases only, where both float32
  runs hold float32(1e-3) and the judge must read the constant from the run (``tfpar.keras_seen``) rather
  than take the float64 runs' 1e-9 for a bug; in a float64 case the programs do differ.
* :func:`v1_losses` -- a slim-style ``tf.compat.v1`` graph: clones under ``name_scope``, the loss
  from ``tf.compat.v1.losses`` (reduced in float32 even in a float64 graph: ``compute_weighted_loss``
  casts to float32), each clone's loss scaled by ``1/N`` and the clone gradients summed, a
  ``tf.compat.v1.train`` optimizer whose hyperparameters are given as tensors of the run's dtype
  (docs/plugins.md). Drawn in float32 cases only: its float64 run is not float64 throughout, which
  a float32 case must not take for a bug.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar
from parity_tests.tests.hunt.tf_side import keras_load, keras_optimizer

__all__ = ["L2", "L2_USER", "keras_fit", "keras_fit_floatx", "keras_fit_l2", "keras_fit_l2_user", "keras_fit_lr_high",
           "keras_fit_loss_over_n", "v1_losses"]

DTYPES = ("float32", "float64")

#: The programs' own L2 factor. A float32 number (2^-10, about 1e-3): Keras computes ``regularizers.L2`` with
#: its factor rounded through float32 even under floatx float64 (measured: 1e-3 moves a float64 run by 1e-9
#: relative against an exact port), a difference of its own that this family does not test; what it tests is
#: a loss term the case cannot express.
L2 = 2.0**-10
#: The factor users write (keras-io's examples use 1e-3 to 1e-4): not a float32 number, so Keras holds
#: float32(1e-3) in a float64 run (:func:`keras_fit_l2_user`).
L2_USER = 1e-3


def _keras_loss(name: str):
    import keras

    if name == "softmax_ce":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "sigmoid_ce":
        return keras.losses.BinaryCrossentropy(from_logits=True)
    return keras.losses.MeanSquaredError()


def _fit(run, policy: bool, l2: float | None, bug: str | None = None) -> None:
    """The keras-io distributed-training guide's program: compile under the strategy's scope, then ``fit``.

    ``bug``: a seeded bug (the hunt's :data:`corpus.BUG_PLUGINS`): ``lr_high``, the learning rate 1.001 times
    the case's; ``loss_over_n``, the loss divided by the replica count once more (Keras' ``fit`` already
    scales each replica's loss by 1/N: a user who also follows the custom-loop recipe divides twice).
    """
    import keras

    spec = run.spec
    model, opt = spec["model"], spec["optimizer"]
    keras.config.set_floatx(run.dtype)
    if policy:
        keras.config.set_dtype_policy(run.dtype)
    strategy = tf.distribute.MirroredStrategy(run.devices)
    regularizer = (lambda: keras.regularizers.L2(l2)) if l2 is not None else (lambda: None)
    with strategy.scope():
        net = keras.Sequential([keras.Input(shape=tuple(model["input_shape"]))] + [
            keras.layers.Dense(layer["units"], use_bias=layer.get("use_bias", True),
                               activation=None if layer.get("activation", "none") == "none" else layer["activation"],
                               kernel_regularizer=regularizer())
            for layer in model["layers"]])
        optimizer = keras_optimizer({**opt, "lr": opt["lr"] * 1.001} if bug == "lr_high" else opt)
        loss = _keras_loss(model["loss"])
        if bug == "loss_over_n":
            inner, n = loss, strategy.num_replicas_in_sync
            loss = lambda y, p: inner(y, p) / n  # noqa: E731 (the seeded bug)
        net.compile(optimizer=optimizer, loss=loss)
    named = keras_load(net, run.initial)
    batches = list(run.batches())
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(spec["data"]["global_batch"])

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            run.record(logs["loss"], named)

    run.begin(named)
    net.fit(data, epochs=run.steps, steps_per_epoch=1, shuffle=False, verbose=0, callbacks=[Record()])


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def keras_fit(run):
    """``model.fit`` under ``MirroredStrategy``, floatx and the dtype policy set by the docs' recipe."""
    _fit(run, policy=True, l2=None)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def keras_fit_floatx(run):
    """:func:`keras_fit` with ``keras.config.set_floatx`` alone (no ``set_dtype_policy``): enough in a fresh Python."""
    _fit(run, policy=False, l2=None)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def keras_fit_l2(run):
    """:func:`keras_fit` with an L2 kernel regularizer (factor :data:`L2`) on every layer."""
    _fit(run, policy=True, l2=L2)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def keras_fit_l2_user(run):
    """:func:`keras_fit` with ``kernel_regularizer=L2(1e-3)`` (:data:`L2_USER`) on every layer."""
    _fit(run, policy=True, l2=L2_USER)


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def keras_fit_lr_high(run):
    """Seeded bug: :func:`keras_fit` with the learning rate 1.001 times the case's."""
    _fit(run, policy=True, l2=None, bug="lr_high")


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def keras_fit_loss_over_n(run):
    """Seeded bug: :func:`keras_fit` with the loss divided by the replica count, which ``fit`` already does."""
    _fit(run, policy=True, l2=None, bug="loss_over_n")


def _v1_loss(name: str, labels, logits):
    losses = tf.compat.v1.losses
    if name == "softmax_ce":
        return losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    if name == "sigmoid_ce":
        return losses.sigmoid_cross_entropy(multi_class_labels=labels, logits=logits)
    return losses.mean_squared_error(labels=labels, predictions=logits)


def _v1_optimizer(opt: dict, dt):
    c = lambda v: tf.constant(v, dt)  # noqa: E731 (the docs' advice: hyperparameters as tensors of the run's dtype)
    train = tf.compat.v1.train
    if opt["name"] == "adam":
        return train.AdamOptimizer(c(opt["lr"]), beta1=c(opt["beta1"]), beta2=c(opt["beta2"]), epsilon=c(opt["epsilon"]))
    if opt["name"] == "momentum":
        return train.MomentumOptimizer(c(opt["lr"]), momentum=c(opt["momentum"]))
    return train.GradientDescentOptimizer(c(opt["lr"]))


@tfpar.plugin.tensorflow(dtypes=DTYPES)
def v1_losses(run):
    """A slim-style clone trainer: ``tf.compat.v1.losses`` per clone, clone losses scaled 1/N, gradients summed."""
    spec = run.spec
    model, opt = spec["model"], spec["optimizer"]
    n, batch = len(run.devices), spec["data"]["global_batch"]
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    ydt = tf.int64 if model["loss"] == "softmax_ce" else dt
    rows = np.array_split(np.arange(batch), n)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(dt, [batch, *model["input_shape"]])
        y = tf.compat.v1.placeholder(ydt, [batch] + ([] if model["loss"] == "softmax_ce" else [model["layers"][-1]["units"]]))
        w = {k: tf.compat.v1.get_variable(k.replace(".", "_"), initializer=tf.constant(v)) for k, v in run.initial.items()}
        keys = sorted(w)
        losses, grads = [], []
        for k, (d, r) in enumerate(zip(run.devices, rows, strict=True)):
            with tf.device(d), tf.compat.v1.name_scope(f"clone_{k}"):
                h = tf.gather(x, r)
                for i, layer in enumerate(model["layers"]):
                    h = h @ w[f"{i}.kernel"]
                    if layer.get("use_bias", True):
                        h = h + w[f"{i}.bias"]
                    act = layer.get("activation", "none")
                    h = {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid}.get(act, lambda v: v)(h)
                loss = _v1_loss(model["loss"], tf.gather(y, r), h)
                losses.append(loss)
                # slim's _gather_clone_loss divides by a Python float: the loss keeps its own dtype, which
                # tf.compat.v1.losses makes float32 even in a float64 graph
                scaled = loss / float(n) if n > 1 else loss
                grads.append(tf.gradients(scaled, [w[k] for k in keys]))
        summed = [tf.add_n([g[j] for g in grads]) for j in range(len(keys))]
        logged = tf.add_n(losses) / float(n)
        # made before the dependency below (slim makes its optimizer first): Adam's slot and beta-power variables
        # made inside it get initializers that wait on the logged loss, so global_variables_initializer() asked
        # for the input placeholder (InvalidArgumentError "You must feed a value for placeholder", the first
        # hunt's softmax_ce errors: all Adam cases)
        optimizer = _v1_optimizer(opt, dt)
        # the loss is read before the update (slim's create_train_op orders them so): without the dependency
        # a Session may run the variables' reads for the logged loss after the assignment
        with tf.control_dependencies([logged, *summed]):
            train_op = optimizer.apply_gradients(list(zip(summed, [w[k] for k in keys], strict=True)))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            run.begin(sess.run(w))
            for xb, yb in run.batches():
                value, _ = sess.run([logged, train_op], {x: xb, y: yb})
                run.record(value, sess.run(w))
