"""tfpar compare examples/byo/poly-adam/case.json --impls examples/byo/poly-adam/tf_graph.py:make_parallel,examples/byo/poly-adam/torch_ddp.py:ddp,torch.ddp

The port of the seed's ``make_parallel`` program to PyTorch DDP, as a user
would write it: each rank holds the model, reads its shard of the global
batch, and ``DistributedDataParallel`` all-reduces (averages) the gradients
during ``backward``; ``torch.optim.Adam`` applies them.

Two things make it the same program and not merely a similar one:

* the loss. TensorFlow takes ONE mean over the concatenated per-example
  losses of all towers: ``sum_i l_i / B``. DDP averages the ranks' gradients,
  so each rank differentiates ``N / B * sum_{i in shard} l_i``; their average
  is the gradient of ``sum_i l_i / B`` even when the shards are uneven (a
  plain per-rank ``mean`` would weight the rows of a smaller shard more).
* Adam's epsilon. ``tf.compat.v1.train.AdamOptimizer`` (and Keras) add eps to
  the raw ``sqrt(v)``; ``torch.optim.Adam`` adds it to the bias-corrected
  ``sqrt(v) / sqrt(1 - b2^t)``. Setting torch's eps to
  ``eps / sqrt(1 - b2^t)`` before step t gives TensorFlow's rule exactly
  (``optimizer.semantics: tf``); with ``torch`` or ``native`` semantics torch's
  own rule runs unchanged.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref


class Poly(torch.nn.Module):
    """``y = w . [x^2, x, 1]``: ``x [n]`` -> ``[n, 1]``."""

    def __init__(self, w):
        super().__init__()
        # created in w's dtype: a float32 Linear would round float64 weights on copy_
        self.w = torch.nn.Linear(3, 1, bias=False, dtype=w.dtype)
        with torch.no_grad():
            self.w.weight.copy_(w)  # torch layout [out, in] = [1, 3]

    def forward(self, x):
        return self.w(torch.stack([x * x, x, torch.ones_like(x)], 1))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    opt_spec = run.spec["optimizer"]
    b = run.spec["data"]["global_batch"]
    net = Poly(torch.as_tensor(run.to_torch(run.initial["1.kernel"])))  # run.initial is in the case dtype
    model = DDP(net, process_group=run.group)
    b1, b2, eps = opt_spec["beta1"], opt_spec["beta2"], opt_spec["epsilon"]
    opt = torch.optim.Adam(model.parameters(), lr=opt_spec["lr"], betas=(b1, b2), eps=eps)
    tf_rule = opt_spec["semantics"] == "tf"

    def params():
        return {"1.kernel": run.to_tf(net.w.weight.detach())}

    run.begin(params())
    for t, (x, y) in enumerate(run.batches(), start=1):
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        per_example = (model(x) - y) ** 2                      # [n, 1]
        loss = per_example.sum() * (run.world_size / b)        # DDP's average of these = one global mean
        opt.zero_grad()
        loss.backward()
        if tf_rule:
            for group in opt.param_groups:
                group["eps"] = eps / math.sqrt(1.0 - b2 ** t)  # "epsilon hat": TensorFlow's placement
        opt.step()
        # the step's loss as TensorFlow reports it: the mean over the whole global batch
        total = per_example.detach().sum()
        dist.all_reduce(total, group=run.group)
        run.record(total / b, params(), grads={"1.kernel": run.to_tf(net.w.weight.grad)})
