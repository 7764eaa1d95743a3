"""tfpar compare examples/real/custom-training-mirrored/case.json --impls examples/real/custom-training-mirrored/tf_custom_training.py:custom_training,examples/real/custom-training-mirrored/torch_ddp.py:ddp

A port of the tensorflow/docs tutorial "Custom training with tf.distribute.Strategy",
``site/en/tutorials/distribute/custom_training.ipynb``
(https://github.com/tensorflow/docs, commit d742984f9a720404d095e83eca091749667c34cd, the last
commit to touch that notebook; snapshot HEAD 7c3650212740204359d4ceae481abc79345541be) as a
tfpar TensorFlow plugin. Cells are numbered as in that commit's notebook (code and text
cells together, from 0). The notebook is not copied here; each part below is written anew
and names the cells it follows.

The program: ``strategy = tf.distribute.MirroredStrategy()`` (cell 10); global batch
``64 * num_replicas_in_sync`` (cell 13); ``create_model`` (cell 17): ``Conv2D(32, 3, relu)``,
``MaxPooling2D()``, ``Conv2D(64, 3, relu)``, ``MaxPooling2D()``, ``Flatten()``,
``Dense(64, relu)``, ``Dense(10)``, every kernel with ``regularizers.L2(1e-5)``;
``compute_loss`` (cell 21): ``SparseCategoricalCrossentropy(from_logits=True,
reduction=NONE)``, ``tf.nn.compute_average_loss(per_example_loss)`` plus
``tf.nn.scale_regularization_loss(tf.add_n(model_losses))``; the model and
``Adam(learning_rate=0.001)`` under ``strategy.scope()`` (cell 26); ``train_step``
(cell 27): tape, ``compute_loss``, ``apply_gradients``, accuracy; ``distributed_train_step``
(cell 28): ``strategy.run`` and ``strategy.reduce(SUM)``, a ``tf.function``.

What differs from the original, and why (marked ``tfpar:`` in the code):

* widths 32/64/64 -> the case's 4/4/8 (so the test runs in seconds);
* ``MirroredStrategy(devices=run.devices)``: the case's N towers (the notebook detects
  the GPUs; on a CPU-only machine that is one replica);
* the batches are the case's (real digits in [0, 1] for Fashion-MNIST), not
  ``Dataset.shuffle(...).batch(...)``; each replica gets its contiguous slice through
  ``experimental_distribute_values_from_function`` instead of
  ``experimental_distribute_dataset`` (whose per-device iterators can stall for minutes
  on a busy CPU: ``examples/byo/keras-mirrored``); the global batch is the case's;
* the layers are built with the case's weights (``model.build``, ``set_weights``; the
  notebook keeps Keras' random initialisation, which ``init.npz`` draws the same way);
* ``optimizer.build(model.trainable_variables)`` under the scope: as written, the
  notebook's first step fails on TensorFlow 2.21 / Keras 3.15 with two or more replicas
  (README.md);
* the program runs under ``keras.config.set_floatx(run.dtype)`` and
  ``keras.config.set_dtype_policy(run.dtype)`` (Keras 3 layers without ``dtype=`` compute
  in the global policy, float32 by default; ``set_floatx`` alone does not change a policy
  Keras has already made), both put back at the end;
* the epoch loop (cell 28) is one loop over the case's steps; test steps, checkpoints and
  printing are left out. The loss recorded per step is what the loop adds to
  ``total_loss``: the replicas' losses summed, L2 term included.
"""

from __future__ import annotations

import keras
import tensorflow as tf

import tfpar

KERAS_NAMES = ("conv1", "conv2", "dense1", "dense2")  # the model's kernel layers, in order


# --------------------------------------------------------------------------------------------
# The program (custom_training.ipynb cells 17-28), written anew; changed parts marked "tfpar:".
# --------------------------------------------------------------------------------------------
def create_model(widths):
    """Cell 17. tfpar: changed: ``widths`` (conv, conv, dense) instead of 32, 64, 64."""
    c1, c2, d1 = widths
    regularizer = tf.keras.regularizers.L2(1e-5)
    return tf.keras.Sequential([
        tf.keras.layers.Conv2D(c1, 3, activation="relu", kernel_regularizer=regularizer),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(c2, 3, activation="relu", kernel_regularizer=regularizer),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(d1, activation="relu", kernel_regularizer=regularizer),
        tf.keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])


def build_training(strategy, widths):
    """Cells 21, 24, 26, 27 and 28: loss, metrics, model, optimizer, the distributed step."""
    with strategy.scope():
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)          # [n_r]
            loss = tf.nn.compute_average_loss(per_example_loss)          # sum / (n_r * replicas)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))  # / replicas
            return loss

        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        model = create_model(widths)
        model.build((None, 28, 28, 1))                                   # tfpar: added (to load weights)
        optimizer = tf.keras.optimizers.Adam(learning_rate=0.001)
        # tfpar: added. Without it the notebook's first step fails on TF 2.21 / Keras 3.15 with 2 or
        # more replicas ("You must feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder'",
        # from Adam creating its slots inside the first tf.function call; keras-team/keras#19246)
        optimizer.build(model.trainable_variables)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        train_accuracy.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    return model, distributed_train_step


# --------------------------------------------------------------------------------------------
# Glue: the case's weights in, the case's batches through, every step recorded.
# --------------------------------------------------------------------------------------------
def _weights(model):
    """``{conv1.kernel: ..., conv1.bias: ..., ...}``: the model's variables under the case's names."""
    layers = [layer for layer in model.layers if layer.weights]
    return {f"{name}.{kind}": getattr(layer, kind) for name, layer in zip(KERAS_NAMES, layers, strict=True)
            for kind in ("kernel", "bias")}


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def custom_training(run):
    # Keras 3 layers without dtype= take the global dtype policy, which set_floatx alone does not
    # change once Keras has made it (any earlier layer in the process did): set both for the whole
    # run, as a script that starts with them would, and put both back at the end
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(run.dtype)                                      # tfpar: added (float64 runs)
    keras.config.set_dtype_policy(run.dtype)                                # tfpar: added
    try:
        _custom_training(run)
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def _custom_training(run):
    widths = (run.initial["conv1.kernel"].shape[-1], run.initial["conv2.kernel"].shape[-1],
              run.initial["dense1.kernel"].shape[-1])
    strategy = tf.distribute.MirroredStrategy(devices=run.devices)          # tfpar: changed (devices)
    model, distributed_train_step = build_training(strategy, widths)
    weights = _weights(model)
    for name, var in weights.items():
        var.assign(run.initial[name])

    def distribute(a):
        parts = tf.split(a, [len(p) for p in _split(len(a), strategy.num_replicas_in_sync)])
        return strategy.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])

    run.begin(weights)
    for x, y in run.batches():
        loss = distributed_train_step((distribute(tf.constant(x)), distribute(tf.constant(y))))
        run.record(loss, weights)


def _split(rows: int, n: int) -> list[range]:
    """Contiguous slices of ``rows`` over ``n`` replicas, the first ``rows mod n`` one longer."""
    q, r = divmod(rows, n)
    out, start = [], 0
    for i in range(n):
        size = q + (i < r)
        out.append(range(start, start + size))
        start += size
    return out
