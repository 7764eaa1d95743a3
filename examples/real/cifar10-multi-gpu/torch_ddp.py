"""tfpar compare examples/real/cifar10-multi-gpu/case.json --impls examples/real/cifar10-multi-gpu/torch_ddp.py:ddp,examples/real/cifar10-multi-gpu/tf_multi_gpu_train.py:multi_gpu_train

The PyTorch DDP port of the TensorFlow CIFAR-10 multi-GPU tutorial
(``tf_multi_gpu_train.py`` names the source): what one tower computes, as one DDP rank.

* the model, channels-last data moved to ``[n, 3, h, w]``: ``Conv2d(3, c, 5, padding=2)``
  (TensorFlow's SAME for an odd kernel at stride 1), ReLU, a 3x3 stride-2 max pool with
  TensorFlow's SAME padding (the missing row and column added at the bottom and right,
  as ``-inf``), ``LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1)`` (TensorFlow's
  ``lrn(depth_radius=4, alpha=0.001/9)`` sums over 2 * 4 + 1 channels; torch divides its
  ``alpha`` by the window), conv2 with bias 0.1, ReLU, LRN, pool, flattened channels-last,
  local3, local4 (ReLU), softmax_linear;
* the loss of rank r: its mean cross-entropy plus ``0.004 * (||W3||^2 + ||W4||^2) / 2``
  (``wd * tf.nn.l2_loss``); DDP averages the ranks' gradients as ``average_gradients``
  averages the towers';
* ``torch.optim.SGD(lr=0.1)`` (the schedule's first value; its first decay comes after
  ``int(50000 / b * 350)`` steps);
* the moving averages: after each update, ``s <- s - (1 - d)(s - w)`` with
  ``d = min(0.9999, (1 + t) / (10 + t))``, t the step count after the update
  (``ExponentialMovingAverage(0.9999, num_updates=global_step)`` applied after
  ``apply_gradients``, as its documentation prescribes), ``1 - d`` in float32 as
  TensorFlow computes it (:func:`ema_one_minus_decay`);
* the step's loss: the mean over ranks of the rank losses.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

LAYERS = ("conv1", "conv2", "local3", "local4", "softmax_linear")
WD = 0.004


def _same_pool(x: torch.Tensor) -> torch.Tensor:
    """3x3 stride-2 max pool, TensorFlow SAME: pad ``max((ceil(h/2) - 1) * 2 + 3 - h, 0)``, the larger half after."""
    pads = []
    for size in (x.shape[3], x.shape[2]):  # F.pad: last dimension first
        total = max((-(-size // 2) - 1) * 2 + 3 - size, 0)
        pads += [total // 2, total - total // 2]
    return F.max_pool2d(F.pad(x, pads, value=float("-inf")), 3, 2)


class Net(nn.Module):
    def __init__(self, init: dict, dtype: torch.dtype) -> None:
        super().__init__()
        c, flat = init["conv1.weights"].shape[-1], init["local3.weights"].shape[0]
        self.conv1 = nn.Conv2d(3, c, 5, padding=2, dtype=dtype)
        self.conv2 = nn.Conv2d(c, c, 5, padding=2, dtype=dtype)
        self.local3 = nn.Linear(flat, init["local3.weights"].shape[1], dtype=dtype)
        self.local4 = nn.Linear(*init["local4.weights"].shape, dtype=dtype)
        self.softmax_linear = nn.Linear(*init["softmax_linear.weights"].shape, dtype=dtype)
        self.lrn = nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:           # x [n, h, w, 3]
        x = x.permute(0, 3, 1, 2)
        x = self.lrn(_same_pool(F.relu(self.conv1(x))))
        x = _same_pool(self.lrn(F.relu(self.conv2(x))))
        x = x.permute(0, 2, 3, 1).flatten(1)                      # TensorFlow's reshape order
        x = F.relu(self.local4(F.relu(self.local3(x))))
        return self.softmax_linear(x)


def ema_one_minus_decay(t: int) -> float:
    """``1 - d`` as ``tf.compat.v1.train.ExponentialMovingAverage`` computes it, in float32.

    It casts ``num_updates`` to float32, takes ``d = min(0.9999, (1 + t) / (10 + t))`` in
    float32 and converts ``1 - d`` to a float32 tensor before the variable's dtype: in a
    float64 run the averages move by float32's ``1 - d`` (an exact float64 ``1 - d`` differs
    by about 1e-8 relative, 6.6e-9 in the shadows after one step of this case).
    """
    f = np.float32
    d = min(f(0.9999), f(f(1.0) + f(t)) / f(f(10.0) + f(t)))
    return float(f(f(1.0) - d))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = Net(run.initial, run.torch_dtype)
    modules = {name: getattr(net, name) for name in LAYERS}
    # an external model's arrays are told their layout (docs/plugins.md, "Layouts")
    layout = {name: "conv" if isinstance(m, nn.Conv2d) else "dense" for name, m in modules.items()}
    with torch.no_grad():
        for name, m in modules.items():
            m.weight.copy_(torch.as_tensor(run.to_torch(run.initial[f"{name}.weights"], layout=layout[name])))
            m.bias.copy_(torch.as_tensor(run.initial[f"{name}.biases"]))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])

    def params():
        out = {}
        for name, m in modules.items():
            out[f"{name}.weights"], out[f"{name}.biases"] = run.to_tf(m.weight.detach(), layout=layout[name]), m.bias.detach()
        return out

    shadows = {f"ema.{k}": torch.as_tensor(run.initial[f"ema.{k}"]).clone() for k in params()}
    run.begin(params(), shadows)
    for t, (x, y) in enumerate(run.batches(), start=run.first_step):
        optimizer.zero_grad()
        logits = model(torch.as_tensor(x))
        decay_terms = (net.local3.weight ** 2).sum() / 2 + (net.local4.weight ** 2).sum() / 2
        loss = F.cross_entropy(logits, torch.as_tensor(y)) + WD * decay_terms
        loss.backward()
        optimizer.step()
        one_minus_d = ema_one_minus_decay(t)
        for k, v in params().items():
            shadows[f"ema.{k}"] -= one_minus_d * (shadows[f"ema.{k}"] - v)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        grads = {}
        for name, m in modules.items():
            grads[f"{name}.weights"], grads[f"{name}.biases"] = run.to_tf(m.weight.grad, layout=layout[name]), m.bias.grad
        run.record(logged / run.world_size, params(), grads=grads, state=shadows)
