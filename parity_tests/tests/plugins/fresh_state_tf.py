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
from keras.src.backend.common import global_state
from tensorflow.python.eager import context
from tensorflow.python.framework import config as tf_config
from tensorflow.python.ops import stateful_random_ops

import tfpar

RUNS: list[int] = []  # module state: a fresh import per run starts it empty


def stale_state(seed: int) -> list[str]:
    """What differs from a fresh process, by name (empty when nothing does)."""
    stale = []
    if RUNS:
        stale.append(f"module state ({len(RUNS)} earlier run(s) in this module)")
    # first, before anything here makes it: Keras caches its global dtype policy at first use, and a
    # cached one makes a later set_floatx alone ignored (issue 35: the float64 run then crashed)
    cached = global_state.get_global_attribute("dtype_policy")
    if cached is not None:
        stale.append(f"keras dtype policy {cached.name} (cached: set_floatx alone would be ignored)")
    if keras.config.floatx() != "float32":
        stale.append(f"keras floatx {keras.config.floatx()}")
    if keras.config.epsilon() != 1e-7 or keras.config.image_data_format() != "channels_last":
        stale.append(f"keras epsilon {keras.config.epsilon()} / image data format {keras.config.image_data_format()}")
    if global_state.get_global_attribute("global_random_seed") is not None:
        stale.append("keras global random seed")
    if stateful_random_ops.global_generator is not None:
        stale.append("tf.random's global generator")
    if not tf.config.experimental.tensor_float_32_execution_enabled():
        stale.append("TensorFloat-32 off")
    if not tf.config.get_soft_device_placement():
        stale.append("soft device placement off")
    if tf.config.experimental.get_device_policy() != "silent":
        stale.append(f"device policy {tf.config.experimental.get_device_policy()}")
    if tf.config.optimizer.get_jit():
        stale.append(f"XLA jit {tf.config.optimizer.get_jit()}")
    if tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer"):
        stale.append("grappler options")
    if context.context().log_device_placement:
        stale.append("device placement logging")
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
    keras.config.set_epsilon(1e-3)
    keras.config.set_image_data_format("channels_first")
    keras.utils.set_random_seed(99)  # Python's, numpy's and TensorFlow's seeds, and Keras' own
    tf.random.set_global_generator(tf.random.Generator.from_seed(3))
    tf.config.experimental.enable_tensor_float_32_execution(False)
    tf.config.set_soft_device_placement(False)
    tf.config.experimental.set_device_policy("explicit")
    tf.config.optimizer.set_jit("autoclustering")
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    tf.debugging.set_log_device_placement(True)
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


def describe() -> dict:
    """Every process-wide setting user code can change that no run of the tool sets itself, as plain data
    (``tests/test_fresh_runs.py`` compares a plugin run's with a fresh ``python``'s after ``import keras``).
    Reads only: nothing here makes Keras' dtype policy or starts TensorFlow's runtime."""
    state = {k: repr(v) for k, v in sorted(vars(global_state.GLOBAL_STATE_TRACKER).items())}
    return {
        "keras": {"floatx": keras.config.floatx(), "epsilon": keras.config.epsilon(),
                  "image_data_format": keras.config.image_data_format(), "global_state": state,
                  "settings": sorted(vars(global_state.GLOBAL_SETTINGS_TRACKER))},
        "tf": {"eager": tf.executing_eagerly(), "functions_run_eagerly": tf.config.functions_run_eagerly(),
               "global_seed": context.global_seed(), "global_generator": stateful_random_ops.global_generator is None,
               "tf32": tf.config.experimental.tensor_float_32_execution_enabled(),
               "soft_placement": tf.config.get_soft_device_placement(),
               "device_policy": tf.config.experimental.get_device_policy(), "jit": tf.config.optimizer.get_jit(),
               "grappler": tf.config.optimizer.get_experimental_options(),
               "log_placement": context.context().log_device_placement},
    }


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def reports_state(run):
    """Writes :func:`describe` at its start to ``$FRESH_STATE_OUT``, then trains."""
    import json
    import os

    with open(os.environ["FRESH_STATE_OUT"], "w") as f:
        json.dump(describe(), f)
    _train(run)


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def floatx_alone(run):
    """The reported program (issue 35): ``keras.config.set_floatx`` alone, no ``dtype=`` anywhere, the
    tensorflow/docs custom-training loss (L2 kernel regularizers added to the averaged loss). In a fresh
    ``python`` its float64 run is float64 throughout; with a global dtype policy Keras cached as float32
    before it, its layers compute in float32 and the loss's ``+`` fails (``Input 'y' of 'AddV2' Op has
    type float32 that does not match type float64 of argument 'x'``)."""
    keras.config.set_floatx(run.dtype)
    n = len(run.devices)
    strategy = tf.distribute.MirroredStrategy(run.devices)
    with strategy.scope():
        l2 = keras.regularizers.L2(1e-3)
        model = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(16, activation="tanh", kernel_regularizer=l2),
                                  keras.layers.Dense(3, kernel_regularizer=l2)])
        model.set_weights([run.initial[k] for k in ("0.kernel", "0.bias", "1.kernel", "1.bias")])
        optimizer = keras.optimizers.SGD(learning_rate=run.spec["optimizer"]["lr"],
                                         momentum=run.spec["optimizer"]["momentum"])
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_object(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=run.spec["data"]["global_batch"])
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=batch), axis=None)

    def distribute(a):
        parts = np.array_split(a, n)
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

    def params():
        return {f"{i}.{k}": getattr(layer, k).numpy() for i, layer in enumerate(model.layers) for k in ("kernel", "bias")}

    run.begin(params())
    for xb, yb in run.batches():
        run.record(train_step((distribute(xb), distribute(yb))), params())
