"""tfpar compare examples/byo/mlp/case.json --impls examples/byo/mlp/tf_towers.py:towers,examples/byo/mlp/torch_ddp.py:ddp,torch.ddp

The port of the seed's 5-10-1 tower program to PyTorch DDP, as a user would
write it: each rank builds the same MLP from the same initial weights, reads
its contiguous shard of the global batch, takes the mean loss over its shard,
and ``DistributedDataParallel`` averages the gradients in ``backward`` (the
towers' ``average_gradients``); ``torch.optim.SGD`` applies them.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

# canonical names of the case (TensorFlow layouts) -> this module's parameters
NAMES = {"0.kernel": "hidden.weight", "0.bias": "hidden.bias", "1.kernel": "logits.weight", "1.bias": "logits.bias"}


class MLP(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        # built in the case dtype: a float32 module would round float64 weights when they are loaded
        self.hidden = torch.nn.Linear(5, 10, dtype=dtype)
        self.logits = torch.nn.Linear(10, 1, dtype=dtype)

    def forward(self, x):
        return self.logits(torch.relu(self.hidden(x)))


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = MLP(run.torch_dtype)
    # dense kernels are [in, out] in TensorFlow, [out, in] in torch
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[name].detach()) for k, name in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        opt.zero_grad()
        loss.backward()  # DDP: every rank now holds the mean of the ranks' gradients
        opt.step()
        # the step's loss as the TensorFlow program reports it: the mean of the tower losses
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=run.group)
        run.record(mean_loss / run.world_size, params(),
                   grads={k: run.to_tf(named[name].grad) for k, name in NAMES.items()})
