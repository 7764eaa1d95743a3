"""The error-rate hunt's corpus (issue 25, item 7): equivalent rewrites and seeded bugs, as plugins.

``tf_side.py`` holds TensorFlow tower loops (``tf.add_n`` averaging, ``tf.stack`` +
``reduce_mean``, one concatenated-loss mean, a Keras model with a Keras optimizer)
and their seeded bugs; ``torch_side.py`` (no TensorFlow import) holds DDP, DDP
replaced by a hand all-reduce of the gradients, and one process, with theirs.
Every plugin honours the case it is given (dtype, model, loss and reduction,
optimizer and its hyperparameters under the case's semantics, devices, shard,
weighting, combine, clipping) within what :mod:`.corpus` says it supports, so a
drawn pair's correct verdict is known by construction (:func:`.corpus.truth`).
They keep their own optimizer state from step 1, so they are not written for
``tfpar compare --lockstep`` (which restarts every step from the reference's).
``benchmarks/bench_error_rates.py`` draws the pairs and prints the error rates;
``parity_tests/tests/test_error_rates.py`` checks a few of each kind;
``docs/error-rates.md`` explains the rule and keeps the table.
"""
