"""meta-pytorch/torchtune PR #2172, reproduced: ``scale_grads(model, 1 / num_tokens)`` after DDP already averaged.

    tfpar compare examples/wild/torchtune-scale-grads-world-size/case.json --impls examples/wild/torchtune-scale-grads-world-size/ddp.py:fixed,examples/wild/torchtune-scale-grads-world-size/ddp.py:buggy

Origin (written anew, not copied): meta-pytorch/torchtune at e420bc0c733eafca563d7efa88fb8c0d1663137d^ (the
parent of the fix), ``recipes/full_finetune_distributed.py``: each micro-batch backpropagates the *summed*
token loss (``current_loss = loss_fn(...) * current_num_tokens``), L777 ``torch.distributed.all_reduce(
num_tokens)`` sums the tokens of every rank, L781 ``training.scale_grads(self._model, 1 / num_tokens)``.
FSDP/DDP have already divided the gradient by the world size in their all-reduce, so the result is
``(1/N) d(global token mean)``. The fix (e420bc0, PR #2172) scales by ``world_size / num_tokens``; the
thread measured the grad norm "off almost exactly by a factor of 8" at 8 GPUs, the loss curves alike.
Here a token is a row; no accumulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, undo_world_size: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    n_r = len(run.shard())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()}, scale=float(n_r))  # the rank's loss is a sum
    o = run.spec["optimizer"]
    opt = torch.optim.AdamW(net.parameters(), lr=o["lr"], weight_decay=o["weight_decay"], eps=o["epsilon"])
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        current_num_tokens = torch.tensor(float(len(y)), dtype=run.torch_dtype)
        current_loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(x)), torch.as_tensor(y)) * current_num_tokens
        running_loss = current_loss.detach().clone()
        current_loss.backward()                                   # DDP: the gradients averaged over the ranks
        num_tokens = current_num_tokens.clone()
        dist.all_reduce(num_tokens, group=run.group)              # L777
        dist.all_reduce(running_loss, group=run.group)
        scale = (run.world_size if undo_world_size else 1) / num_tokens   # L781 (buggy) / the fix
        for p in net.parameters():
            p.grad.mul_(scale)
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        run.record(running_loss / num_tokens, params(), grads=grads, device_loss=current_loss.detach() / current_num_tokens,
                   device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #2172: ``scale_grads(model, 1 / num_tokens)``."""
    _train(run, undo_world_size=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #2172: ``scale_grads(model, world_size / num_tokens)``."""
    _train(run, undo_world_size=True)
