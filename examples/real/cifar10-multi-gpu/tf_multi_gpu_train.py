"""tfpar compare examples/real/cifar10-multi-gpu/case.json --impls examples/real/cifar10-multi-gpu/torch_ddp.py:ddp,examples/real/cifar10-multi-gpu/tf_multi_gpu_train.py:multi_gpu_train

A port of the TensorFlow CIFAR-10 multi-GPU tutorial, tensorflow/models
``tutorials/image/cifar10/cifar10_multi_gpu_train.py`` (https://github.com/tensorflow/models,
commit 00e6186d761188f26b30637d06da680d64d50166) with the model and loss of
``tutorials/image/cifar10/cifar10.py`` (commit 05a434d67506f31dc8a83399ae3291b4aef75c34), as a
tfpar TensorFlow plugin. The originals are not copied here; each part below is written anew
and names the function of the original it follows.

The program: ``train`` (cifar10_multi_gpu_train.py) builds, in one ``tf.Graph`` on
``/cpu:0``: ``global_step``; ``lr = exponential_decay(0.1, global_step, decay_steps, 0.1,
staircase=True)``; ``GradientDescentOptimizer(lr)``; per GPU i, under ``name_scope('tower_i')``
and a reused variable scope, ``tower_loss``: ``cifar10.inference`` (conv1 5x5x3x64 SAME + bias + ReLU, max pool 3x3/2 SAME, LRN(4, 1, 0.001/9,
0.75), conv2 5x5x64x64, ReLU, LRN, max pool, local3 (384, ReLU), local4 (192, ReLU),
softmax_linear (10)), ``cifar10.loss`` (the mean sparse softmax cross-entropy added to
the collection ``losses``, where ``cifar10._variable_with_weight_decay`` put
``wd * l2_loss(W)`` for local3 and local4, wd 0.004, and 0 x l2_loss for the others), and
the tower's ``add_n`` of its own ``losses``; ``compute_gradients`` per tower;
``average_gradients``; ``apply_gradients(grads, global_step)``; an
``ExponentialMovingAverage(0.9999, global_step)`` of every trainable variable;
``train_op = tf.group(apply_gradient_op, variables_averages_op)``; every step
``sess.run([train_op, loss])``, where ``loss`` is the variable the tower loop
assigned last: the LAST tower's total loss.

What differs from the original, and why (marked ``tfpar:`` in the code):

* the widths 64/384/192 and the 24x24 crops -> the case's 4/8/8 and 8x8 (seconds, not
  minutes); the layer kinds, initialisers, LRN and pooling are the program's;
* the input pipeline (``distorted_inputs``: random crops, flips, brightness, contrast,
  per-image standardisation, then a prefetch queue dequeued once per tower) -> the case's
  rows, tower i reading rows ``[i b, (i + 1) b)`` of each global batch through a
  placeholder; ``FLAGS.batch_size`` is the case's global batch over the tower count;
* towers on ``run.devices[i]`` instead of ``/gpu:i``; variables in the case dtype
  (``tf.float32`` in the original, ``tf.float16`` with ``--use_fp16``);
* the variables (and the moving averages' shadows, which start from them) are loaded
  with the case's weights after the initialiser runs;
* summaries, the saver, logging every 10 steps and the NaN assertion are left out; the
  loss the program prints is recorded at every step; the shadows are recorded as state.

Four entry points (README.md says what each establishes):

``multi_gpu_train``
    the program as written.
``multi_gpu_train_mean_loss``
    the step's loss is the mean of the tower losses (what the update descends).
``multi_gpu_train_mean_loss_float64_lr``
    that, and the learning-rate schedule in the case dtype: ``exponential_decay`` makes a
    float32 tensor of the Python float 0.1.
``multi_gpu_train_fixed``
    that, and the moving averages taken after the update: ``variables_averages_op`` built
    under ``tf.control_dependencies([apply_gradient_op])``, as ``ExponentialMovingAverage``'s
    documentation prescribes; the original groups the two ops with no order between them.
"""

from __future__ import annotations

import tensorflow as tf

import tfpar

v1 = tf.compat.v1

TOWER_NAME = "tower"
MOVING_AVERAGE_DECAY = 0.9999
NUM_EPOCHS_PER_DECAY, LEARNING_RATE_DECAY_FACTOR, INITIAL_LEARNING_RATE = 350.0, 0.1, 0.1
NUM_EXAMPLES_PER_EPOCH_FOR_TRAIN = 50000
LAYERS = ("conv1", "conv2", "local3", "local4", "softmax_linear")


# --------------------------------------------------------------------------------------------
# cifar10.py, written anew (_variable_on_cpu to loss); changed parts marked "tfpar:".
# --------------------------------------------------------------------------------------------
def _variable_on_cpu(name, shape, initializer, dtype):
    with tf.device("/cpu:0"):
        return v1.get_variable(name, shape, initializer=initializer, dtype=dtype)


def _variable_with_weight_decay(name, shape, stddev, wd, dtype):
    var = _variable_on_cpu(name, shape, v1.truncated_normal_initializer(stddev=stddev, dtype=dtype), dtype)
    if wd is not None:                                        # wd=0.0 still adds a (zero) term
        v1.add_to_collection("losses", tf.multiply(tf.nn.l2_loss(var), wd, name="weight_loss"))
    return var


def lrn_formula(x, depth_radius, bias, alpha, beta, name=None):
    """``tf.nn.lrn`` written out (its kernel has no float64): ``x / (bias + alpha sum_window x^2)^beta``.

    The window is channels ``c - r .. c + r`` (clipped at the ends: zero padding adds nothing).
    """
    c = x.shape[-1]
    sq = tf.pad(tf.square(x), [[0, 0], [0, 0], [0, 0], [depth_radius, depth_radius]])
    window = tf.add_n([sq[..., i:i + c] for i in range(2 * depth_radius + 1)])
    return tf.divide(x, (bias + alpha * window) ** beta, name=name)


def inference(images, *, batch_size, widths, dtype, lrn=tf.nn.lrn):
    """cifar10.py ``inference``. tfpar: changed: ``widths`` (conv, local3, local4) for 64, 384, 192;
    ``lrn``: ``tf.nn.lrn``, or :func:`lrn_formula` for a float64 run."""
    conv_w, w3, w4 = widths
    with v1.variable_scope("conv1") as scope:
        kernel = _variable_with_weight_decay("weights", [5, 5, 3, conv_w], 5e-2, 0.0, dtype)
        conv = tf.nn.conv2d(images, kernel, [1, 1, 1, 1], padding="SAME")
        biases = _variable_on_cpu("biases", [conv_w], v1.constant_initializer(0.0), dtype)
        conv1 = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
    pool1 = tf.nn.max_pool2d(conv1, [1, 3, 3, 1], [1, 2, 2, 1], "SAME", name="pool1")
    norm1 = lrn(pool1, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm1")
    with v1.variable_scope("conv2") as scope:
        kernel = _variable_with_weight_decay("weights", [5, 5, conv_w, conv_w], 5e-2, 0.0, dtype)
        conv = tf.nn.conv2d(norm1, kernel, [1, 1, 1, 1], padding="SAME")
        biases = _variable_on_cpu("biases", [conv_w], v1.constant_initializer(0.1), dtype)
        conv2 = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
    norm2 = lrn(conv2, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm2")
    pool2 = tf.nn.max_pool2d(norm2, [1, 3, 3, 1], [1, 2, 2, 1], "SAME", name="pool2")
    with v1.variable_scope("local3") as scope:
        reshape = tf.reshape(pool2, [batch_size, -1])
        dim = reshape.shape[1]
        weights = _variable_with_weight_decay("weights", [dim, w3], 0.04, 0.004, dtype)
        biases = _variable_on_cpu("biases", [w3], v1.constant_initializer(0.1), dtype)
        local3 = tf.nn.relu(tf.matmul(reshape, weights) + biases, name=scope.name)
    with v1.variable_scope("local4") as scope:
        weights = _variable_with_weight_decay("weights", [w3, w4], 0.04, 0.004, dtype)
        biases = _variable_on_cpu("biases", [w4], v1.constant_initializer(0.1), dtype)
        local4 = tf.nn.relu(tf.matmul(local3, weights) + biases, name=scope.name)
    with v1.variable_scope("softmax_linear") as scope:
        weights = _variable_with_weight_decay("weights", [w4, 10], 1 / 192.0, 0.0, dtype)
        biases = _variable_on_cpu("biases", [10], v1.constant_initializer(0.0), dtype)
        softmax_linear = tf.add(tf.matmul(local4, weights), biases, name=scope.name)
    return softmax_linear


def loss(logits, labels):
    """cifar10.py ``loss``: the mean cross-entropy joins the ``losses`` collection."""
    labels = tf.cast(labels, tf.int64)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    v1.add_to_collection("losses", tf.reduce_mean(cross_entropy, name="cross_entropy"))
    return tf.add_n(v1.get_collection("losses"), name="total_loss")


# --------------------------------------------------------------------------------------------
# cifar10_multi_gpu_train.py, written anew (tower_loss to the step loop); changed parts marked "tfpar:".
# --------------------------------------------------------------------------------------------
def tower_loss(scope, images, labels, **model):
    """``tower_loss``: this tower's own ``losses`` (its cross-entropy and its weight-decay terms), summed."""
    logits = inference(images, **model)
    _ = loss(logits, labels)
    losses = v1.get_collection("losses", scope)
    return tf.add_n(losses, name="total_loss")


def average_gradients(tower_grads):
    """``average_gradients``: ``[towers][vars]`` (grad, var) -> ``[vars]``, the mean over the tower axis."""
    averaged = []
    for grad_and_vars in zip(*tower_grads, strict=True):
        stacked = tf.concat(axis=0, values=[tf.expand_dims(g, 0) for g, _ in grad_and_vars])
        averaged.append((tf.reduce_mean(stacked, 0), grad_and_vars[0][1]))
    return averaged


def build_train(run, *, float64_lr: bool, ema_after_update: bool, lrn_in_ops: bool):
    """``train`` up to ``train_op`` (and the feed that stands for the input queue)."""
    dt = tf.float64 if run.dtype == "float64" else tf.float32        # tfpar: changed (float32)
    num_gpus = len(run.devices)                                      # tfpar: changed (FLAGS.num_gpus)
    batch_size = run.spec["data"]["global_batch"] // num_gpus        # tfpar: changed (FLAGS.batch_size)
    widths = (run.initial["conv1.weights"].shape[-1], run.initial["local3.weights"].shape[-1],
              run.initial["local4.weights"].shape[-1])               # tfpar: added
    size = run.spec["model"]["input_shape"][0]
    g = {}
    with tf.device("/cpu:0"):
        global_step = v1.get_variable("global_step", [], initializer=v1.constant_initializer(0),
                                      trainable=False)               # float32, as in the original
        num_batches_per_epoch = NUM_EXAMPLES_PER_EPOCH_FOR_TRAIN / batch_size
        decay_steps = int(num_batches_per_epoch * NUM_EPOCHS_PER_DECAY)
        initial_lr = tf.constant(INITIAL_LEARNING_RATE, dt) if float64_lr else INITIAL_LEARNING_RATE  # tfpar: fix 2
        lr = v1.train.exponential_decay(initial_lr, global_step, decay_steps, LEARNING_RATE_DECAY_FACTOR,
                                        staircase=True)
        opt = v1.train.GradientDescentOptimizer(lr)
        # tfpar: the queue -> a feed of the global batch (static shapes, as the queue's: local3's
        # reshape to [batch_size, -1] needs them)
        g["images"] = images = v1.placeholder(dt, [num_gpus * batch_size, size, size, 3])
        g["labels"] = labels = v1.placeholder(tf.int64, [num_gpus * batch_size])
        tower_grads, tower_losses = [], []
        with v1.variable_scope(v1.get_variable_scope()):
            for i in range(num_gpus):
                with tf.device(run.devices[i]):                      # tfpar: changed ('/gpu:%d' % i)
                    with tf.name_scope(f"{TOWER_NAME}_{i}") as scope:
                        image_batch = images[i * batch_size:(i + 1) * batch_size]   # tfpar: the dequeue
                        label_batch = labels[i * batch_size:(i + 1) * batch_size]
                        loss_ = tower_loss(scope, image_batch, label_batch, batch_size=batch_size,
                                           widths=widths, dtype=dt, lrn=lrn_formula if lrn_in_ops else tf.nn.lrn)
                        v1.get_variable_scope().reuse_variables()
                        tower_grads.append(opt.compute_gradients(loss_))
                        tower_losses.append(loss_)
        g["grads_and_vars"] = grads = average_gradients(tower_grads)
        apply_gradient_op = opt.apply_gradients(grads, global_step=global_step)
        variable_averages = v1.train.ExponentialMovingAverage(MOVING_AVERAGE_DECAY, global_step)
        if ema_after_update:                                         # tfpar: fix 3
            with tf.control_dependencies([apply_gradient_op]):
                variables_averages_op = variable_averages.apply(v1.trainable_variables())
        else:
            variables_averages_op = variable_averages.apply(v1.trainable_variables())
        g["train_op"] = tf.group(apply_gradient_op, variables_averages_op)
        g["loss"] = loss_                                            # the step loop's sess.run reads the last tower's
        g["mean_loss"] = tf.add_n(tower_losses) / num_gpus
        g["averages"] = variable_averages
    return g


# --------------------------------------------------------------------------------------------
# Glue: the case's weights in, the case's batches through, every step recorded.
# --------------------------------------------------------------------------------------------
def _train(run, *, mean_loss: bool, float64_lr: bool, ema_after_update: bool, lrn_in_ops: bool = False) -> None:
    with tf.Graph().as_default() as graph:
        # the truncated-normal initialisers draw, and tfpar runs with op determinism on, which
        # refuses an unseeded random op; the draws are overwritten with the case's weights below
        v1.set_random_seed(run.seed)
        g = build_train(run, float64_lr=float64_lr, ema_after_update=ema_after_update, lrn_in_ops=lrn_in_ops)
        variables = {v.op.name: v for v in v1.trainable_variables()}
        params = {f"{layer}.{kind}": variables[f"{layer}/{kind}"] for layer in LAYERS for kind in ("weights", "biases")}
        shadows = {f"ema.{name}": g["averages"].average(var) for name, var in params.items()}
        applied = {name: grad for grad, var in g["grads_and_vars"] for name, p in params.items() if p is var}
        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())
            for name, var in params.items():
                var.load(run.initial[name], sess)
                shadows[f"ema.{name}"].load(run.initial[f"ema.{name}"], sess)
            run.begin(sess.run(params), sess.run(shadows))
            for x, y in run.batches():
                _, loss_value, mean_value, grads = sess.run(
                    [g["train_op"], g["loss"], g["mean_loss"], applied], {g["images"]: x, g["labels"]: y})
                run.record(mean_value if mean_loss else loss_value, sess.run(params), grads=grads,
                           state=sess.run(shadows))


# float32 only, as the program: tf.nn.lrn has no float64 kernel
@tfpar.plugin.tensorflow(dtypes=("float32",))
def multi_gpu_train(run):
    """The program as written: the last tower's loss printed, the averages racing the update."""
    _train(run, mean_loss=False, float64_lr=False, ema_after_update=False)


@tfpar.plugin.tensorflow(dtypes=("float32",))
def multi_gpu_train_fixed(run):
    """The mean of the tower losses printed, the schedule in the case dtype, the averages after the update."""
    _train(run, mean_loss=True, float64_lr=True, ema_after_update=True)


# the same with tf.nn.lrn written out in TensorFlow ops, so that it runs in float64 too
@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multi_gpu_train_f64(run):
    """As written, LRN in ops."""
    _train(run, mean_loss=False, float64_lr=False, ema_after_update=False, lrn_in_ops=True)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multi_gpu_train_f64_race_fixed(run):
    """Fix 3 only, LRN in ops: the averages after the update; the last tower's loss and the float32 lr stay.

    The race of the program as written is decided by TensorFlow's inter-op threads, so a rerun may
    take the other order: the judge then sees a run that does not reproduce itself and judges it
    against that run-to-run spread (a learning-rate gap of float32 size can be within it). Without
    it the program's two deterministic differences are what a comparison finds.
    """
    _train(run, mean_loss=False, float64_lr=False, ema_after_update=True, lrn_in_ops=True)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multi_gpu_train_f64_mean_loss(run):
    """Fix 1, LRN in ops: the step's loss is the mean of the tower losses."""
    _train(run, mean_loss=True, float64_lr=False, ema_after_update=False, lrn_in_ops=True)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multi_gpu_train_f64_mean_loss_lr(run):
    """Fixes 1 and 2, LRN in ops: and the learning-rate schedule in the case dtype."""
    _train(run, mean_loss=True, float64_lr=True, ema_after_update=False, lrn_in_ops=True)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def multi_gpu_train_f64_fixed(run):
    """Fixes 1, 2 and 3, LRN in ops: and the moving averages taken after the update."""
    _train(run, mean_loss=True, float64_lr=True, ema_after_update=True, lrn_in_ops=True)
