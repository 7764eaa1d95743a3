"""torch DDP plugins for the lockstep tests: a correct port of a dense case and a seeded bug that fires late.

``clamp_inputs`` "sanitises" its inputs to [-CLAMP, CLAMP] before the forward pass: a
no-op on every batch without an outlier, so in a case whose only outlier sits in the 40th
global batch the bug fires at step 40 and nowhere else (``test_lockstep.py``). Plain
SGD with a constant learning rate: the optimizer has no state, so each one-step run from
``run.initial`` is a lockstep step. No TensorFlow here: every rank of the pool imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

BOTH = ("float32", "float64")
CLAMP = 5.0
_ACT = {"tanh": torch.tanh, "relu": torch.relu, "none": lambda h: h}


class Net(torch.nn.Module):
    """The case's two dense layers, ``[5] -> units (activation) -> 1``, weights in torch layout."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        first = spec["model"]["layers"][0]
        self.l0 = torch.nn.Linear(spec["model"]["input_shape"][0], first["units"])
        self.l1 = torch.nn.Linear(first["units"], 1)
        self.act = _ACT[first.get("activation", "none")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(self.act(self.l0(x)))


NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}


def _train(run, *, clamp: bool) -> None:
    net = Net(run.spec).to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=run.spec["optimizer"]["lr"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        x = torch.as_tensor(x)
        if clamp:
            x = x.clamp(-CLAMP, CLAMP)  # the seeded bug: only an outlier beyond CLAMP notices it
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params())


@torchref.plugin.distributed(dtypes=BOTH)
def ddp(run):
    _train(run, clamp=False)


@torchref.plugin.distributed(dtypes=BOTH)
def clamp_inputs(run):
    _train(run, clamp=True)


@torchref.plugin.distributed  # float32 only (the default): lockstep cannot bound its float32 steps
def ddp_float32(run):
    _train(run, clamp=False)
