"""A TensorFlow plugin that checks, at its start, that no earlier run left state, and then leaves every kind.

``leaves_state`` trains the ``keras-mirrored`` model (dense 4-16 tanh, dense 3, softmax_ce, SGD
with momentum) in a ``MirroredStrategy`` custom loop, as the ``tf.distribute`` guide writes it.
Before it trains it raises ``AssertionError`` naming every piece of process state that is not
as a fresh process has it; after its last step it changes each of them. Run twice in one
process (``tests/test_fresh_runs.py`` shows it), the second run fails; run by the tool, every
run is fresh.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import config as tf_config

import tfpar

RUNS: list[int] = []  # module state: a fresh import per run starts it empty


def stale_state(seed: int) -> list[str]:
    """What differs from a fresh process, by name (empty when nothing does)."""
    stale = []
    if RUNS:
        stale.append(f"module state ({len(RUNS)} earlier run(s) in this module)")
    if keras.config.floatx() != "float32":
        stale.append(f"keras floatx {keras.config.floatx()}")
    if keras.config.dtype_policy().name != "float32":
        stale.append(f"keras dtype policy {keras.config.dtype_policy().name}")
    name = keras.layers.Dense(1).name
    if name != "dense":
        stale.append(f"keras name counters (a new Dense is named {name})")
    if not tf.executing_eagerly():
        stale.append("eager execution disabled")
    if tf.config.functions_run_eagerly():
        stale.append("tf.config.run_functions_eagerly(True)")
    if context.global_seed() is not None:
        stale.append(f"TensorFlow global seed {context.global_seed()}")
    if not tf_config.is_op_determinism_enabled():
        stale.append("op determinism off")
    if np.random.random() != np.random.RandomState(seed % 2**32).random_sample():
        stale.append("numpy's global generator")
    ops = len(tf.compat.v1.get_default_graph().get_operations())
    if ops:
        stale.append(f"the default graph holds {ops} op(s)")
    return stale


def leave_state() -> None:
    """Change every piece of state :func:`stale_state` looks at (a real program's set-up does such things)."""
    RUNS.append(1)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("mixed_float16")
    keras.layers.Dense(1)  # a name counter moves
    tf.random.set_seed(1234)
    tf.config.run_functions_eagerly(True)
    np.random.random(5)
    with tf.compat.v1.get_default_graph().as_default():
        tf.constant(1.0, name="left_behind")  # an op in the process's default graph
    tf_config.disable_op_determinism()
    tf.compat.v1.disable_eager_execution()  # for good, in this process


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def leaves_state(run):
    stale = stale_state(run.seed)
    if stale:
        raise AssertionError("state left by an earlier run: " + "; ".join(stale))
    _train(run)
    leave_state()


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def mirrored(run):
    """The guide's loop alone (``benchmarks/bench_plugin_isolation.py`` runs it again and again)."""
    _train(run)


def _train(run) -> None:
    dtype, b = run.dtype, run.spec["data"]["global_batch"]
    strategy = tf.distribute.MirroredStrategy(run.devices)  # the guide's line: default cross-device ops
    with strategy.scope():
        model = keras.Sequential([keras.Input(shape=(4,), dtype=dtype),
                                  keras.layers.Dense(16, activation="tanh", dtype=dtype),
                                  keras.layers.Dense(3, dtype=dtype)])
        model.set_weights([run.initial[k] for k in ("0.kernel", "0.bias", "1.kernel", "1.bias")])
        opt = run.spec["optimizer"]
        optimizer = keras.optimizers.SGD(learning_rate=opt["lr"], momentum=opt["momentum"])
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None, dtype=dtype)

    def params():
        return {f"{i}.{k}": getattr(layer, k).numpy() for i, layer in enumerate(model.layers) for k in ("kernel", "bias")}

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_object(y, model(x, training=True)), global_batch_size=b)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=batch), axis=None)

    def distribute(a):
        parts = np.array_split(a, strategy.num_replicas_in_sync)
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

    run.begin(params())
    for xb, yb in run.batches():
        run.record(train_step((distribute(xb), distribute(yb))), params())
