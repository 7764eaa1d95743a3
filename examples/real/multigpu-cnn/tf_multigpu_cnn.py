"""tfpar compare examples/real/multigpu-cnn/case.json --impls torch.ddp,examples/real/multigpu-cnn/tf_multigpu_cnn.py:multigpu_cnn

A port of aymericdamien/TensorFlow-Examples ``tensorflow_v1/examples/6_MultiGPU/multigpu_cnn.py``
(https://github.com/aymericdamien/TensorFlow-Examples, commit
3a767b1e712c386dfbb525589685cce569619953, the last commit to touch that file; snapshot HEAD
6dcbe14649163814e72a22a999f20c5e247ce988) as a tfpar TensorFlow plugin, checked against the
built-in ``torch.ddp`` (the model is one the case's layer list expresses). Line numbers are
those of that commit. The original is not copied here; each part below is written anew and
names the lines it follows.

The program: a ``tf.compat.v1`` graph on ``num_gpus`` towers. ``conv_net`` (lines 39-78):
``conv2d(64, 5, relu)``, ``max_pooling2d(2, 2)``, ``conv2d(256, 3, relu)``,
``conv2d(512, 3, relu)``, ``max_pooling2d(2, 2)``, ``flatten``, ``dense(2048)`` (no
activation), ``dropout(rate=dropout)``, ``dense(1024)``, ``dropout``, ``dense(10)``, all in
``variable_scope('ConvNet', reuse=reuse)``; ``dropout = 0.75`` is commented as the
probability to KEEP a unit (line 35) but passed as ``rate``, the probability to DROP one.
Per tower (lines 133-163): rows ``[i * batch_size, (i + 1) * batch_size)`` of the fed batch,
the training logits, a second evaluation graph on the same weights, the tower's mean
``softmax_cross_entropy_with_logits``, an ``AdamOptimizer(learning_rate=0.001)`` and its
``compute_gradients``; then the classic ``average_gradients`` (lines 81-104) and one
``apply_gradients`` (line 166). Each step runs ``train_op`` (line 183), then, to display,
``sess.run([loss_op, accuracy])`` on the same batch (lines 187-188).

What differs from the original, and why (marked ``tfpar:`` in the code):

* widths 64/256/512 and 2048/1024 -> the case's (4/8/8, 16/16), so the test runs in
  seconds; the architecture, activations and dropout rate are the program's;
* ``tf.layers.conv2d/max_pooling2d/dense/dropout`` and ``tf.contrib.layers.flatten`` are
  gone from TensorFlow 2.21 (``tf.compat.v1.layers`` needs Keras 2): the same layers are
  written with ``get_variable`` and ``tf.nn`` (VALID convolutions and pools, bias added,
  no activation on the dense layers, as ``tf.layers`` defaults);
* dropout applies the case's keep-masks (``run.dropout_masks``) with ``tf.nn.dropout``'s
  arithmetic instead of drawing them, so that the torch side drops the same units; in the
  original, the second (display) run draws new masks;
* the weights are the case's (``tf.layers``' default initialisers, Glorot uniform kernels
  and zero biases, are the case's ``glorot_uniform`` kind), assigned after the initialiser;
* towers run on ``run.devices[i]`` instead of ``/gpu:i``, without ``assign_to_device``
  (lines 110-120), which put variables on ``/cpu:0`` by op type: its list
  (``Variable``, ``VariableV2``, ``AutoReloadVariable``) no longer matches TensorFlow 2's
  resource variables (``VarHandleOp``), so it places nothing today; the batches are the case's
  (real 8x8 digits enlarged to 28x28), not ``mnist.train.next_batch``; one-hot labels are
  made from the case's integer labels; the placeholders have the case dtype
  (``tf.float32`` in the original);
* the display (every 10 steps) is recorded at every step; the accuracy is not.

Three entry points:

``multigpu_cnn``
    the program as written. It records what the program displays as the step's loss:
    ``loss_op`` after the loop is the LAST tower's loss, and it is evaluated after
    ``train_op``, on the updated weights.
``multigpu_cnn_mean_loss``
    the one line changed: the step's loss is the mean of the tower losses, fetched with
    ``train_op`` (before the update).
``multigpu_cnn_float64_adam``
    that, and ``AdamOptimizer``'s hyperparameters given as tensors of the case dtype:
    with Python floats ``tf.compat.v1.train.AdamOptimizer`` keeps lr, beta1, beta2,
    epsilon and beta^t in float32, even in a float64 graph.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

v1 = tf.compat.v1

# canonical names of the case -> the program's variables (the order tf.layers would name them)
NAMES = {"0": "conv2d", "2": "conv2d_1", "3": "conv2d_2", "6": "dense", "8": "dense_1", "10": "dense_2"}


# --------------------------------------------------------------------------------------------
# The program (multigpu_cnn.py), written anew from lines 39-188; changed parts marked "tfpar:".
# --------------------------------------------------------------------------------------------
def _layer_vars(scope, kernel_shape, dtype):
    with v1.variable_scope(scope):
        kernel = v1.get_variable("kernel", kernel_shape, dtype=dtype)
        bias = v1.get_variable("bias", kernel_shape[-1:], dtype=dtype, initializer=v1.zeros_initializer())
    return kernel, bias


def conv_net(x, n_classes, dropout, reuse, is_training, *, widths, keep=None, dtype=tf.float32):
    """Lines 39-78. ``x [n, 784]`` -> logits ``[n, n_classes]`` (softmax'd when not training).

    tfpar: changed: ``widths`` (conv, conv, conv, dense, dense) instead of 64, 256, 512, 2048,
    1024; ``tf.layers`` written out with ``tf.nn``; ``keep`` (two keep-masks ``[n, width]``)
    instead of drawn dropout masks; ``dtype`` instead of float32.
    """
    c1, c2, c3, d1, d2 = widths
    with v1.variable_scope("ConvNet", reuse=reuse):
        x = tf.reshape(x, shape=[-1, 28, 28, 1])
        k, b = _layer_vars("conv2d", [5, 5, 1, c1], dtype)
        x = tf.nn.relu(tf.nn.conv2d(x, k, 1, "VALID") + b)
        x = tf.nn.max_pool2d(x, 2, 2, "VALID")
        k, b = _layer_vars("conv2d_1", [3, 3, c1, c2], dtype)
        x = tf.nn.relu(tf.nn.conv2d(x, k, 1, "VALID") + b)
        k, b = _layer_vars("conv2d_2", [3, 3, c2, c3], dtype)
        x = tf.nn.relu(tf.nn.conv2d(x, k, 1, "VALID") + b)
        x = tf.nn.max_pool2d(x, 2, 2, "VALID")
        x = tf.reshape(x, [-1, int(np.prod(x.shape[1:]))])           # contrib.layers.flatten
        k, b = _layer_vars("dense", [x.shape[-1], d1], dtype)
        x = tf.matmul(x, k) + b
        if is_training:                                              # dropout(rate=dropout)
            x = tf.where(keep[0], x * (1 / (1 - dropout)), tf.zeros_like(x))
        k, b = _layer_vars("dense_1", [d1, d2], dtype)
        x = tf.matmul(x, k) + b
        if is_training:
            x = tf.where(keep[1], x * (1 / (1 - dropout)), tf.zeros_like(x))
        k, b = _layer_vars("dense_2", [d2, n_classes], dtype)
        out = tf.matmul(x, k) + b
        out = tf.nn.softmax(out) if not is_training else out
    return out


def average_gradients(tower_grads):
    """Lines 81-104: ``[towers][vars]`` (grad, var) -> ``[vars]``, the mean over the tower axis."""
    averaged = []
    for grad_and_vars in zip(*tower_grads, strict=True):
        stacked = tf.concat([tf.expand_dims(g, 0) for g, _ in grad_and_vars], 0)
        averaged.append((tf.reduce_mean(stacked, 0), grad_and_vars[0][1]))
    return averaged


def _build(run, *, float64_adam: bool):
    """Lines 124-166: the towers, the averaged gradients, one Adam update."""
    dt = tf.float64 if run.dtype == "float64" else tf.float32        # tfpar: changed (tf.float32)
    num_gpus = len(run.devices)                                      # tfpar: changed (2)
    batch_size = run.spec["data"]["global_batch"] // num_gpus        # tfpar: changed (1024 per GPU)
    layers = run.spec["model"]["layers"]
    widths = [layers[i]["filters"] for i in (0, 2, 3)] + [layers[i]["units"] for i in (6, 8)]  # tfpar: changed
    dropout, num_classes, learning_rate = layers[7]["rate"], 10, 0.001
    g = {}
    with tf.device("/cpu:0"):
        g["X"] = X = v1.placeholder(dt, [None, 784])
        g["Y"] = Y = v1.placeholder(dt, [None, num_classes])
        g["K"] = K = [v1.placeholder(tf.bool, [None, w]) for w in widths[3:]]  # tfpar: added (the masks)
        tower_grads, tower_losses, reuse_vars = [], [], False
        for i in range(num_gpus):
            with tf.device(run.devices[i]):                          # tfpar: changed ('/gpu:{}'.format(i))
                _x = X[i * batch_size:(i + 1) * batch_size]
                _y = Y[i * batch_size:(i + 1) * batch_size]
                _k = [k[i * batch_size:(i + 1) * batch_size] for k in K]
                logits_train = conv_net(_x, num_classes, dropout, reuse=reuse_vars, is_training=True,
                                        widths=widths, keep=_k, dtype=dt)
                logits_test = conv_net(_x, num_classes, dropout, reuse=True, is_training=False,
                                       widths=widths, dtype=dt)
                loss_op = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(logits=logits_train, labels=_y))
                if float64_adam:                                     # tfpar: the fix of the float64 variant
                    optimizer = v1.train.AdamOptimizer(
                        learning_rate=tf.constant(learning_rate, dt), beta1=tf.constant(0.9, dt),
                        beta2=tf.constant(0.999, dt), epsilon=tf.constant(1e-8, dt))
                else:
                    optimizer = v1.train.AdamOptimizer(learning_rate=learning_rate)
                grads = optimizer.compute_gradients(loss_op)
                if i == 0:
                    correct_pred = tf.equal(tf.argmax(logits_test, 1), tf.argmax(_y, 1))
                    g["accuracy"] = tf.reduce_mean(tf.cast(correct_pred, dt))
                reuse_vars = True
                tower_grads.append(grads)
                tower_losses.append(loss_op)                         # tfpar: added (for the mean-loss variant)
        g["grads_and_vars"] = average_gradients(tower_grads)
        g["train_op"] = optimizer.apply_gradients(g["grads_and_vars"])
        g["loss_op"] = loss_op                                       # the LAST tower's loss, as line 187 reads it
        g["mean_loss"] = tf.add_n(tower_losses) / num_gpus
    return g


# --------------------------------------------------------------------------------------------
# Glue: the case's weights in, the case's batches through, every step recorded.
# --------------------------------------------------------------------------------------------
def _train(run, *, displayed_loss: bool, float64_adam: bool) -> None:
    steps_rows = run.spec["data"]["global_batch"]
    with tf.Graph().as_default() as graph:
        # the initialisers draw (tf.layers' Glorot), and tfpar runs with op determinism on, which
        # refuses an unseeded random op; the draws are overwritten with the case's weights below
        v1.set_random_seed(run.seed)
        g = _build(run, float64_adam=float64_adam)
        variables = {v.op.name: v for v in v1.trainable_variables()}
        names = {f"{i}.{kind}": variables[f"ConvNet/{scope}/{kind}"] for i, scope in NAMES.items()
                 for kind in ("kernel", "bias")}
        assert len(variables) == len(names), sorted(variables)
        applied = {k: grad for grad, var in g["grads_and_vars"] for k, v in names.items() if v is var}
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            for name, var in names.items():
                var.load(run.initial[name], sess)

            def params():
                return sess.run(names)

            run.begin(params())
            for step, (x, y) in enumerate(run.batches()):
                rows = slice(step * steps_rows, (step + 1) * steps_rows)
                feed = {g["X"]: x.reshape(len(x), 784), g["Y"]: np.eye(10, dtype=x.dtype)[y],
                        g["K"][0]: run.dropout_masks[7][rows], g["K"][1]: run.dropout_masks[9][rows]}
                mean_loss, grads, _ = sess.run([g["mean_loss"], applied, g["train_op"]], feed)
                if displayed_loss:
                    loss = sess.run(g["loss_op"], feed)              # lines 187-188: after the update
                else:
                    loss = mean_loss                                 # tfpar: the fixed line
                run.record(loss, params(), grads=grads)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multigpu_cnn(run):
    """The program as written: the displayed loss is the last tower's, after the update."""
    _train(run, displayed_loss=True, float64_adam=False)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multigpu_cnn_mean_loss(run):
    """The displayed loss fixed: the mean of the tower losses, before the update."""
    _train(run, displayed_loss=False, float64_adam=False)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multigpu_cnn_float64_adam(run):
    """The loss fixed, and Adam's hyperparameters as tensors of the case dtype."""
    _train(run, displayed_loss=False, float64_adam=True)
