"""tfpar compare examples/byo/mlp/case.json --impls examples/byo/mlp/tf_towers.py:towers,examples/byo/mlp/torch_ddp.py:ddp,torch.ddp

The seed's classic multi-GPU tower program (TensorFlow's CIFAR-10 multi-GPU
tutorial pattern) on its 5-10-1 MLP, as a ``tf.compat.v1`` graph, wrapped as a
tfpar plugin:

1. the global batch is split into one shard per tower (``tf.split``);
2. tower i builds the model under ``tf.device(devices[i])`` and
   ``name_scope('tower_i')``, sharing the variables through
   ``variable_scope(..., reuse=i > 0)``;
3. each tower computes its own mean loss and ``opt.compute_gradients`` of it;
4. ``average_gradients`` averages the towers' gradients variable by variable;
5. one ``apply_gradients`` (SGD, lr 0.001) updates the shared variables.

Equal tower weights: the update is the mean of the tower gradients (DDP's
all-reduce average), which is the full-batch gradient only when the shards
are equal (``parallel.weighting: equal``).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

v1 = tf.compat.v1

# canonical names of the case (layer index . kind) -> the program's variable names
NAMES = {"0.kernel": "hidden/kernel", "0.bias": "hidden/bias", "1.kernel": "logits/kernel", "1.bias": "logits/bias"}


def dense(x, units, name, initial, dtype, activation=None):
    """``x [n, in]`` -> ``[n, units]``; ``get_variable`` so that reusing towers share the weights."""
    with v1.variable_scope(name):
        w = v1.get_variable("kernel", dtype=dtype, initializer=tf.constant(initial[f"{name}/kernel"], dtype))
        b = v1.get_variable("bias", dtype=dtype, initializer=tf.constant(initial[f"{name}/bias"], dtype))
    h = tf.matmul(x, w) + b
    return activation(h) if activation else h


def tower_loss(x, y, initial, dtype):
    """One tower's mean sigmoid cross-entropy over its shard: ``x [n, 5]``, ``y [n, 1]``."""
    h = dense(x, 10, "hidden", initial, dtype, tf.nn.relu)
    logits = dense(h, 1, "logits", initial, dtype)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))


def average_gradients(tower_grads):
    """The classic helper: ``[towers][vars]`` (grad, var) pairs -> ``[vars]`` averaged pairs.

    The variables are shared, so the first tower's variable stands for all of them.
    """
    average_grads = []
    for grad_and_vars in zip(*tower_grads, strict=True):
        grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
        grad = tf.reduce_mean(tf.concat(axis=0, values=grads), 0)
        average_grads.append((grad, grad_and_vars[0][1]))
    return average_grads


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    n, b = len(run.devices), run.spec["data"]["global_batch"]
    # tf.split(x, n) needs n equal parts; np.array_split's sizes are the case's contiguous shards
    sizes = [len(part) for part in np.array_split(np.arange(b), n)]
    initial = {NAMES[k]: v for k, v in run.initial.items()}

    with tf.Graph().as_default() as graph:
        x = v1.placeholder(dt, [b, 5], name="x")
        y = v1.placeholder(dt, [b, 1], name="y")
        # the optimizer's Python-float lr becomes a float32 tensor (0.0010000000474974513 in a
        # float64 run); a tensor of the case dtype keeps lr exact
        opt = v1.train.GradientDescentOptimizer(tf.constant(run.spec["optimizer"]["lr"], dt))
        xs, ys = tf.split(x, sizes), tf.split(y, sizes)
        tower_grads, tower_losses = [], []
        for i, device in enumerate(run.devices):
            with tf.device(device), tf.name_scope(f"tower_{i}"), \
                    v1.variable_scope(v1.get_variable_scope(), reuse=i > 0):
                loss = tower_loss(xs[i], ys[i], initial, dt)
                tower_losses.append(loss)
                tower_grads.append(opt.compute_gradients(loss, colocate_gradients_with_ops=True))
        grads_and_vars = average_gradients(tower_grads)
        train_op = opt.apply_gradients(grads_and_vars, global_step=v1.train.get_or_create_global_step())
        step_loss = tf.add_n(tower_losses) / n  # the mean of the tower losses: the loss the update descends
        variables = {v.op.name: v for v in v1.trainable_variables()}
        assert len(variables) == 4, f"the towers must share 4 variables, found {sorted(variables)}"
        applied = {v.op.name: g for g, v in grads_and_vars}  # the averaged gradients, by variable

        with v1.Session(graph=graph) as sess:
            sess.run(v1.global_variables_initializer())

            def params():
                values = sess.run(variables)
                return {k: values[name] for k, name in NAMES.items()}

            run.begin(params())
            for xb, yb in run.batches():
                loss_value, grads, _ = sess.run([step_loss, applied, train_op], {x: xb, y: yb})
                run.record(loss_value, params(), grads={k: grads[name] for k, name in NAMES.items()})
