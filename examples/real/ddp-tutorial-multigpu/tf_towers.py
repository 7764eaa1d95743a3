"""tfpar compare examples/real/ddp-tutorial-multigpu/case.json --impls examples/real/ddp-tutorial-multigpu/torch_multigpu.py:multigpu,examples/real/ddp-tutorial-multigpu/tf_towers.py:towers

The TensorFlow port of pytorch/examples ``distributed/ddp-tutorial-series/multigpu.py``
(see ``torch_multigpu.py``): one tower per device, each computing what one DDP rank does.

* ``torch.nn.Linear(20, 1)``: ``x @ weight + bias`` (kernel ``[in, out]``);
* ``F.cross_entropy(output, targets)`` with float targets of the output's shape: targets
  are class probabilities, ``-sum_c t_c log_softmax(o)_c`` per row, mean over the rows,
  which is ``tf.nn.softmax_cross_entropy_with_logits(labels=t, logits=o)`` and a mean;
* rank r's rows of a global batch are ``DistributedSampler``'s: rows r, r+N, ...
  (``parallel.shard: strided``);
* DDP averages the ranks' gradients: ``average_gradients``, one SGD step with
  ``lr = 1e-3`` as a tensor of the case dtype (a Python float would be a float32 tensor).

Faithful means it computes the same thing, including what the original computes by
accident: with one output column the softmax is 1, its log 0, so the loss is ``-0.0`` and
every gradient is 0 (module ``README.md``).
"""

from __future__ import annotations

import tensorflow as tf

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    n = len(run.devices)
    w = {name: tf.Variable(value) for name, value in run.initial.items()}   # weight [20, 1], bias [1]
    lr = tf.constant(run.spec["optimizer"]["lr"], dt)
    run.begin(w)
    for x, y in run.batches():
        tower_grads, tower_losses = [], []
        for r, device in enumerate(run.devices):
            with tf.device(device), tf.GradientTape() as tape:
                output = x[r::n] @ w["weight"] + w["bias"]                   # [n_r, 1]
                loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y[r::n], logits=output))
            tower_grads.append(tape.gradient(loss, w))
            tower_losses.append(loss)
        grads = {k: tf.add_n([g[k] for g in tower_grads]) / n for k in w}   # DDP's average
        for k in w:
            w[k].assign_sub(lr * grads[k])
        run.record(tf.add_n(tower_losses) / n, w, grads=grads)
