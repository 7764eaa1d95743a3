"""KellerJordan/modded-nanogpt #2, reproduced: ``lossf = loss.item()`` on rank 0, the loss of one shard.

    tfpar compare examples/wild/modded-nanogpt-loss-logging/case.json --impls examples/wild/modded-nanogpt-loss-logging/ddp.py:fixed,examples/wild/modded-nanogpt-loss-logging/ddp.py:buggy

Origin (written anew, not copied): KellerJordan/modded-nanogpt at 4a452a26 (its first commit),
``train_gpt2.py`` L394-395: ``lossf = loss.item()`` and ``print0(f"step ... train loss {lossf:.6f} ...")``.
The issue asked "did you forget to call torch.distributed.all_reduce"; the author: "If you wrap in DDP it's
automatic with the backward pass ... Oh I see what you mean, regarding the loss logging. You're right."
(the gradients are averaged by DDP; the printed loss is rank 0's shard's). The fixed version all-reduces
the logged loss. No accumulation here (llm.c PR #551 is the accumulating variant).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, reduce_logged: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()})
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        lossf = loss.detach().clone()                               # L394
        if reduce_logged:
            dist.all_reduce(lossf, group=run.group)
            lossf /= run.world_size
        run.record(lossf, params(), grads=grads, device_loss=loss.detach(), device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """As in 4a452a26: rank 0 prints its own ``loss.item()``."""
    _train(run, reduce_logged=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """The logged loss all-reduced over the ranks first."""
    _train(run, reduce_logged=True)
