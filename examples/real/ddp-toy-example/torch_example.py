"""tfpar compare examples/real/ddp-toy-example/case.json --impls tf.towers,examples/real/ddp-toy-example/torch_example.py:demo_basic

A port of pytorch/examples ``distributed/ddp/example.py``
(https://github.com/pytorch/examples, commit f84bcb398d9e06b67e3d36b56b5522bba0cf6210,
the last commit to touch that file; snapshot HEAD 77f55b912142e11fcfdf5b530231fb9c52f181e8)
as a tfpar torch plugin, checked against the built-in ``tf.towers`` (the model is one the
case's layer list expresses: ``dense 10 relu -> dense 5``, mean squared error).
Original line numbers are those of that commit.

The program: ``ToyModel`` (lines 20-28) is ``net1 = Linear(10, 10)``, ``ReLU``,
``net2 = Linear(10, 5)``; ``demo_basic`` (lines 31-50) wraps it in ``DDP``, takes
``nn.MSELoss()`` and ``optim.SGD(lr=0.001)``, and runs ONE step on 20 rows of
``torch.randn`` inputs and targets per rank.

What differs from the original, and why:

* the process group: the tool's (gloo on CPU, the default group while the plugin runs)
  instead of ``main``'s ``init_process_group`` from ``torchrun``'s environment: ``DDP(model)``
  without ``device_ids=[rank]``, the model built in the case dtype, not moved ``.to(rank)``;
* the weights: the case's initial weights are loaded into ``ToyModel`` (the original keeps
  torch's random initialisation), so that both sides start from the same numbers;
* the data: each rank's rows of the case's global batch (``run.batches()``), standard
  normal like ``torch.randn``, instead of rows drawn on each rank; the global batch is 20
  rows whatever the rank count, and the step body runs once per step of the case (the
  original runs it once);
* the loss is recorded as the mean over ranks (the program prints nothing of it).

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref


# --------------------------------------------------------------------------------------------
# The program (example.py lines 20-50), rewritten; changed lines marked "tfpar:".
# --------------------------------------------------------------------------------------------
class ToyModel(nn.Module):
    def __init__(self, dtype: torch.dtype):  # tfpar: changed (dtype: the case's)
        super().__init__()
        self.net1 = nn.Linear(10, 10, dtype=dtype)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5, dtype=dtype)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic_step(ddp_model, loss_fn, optimizer, inputs, labels):
    """The body of ``demo_basic`` after the set-up (lines 44-48): one SGD step."""
    optimizer.zero_grad()
    outputs = ddp_model(inputs)  # tfpar: changed (the case's rows, not torch.randn(20, 10))
    loss = loss_fn(outputs, labels)  # tfpar: changed (kept, for the record)
    loss.backward()
    optimizer.step()
    return loss


# --------------------------------------------------------------------------------------------
# Glue: the case's weights in, the case's batches through, every step recorded.
# --------------------------------------------------------------------------------------------
NAMES = {"0.kernel": "net1.weight", "0.bias": "net1.bias", "1.kernel": "net2.weight", "1.bias": "net2.bias"}


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def demo_basic(run):
    model = ToyModel(run.torch_dtype)
    model.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    ddp_model = DDP(model)  # tfpar: changed (device_ids=[rank]: a CPU rank)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    named = dict(model.named_parameters())

    def params():
        return {k: run.to_tf(named[v].detach()) for k, v in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        loss = demo_basic_step(ddp_model, loss_fn, optimizer, torch.as_tensor(x), torch.as_tensor(y))
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        run.record(logged / run.world_size, params(), grads={k: run.to_tf(named[v].grad) for k, v in NAMES.items()})
