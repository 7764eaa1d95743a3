"""tfpar compare examples/byo/sampler/case.json --impls examples/byo/sampler/tf_towers.py:towers,examples/byo/sampler/torch_ddp.py:ddp,torch.ddp

A PyTorch DDP training program as it is usually written: a ``TensorDataset``, a
``DistributedSampler`` that deals the dataset out to the ranks, a ``DataLoader``
over it, ``sampler.set_epoch(epoch)`` at the top of each epoch, and a loop over
epochs until the step budget is spent. Nothing of it is the tool's but
``run.dataset()`` (the case's rows), ``run.world_size`` / ``run.rank`` (this
job's ranks) and the ``run.begin`` / ``run.record`` calls.

``DistributedSampler`` pads each epoch's list to ``3 * ceil(23 / 3) = 24``
entries by repeating row 0, so the last step of every epoch reads row 0 twice;
DDP counts the repeat as data. The TensorFlow side (``tf_towers.py``) reads the
same rows from ``run.batches()``, padding included.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchref

NAMES = {"0.kernel": "hidden.weight", "0.bias": "hidden.bias", "1.kernel": "logits.weight", "1.bias": "logits.bias"}


class MLP(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.hidden = torch.nn.Linear(5, 10, dtype=dtype)
        self.logits = torch.nn.Linear(10, 1, dtype=dtype)

    def forward(self, x):
        return self.logits(torch.relu(self.hidden(x)))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = MLP(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[name].detach()) for k, name in NAMES.items()}

    x, y = run.dataset()
    dataset = TensorDataset(torch.as_tensor(x), torch.as_tensor(y))
    # num_replicas and rank may be left out: during the run the job's group is the default one
    sampler = DistributedSampler(dataset, num_replicas=run.world_size, rank=run.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=run.spec["data"]["global_batch"] // run.world_size, sampler=sampler)

    run.begin(params())
    step, epoch = 0, 0
    while step < run.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            loss.backward()                               # DDP averages the ranks' gradients
            opt.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged, group=run.group)      # the step's loss: the mean of the ranks' losses
            run.record(logged / run.world_size, params())
            step += 1
            if step == run.steps:
                break
        epoch += 1
