"""The DDP port of ``adadelta_tf.towers``: ``torch.optim.Adadelta`` with the case's hyperparameters (kept as data).

No TensorFlow here: every rank imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    o = run.spec["optimizer"]
    opt = torch.optim.Adadelta(model.parameters(), lr=o["lr"], rho=o["rho"], eps=o["epsilon"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params(), grads={k: run.to_tf(named[v].grad) for k, v in NAMES.items()})
