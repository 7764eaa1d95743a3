"""tfpar compare examples/byo/sampler/case.json --impls examples/byo/sampler/tf_towers.py:towers,examples/byo/sampler/torch_ddp.py:ddp,torch.ddp

TensorFlow towers reading the rows a DDP program's ``DistributedSampler`` gives
its ranks: ``run.batches()`` follows the case's ``data.order``
(``distributed_sampler``), so each global batch holds the three ranks' batches
interleaved (row m is rank ``m mod 3``'s), padding included, and tower r takes
rows ``r, r + 3, ...`` of it (a strided split), exactly its rank's rows. Each
tower's mean loss, the towers' gradients averaged, one SGD step.
"""

from __future__ import annotations

import tensorflow as tf

import tfpar


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    w = {k: tf.Variable(v) for k, v in run.initial.items()}
    lr = tf.constant(run.spec["optimizer"]["lr"], dt)   # in the case dtype (a Python float would be float32)
    n = len(run.devices)
    run.begin(w)
    for x, y in run.batches():
        grads, losses = [], []
        for r, dev in enumerate(run.devices):
            with tf.device(dev), tf.GradientTape() as tape:
                h = tf.nn.relu(tf.constant(x[r::n]) @ w["0.kernel"] + w["0.bias"])
                logits = h @ w["1.kernel"] + w["1.bias"]
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.constant(y[r::n]), logits=logits))
            grads.append(tape.gradient(loss, w))
            losses.append(loss)
        g = {k: tf.add_n([gr[k] for gr in grads]) / n for k in w}
        for k in w:
            w[k].assign_sub(lr * g[k])
        run.record(tf.add_n(losses) / n, w, grads=g)
