"""tfpar compare examples/real/custom-training-mirrored/case.json --impls examples/real/custom-training-mirrored/tf_custom_training.py:custom_training,examples/real/custom-training-mirrored/torch_ddp.py:ddp

The PyTorch DDP port of the tensorflow/docs tutorial "Custom training with
tf.distribute.Strategy" (``tf_custom_training.py`` names the source): what each replica
computes, as one DDP rank.

* the model: ``Conv2d(1, c1, 3)``, ReLU, ``MaxPool2d(2)``, ``Conv2d(c1, c2, 3)``, ReLU,
  ``MaxPool2d(2)``, flatten, ``Linear(., d1)``, ReLU, ``Linear(d1, 10)``. Keras flattens
  channels-last, so the feature map is moved to ``[n, h, w, c]`` before flattening (the
  dense kernel then reads the same features in the same order as the TensorFlow side);
* the loss of rank r: the mean cross-entropy over its rows plus the kernels' L2 term,
  ``1e-5 * sum(w^2)`` (Keras' ``regularizers.L2(1e-5)``, biases not regularised). DDP
  averages the ranks' gradients: ``(1/N) sum_r grad(mean_r) + grad(L2)``, the gradient of
  the notebook's summed replica losses ``sum_r (sum_r CE / (n_r N) + L2 / N)`` for equal
  shards;
* the optimizer: ``torch.optim.Adam(lr=1e-3, eps=1e-7)`` with TensorFlow's epsilon placement
  (the case's ``semantics: tf``): before step t its epsilon is set to
  ``1e-7 / sqrt(1 - beta2^t)``, which turns torch's ``m_hat / (sqrt(v_hat) + eps)`` into
  Keras' ``lr_t m / (sqrt(v) + eps)``;
* the step's loss is the mean over ranks of the rank losses (the notebook's ``reduce(SUM)``
  of losses each scaled by ``1 / N``).

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

L2 = 1e-5
KERNELS = ("conv1", "conv2", "dense1", "dense2")


class Net(nn.Module):
    def __init__(self, c1: int, c2: int, d1: int, dtype: torch.dtype):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, dtype=dtype)
        self.conv2 = nn.Conv2d(c1, c2, 3, dtype=dtype)
        self.dense1 = nn.Linear(5 * 5 * c2, d1, dtype=dtype)
        self.dense2 = nn.Linear(d1, 10, dtype=dtype)

    def forward(self, x):                                        # x [n, 28, 28, 1], channels last
        x = x.permute(0, 3, 1, 2)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.permute(0, 2, 3, 1).flatten(1)                     # Keras' Flatten order
        return self.dense2(F.relu(self.dense1(x)))


def _train(run, *, keras_float64: bool) -> None:
    init = run.initial
    net = Net(init["conv1.kernel"].shape[-1], init["conv2.kernel"].shape[-1], init["dense1.kernel"].shape[-1],
              run.torch_dtype)
    named = dict(net.named_parameters())
    names = {f"{layer}.{kind}": f"{layer}.{'weight' if kind == 'kernel' else 'bias'}"
             for layer in KERNELS for kind in ("kernel", "bias")}
    # an external model's arrays are told their layout (docs/plugins.md, "Layouts"): kernels as their torch class holds them
    layouts = {k: ("none" if k.endswith("bias") else "conv" if k.startswith("conv") else "dense") for k in names}
    with torch.no_grad():
        for k, v in names.items():
            named[v].copy_(torch.as_tensor(run.to_torch(init[k], layout=layouts[k])))
    model = DDP(net)
    opt = run.spec["optimizer"]
    if keras_float64:
        optimizer = KerasAdam(model.parameters(), lr=opt["lr"], beta1=opt["beta1"], beta2=opt["beta2"],
                              epsilon=opt["epsilon"], steps_done=run.first_step - 1)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]),
                                     eps=opt["epsilon"])

    def params():
        return {k: run.to_tf(named[v].detach(), layout=layouts[k]) for k, v in names.items()}

    run.begin(params())
    for t, (x, y) in enumerate(run.batches(), start=run.first_step):
        optimizer.zero_grad()
        logits = model(torch.as_tensor(x))
        # Keras' L2 casts its factor with ops.cast(l2, x.dtype): tf.cast of a Python float, via float32
        l2 = float(np.float32(L2)) if keras_float64 else L2
        loss = F.cross_entropy(logits, torch.as_tensor(y)) + l2 * sum((named[f"{k}.weight"] ** 2).sum() for k in KERNELS)
        loss.backward()
        if not keras_float64:
            for group in optimizer.param_groups:
                group["eps"] = opt["epsilon"] / math.sqrt(1.0 - opt["beta2"] ** t)
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        run.record(logged / run.world_size, params())


class KerasAdam:
    """Keras 3.15's ``Adam.update_step`` (``keras/src/optimizers/adam.py``), for the check in README.md.

    Keras casts ``beta_1`` and ``beta_2`` for the bias correction with ``ops.cast`` of a
    Python float, which on the TensorFlow backend is ``tf.cast``: a float32 constant first,
    widened after. ``learning_rate`` is a variable of ``floatx()`` at the optimizer's
    construction (float64 here, the program runs under ``set_floatx``); ``1 - beta`` and
    ``epsilon`` stay Python floats::

        alpha = lr sqrt(1 - f32(b2)^t) / (1 - f32(b1)^t)
        m += (g - m)(1 - b1);  v += (g^2 - v)(1 - b2);  p -= alpha m / (sqrt(v) + eps)

    In float32 every value is float32 anyway.
    """

    def __init__(self, params, *, lr: float, beta1: float, beta2: float, epsilon: float, steps_done: int = 0) -> None:
        self.params = [p for p in params]
        self.lr, self.b1, self.b2, self.eps = lr, beta1, beta2, epsilon
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = steps_done

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        dt = self.params[0].dtype
        f32 = lambda a: torch.tensor(a, dtype=torch.float32).to(dt)  # noqa: E731
        t = torch.tensor(self.t, dtype=dt)
        alpha = self.lr * torch.sqrt(1 - f32(self.b2) ** t) / (1 - f32(self.b1) ** t)
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            m.add_((g - m) * (1 - self.b1))
            v.add_((g * g - v) * (1 - self.b2))
            p.sub_(m * alpha / (torch.sqrt(v) + self.eps))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    """The port: ``torch.optim.Adam`` with TensorFlow's epsilon placement, exact in the case dtype."""
    _train(run, keras_float64=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp_keras_float32_constants(run):
    """The port with Keras' own arithmetic: Adam's bias-correction betas and the L2 factor through float32."""
    _train(run, keras_float64=True)
