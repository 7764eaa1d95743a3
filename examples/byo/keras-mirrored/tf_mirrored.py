"""tfpar compare examples/byo/keras-mirrored/case.json --impls examples/byo/keras-mirrored/tf_mirrored.py:mirrored,torch.ddp

A TF2 Keras model trained in a custom loop under ``tf.distribute.MirroredStrategy``,
as the ``tf.distribute`` guide ("Custom training with tf.distribute.Strategy")
writes it, wrapped as a tfpar plugin and checked against the built-in
``torch.ddp`` on a built-in-model case (no torch code to write):

1. ``MirroredStrategy(devices=run.devices)``: one replica per tower device;
2. the model (``keras.Sequential`` of ``Dense`` layers) and the optimizer,
   with its slots (``optimizer.build``), are created under
   ``strategy.scope()``, so every variable is mirrored and the step traces once;
3. ``strategy.experimental_distribute_values_from_function`` hands replica r
   its contiguous slice of each global batch of ``B`` rows (the guide's other
   input path; see the warning below for why not ``experimental_distribute_dataset``);
4. each replica scales its per-example losses by the GLOBAL batch,
   ``tf.nn.compute_average_loss(per_example, global_batch_size=B)``, so that
   the all-reduce SUM of the replicas' gradients inside ``apply_gradients``
   is the gradient of the mean over the whole global batch;
5. ``strategy.reduce(SUM)`` of the replicas' scaled losses is the step's loss.

Because the losses are scaled by the global batch, the replicas are weighted by
their shard sizes (``parallel.weighting: by_size``); with even shards that is
also DDP's plain average.

.. warning:: Keras 3 losses and ``Dense`` layers compute in ``floatx()``
   (float32) unless given a ``dtype``: a float64 run needs ``dtype`` on both,
   or every activation and loss is silently rounded to float32. Keras also
   keeps ``learning_rate`` (and ``momentum``) in float32; the case uses values
   exact in float32 (0.0625, 0.5), so nothing is rounded.

.. warning:: ``strategy.experimental_distribute_dataset`` (TF 2.21) feeds the
   replicas through a ``MultiDeviceIterator``: one ``tf.data`` iterator per
   replica device, each with an autotuning thread (``Model::OptimizeLoop``)
   that its own ``Dataset.options()`` cannot turn off. Destroying such an
   iterator (the end of the ``for batch in dataset`` loop) waits for that
   thread, and on a busy CPU the wait took 20 to 260 s instead of
   milliseconds (gdb: the main thread in ``~LogicalThreadWrapper``, the
   autotuning thread in its timed wait), measured 2026-11-23 at 8 replicas
   beside a ``torchrun`` test. A loop that feeds the replicas itself has no
   such thread.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def mirrored(run):
    dtype = run.dtype
    spec, b = run.spec, run.spec["data"]["global_batch"]
    n_in, (hidden, out) = spec["model"]["input_shape"][0], [layer["units"] for layer in spec["model"]["layers"]]
    # on CPU devices NCCL (the GPU default) has no kernels: reduce on the first device, broadcast
    strategy = tf.distribute.MirroredStrategy(
        devices=run.devices, cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device=run.devices[0]))

    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(n_in,), dtype=dtype),
            keras.layers.Dense(hidden, activation="tanh", dtype=dtype),
            keras.layers.Dense(out, dtype=dtype),
        ])
        # the case's initial weights, in Keras' own order and layouts: kernel [in, out], bias
        model.set_weights([run.initial[k] for k in ("0.kernel", "0.bias", "1.kernel", "1.bias")])
        optimizer = keras.optimizers.SGD(learning_rate=spec["optimizer"]["lr"], momentum=spec["optimizer"]["momentum"])
        # the slots (momentum) made here, not by the first apply_gradients: a tf.function that
        # creates variables in its first call is traced twice (once to create them, once more
        # with a cond on their initialisation), which cost 3.6 s of a 5.7 s run at 8 replicas
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None, dtype=dtype)

    def params():
        dense = model.layers  # keras.Input is not a layer of a Sequential model
        return {f"{i}.{kind}": getattr(layer, kind).numpy() for i, layer in enumerate(dense) for kind in ("kernel", "bias")}

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_object(y, model(x, training=True))           # [n_r]
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=b)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))  # all-reduces (SUM), then updates
        return loss

    @tf.function
    def train_step(batch):
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def distribute(a):
        # replica r's rows of the global batch: contiguous slices, as experimental_distribute_dataset
        # cuts a batch; not that call itself (module docstring: its iterators can stall on a busy CPU)
        parts = np.array_split(a, strategy.num_replicas_in_sync)
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(parts[ctx.replica_id_in_sync_group]))

    run.begin(params())
    for xb, yb in run.global_batches():  # no shuffle: step k reads the case's rows [kB, (k+1)B)
        loss = train_step((distribute(xb), distribute(yb)))
        run.record(loss, params())
