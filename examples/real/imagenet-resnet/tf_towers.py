"""tfpar compare examples/real/imagenet-resnet/case.json --impls examples/real/imagenet-resnet/tf_towers.py:towers,examples/real/imagenet-resnet/torch_main.py:main_worker

The TensorFlow tower port of pytorch/examples ``imagenet/main.py`` with its ``resnet18``
(``torch_main.py`` names the source): one tower per device, each doing what one DDP rank
does, then one update.

* the model: ``resnet_torch.py``'s ResNet in TensorFlow ops, channels-last. torch pads
  convolutions and the max pool symmetrically (``padding=k // 2``, ``padding=1``), so the
  input is padded explicitly (zeros; ``-inf`` for the pool) and the op run ``VALID``;
  TensorFlow's ``SAME`` would pad a stride-2 layer on the bottom/right only;
* batch norm in training: each tower normalises with its own shard's mean and biased
  variance (``eps`` 1e-5, torch's default) as each DDP rank does; the running statistics
  follow torch's rule, ``r <- 0.9 r + 0.1 s`` with the UNBIASED variance, and only tower
  0's are kept (DDP broadcasts rank 0's buffers before every forward pass);
* the loss: each tower's mean cross-entropy; DDP's gradient average is the mean of the
  tower gradients;
* the update is ``torch.optim.SGD(lr, momentum, weight_decay)``'s rule, on EVERY
  parameter (batch norm and classifier bias included): ``g <- g + wd p``, ``b <- g`` at
  the first step, ``b <- mu b + g`` after, ``p <- p - lr b``, with the hyperparameters as
  tensors of the case dtype;
* the step's loss logged is the mean of the tower losses.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfpar

EPS, BN_MOMENTUM = 1e-5, 0.1


def _conv(x, k, stride):
    p = k.shape[0] // 2
    x = tf.pad(x, [[0, 0], [p, p], [p, p], [0, 0]])
    return tf.nn.conv2d(x, k, stride, "VALID")


class Towers:
    """The ResNet's forward pass on one tower, its batch-norm statistics kept for tower 0."""

    def __init__(self, w: dict[str, tf.Variable], state: dict[str, tf.Variable]) -> None:
        self.w, self.state = w, state
        self.blocks = sorted({".".join(k.split(".")[:2]) for k in w if k.startswith("layer")})  # layer1.0, ...

    def bn(self, x, name, keep):
        mean, var = tf.nn.moments(x, [0, 1, 2])
        if keep:
            n = tf.cast(tf.size(x) // x.shape[-1], x.dtype)
            m, v = self.state[f"{name}.moving_mean"], self.state[f"{name}.moving_variance"]
            m.assign((1 - BN_MOMENTUM) * m + BN_MOMENTUM * mean)
            v.assign((1 - BN_MOMENTUM) * v + BN_MOMENTUM * var * n / (n - 1))
        return (x - mean) / tf.sqrt(var + EPS) * self.w[f"{name}.gamma"] + self.w[f"{name}.beta"]

    def block(self, x, name, keep):
        w = self.w
        stride = 2 if f"{name}.downsample.0.kernel" in w and not name.startswith("layer1") else 1
        out = tf.nn.relu(self.bn(_conv(x, w[f"{name}.conv1.kernel"], stride), f"{name}.bn1", keep))
        out = self.bn(_conv(out, w[f"{name}.conv2.kernel"], 1), f"{name}.bn2", keep)
        shortcut = x
        if f"{name}.downsample.0.kernel" in w:
            shortcut = self.bn(_conv(x, w[f"{name}.downsample.0.kernel"], stride), f"{name}.downsample.1", keep)
        return tf.nn.relu(out + shortcut)

    def logits(self, x, keep):
        w = self.w
        x = tf.nn.relu(self.bn(_conv(x, w["conv1.kernel"], 2), "bn1", keep))
        x = tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]], constant_values=-np.inf)
        x = tf.nn.max_pool2d(x, 3, 2, "VALID")
        for name in self.blocks:
            x = self.block(x, name, keep)
        return tf.reduce_mean(x, [1, 2]) @ w["fc.kernel"] + w["fc.bias"]


@tfpar.plugin.tensorflow(dtypes=("float32", "float64"))
def towers(run):
    dt = tf.float64 if run.dtype == "float64" else tf.float32
    n = len(run.devices)
    stats = ("moving_mean", "moving_variance")
    w = {k: tf.Variable(v) for k, v in run.initial.items() if not k.endswith(stats)}
    state = {k: tf.Variable(v) for k, v in run.initial.items() if k.endswith(stats)}
    model = Towers(w, state)
    opt = run.spec["optimizer"]
    lr, mu, wd = (tf.constant(opt[k], dt) for k in ("lr", "momentum", "weight_decay"))
    buf: dict[str, tf.Variable] = {}
    run.begin(w, state)
    for x, y in run.batches():
        tower_grads, tower_losses = [], []
        for r, (device, xr, yr) in enumerate(zip(run.devices, np.array_split(x, n), np.array_split(y, n), strict=True)):
            with tf.device(device), tf.GradientTape() as tape:
                logits = model.logits(tf.constant(xr), keep=r == 0)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yr, logits=logits))
            tower_grads.append(tape.gradient(loss, w))
            tower_losses.append(loss)
        grads = {k: tf.add_n([tg[k] for tg in tower_grads]) / n for k in w}    # DDP's average
        for k, p in w.items():
            g = grads[k] + wd * p
            if k in buf:
                buf[k].assign(mu * buf[k] + g)
            else:
                buf[k] = tf.Variable(g)
            p.assign_sub(lr * buf[k])
        run.record(tf.add_n(tower_losses) / n, w, grads=grads, state=state)
