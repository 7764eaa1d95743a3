"""torch plugins for the judge's mapping tests (``test_mapping.py``): DDP ports of ``mapping_tf.py``.

No TensorFlow here: every rank of the pool imports this file. The MLP case of
``parity_tests/tests/helpers.py``, each rank's shard as ``run.batches()`` deals it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

BOTH = ("float32", "float64")
NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}
L2 = 1e-2  # mapping_tf.L2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(5, 10)
        self.l1 = torch.nn.Linear(10, 1)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


def _train(run, make_opt, *, l2: float = 0.0, wrap: bool = True) -> None:
    net = Net().to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group) if wrap and run.group is not None else net
    opt = make_opt(model.parameters(), run.spec["optimizer"])
    named = dict(net.named_parameters())

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        if l2:  # the L2 term of every rank's loss: DDP averages its gradient to itself
            loss = loss + l2 * (net.l0.weight.pow(2).sum() + net.l1.weight.pow(2).sum())
        loss.backward()
        applied = {k: run.to_tf(named[v].grad) for k, v in NAMES.items()}
        opt.step()
        logged = loss.detach().clone()
        if run.group is not None:
            dist.all_reduce(logged, group=run.group)
            logged /= run.world_size
        run.record(logged, params(), grads=applied)


def _adam(params, o):
    return torch.optim.Adam(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["epsilon"])


def _adamw(params, o):
    return torch.optim.AdamW(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["epsilon"],
                             weight_decay=o["weight_decay"])


@torchref.plugin.distributed(dtypes=BOTH)
def adam_l2(run):
    """The faithful port of ``mapping_tf.keras_l2``: torch's Adam, the same L2 term in the loss."""
    _train(run, _adam, l2=L2)


@torchref.plugin.distributed(dtypes=BOTH)
def adam_l2_doubled(run):
    """``adam_l2`` with a seeded bug: the L2 factor doubled."""
    _train(run, _adam, l2=2 * L2)


@torchref.plugin.distributed(dtypes=BOTH)
def adamw(run):
    """DDP with torch's AdamW."""
    _train(run, _adamw)


@torchref.plugin.distributed(dtypes=BOTH)
def adamw_unwrapped(run):
    """As a public graph-network trainer did at one commit: the model is unwrapped before training, so no
    gradient is ever all-reduced and each rank trains on its own shard."""
    _train(run, _adamw, wrap=False)
