"""Keras' Adam, RMSprop and Adagrad square each occurrence of a repeated index in a sparse
(``tf.IndexedSlices``) gradient before the duplicates are summed.

    .venv/bin/python examples/framework-bugs/keras_embedding_sparse_second_moment.py

Versions: Keras 3.15.1, TensorFlow 2.21.0 (CPU).

A table row looked up twice gets two gradient slices of 1.0 each: its gradient is 2.0, and every
optimizer's second moment should see 2.0^2 = 4 (what a dense gradient gives, and what torch gives,
whose sparse optimizers coalesce first: torch/optim/adagrad.py, "the update is non-linear so
indices must be unique"). Keras' ``ops.square`` squares the slices one by one (1 + 1 = 2) and only
then are they summed (keras/src/backend/tensorflow/sparse.py:382 then :488).

Expected: the IndexedSlices column equal to the dense one. Observed:
  Adam     dense gradient: row 0 = 0.900001   IndexedSlices: row 0 = 0.858580   (1 - 0.1 * 2 / sqrt 2)
  RMSprop  dense gradient: row 0 = 0.683772   IndexedSlices: row 0 = 0.552786   (1 - 0.1 * 2 / sqrt(0.1 * 2))
  Adagrad  dense gradient: row 0 = 0.900000   IndexedSlices: row 0 = 0.858579   (1 - 0.1 * 2 / sqrt 2)
The same happens under MirroredStrategy when one id appears once on each of two replicas: the
all-reduce concatenates the replicas' slices
(benchmarks/framework_differences/embedding_sparse_moments.py measures it).
"""

import keras
import tensorflow as tf

for make in (lambda: keras.optimizers.Adam(0.1), lambda: keras.optimizers.RMSprop(0.1),
             lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.0)):
    rows = {}
    for densify in (True, False):
        table = keras.Variable([[1.0], [1.0]])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [0, 0]))  # row 0 twice
        grad = tape.gradient(loss, table)  # tf.IndexedSlices: values [[1], [1]], indices [0, 0]
        if densify:
            grad = tf.convert_to_tensor(grad)  # [[2], [0]]
        opt = make()
        opt.apply_gradients([(grad, table)])
        rows[densify] = float(table[0, 0])
    name = type(opt).__name__
    print(f"{name:8s} dense gradient: row 0 = {rows[True]:.6f}   IndexedSlices: row 0 = {rows[False]:.6f}")
