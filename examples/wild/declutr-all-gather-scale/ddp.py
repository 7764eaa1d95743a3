"""JohnGiorgi/DeCLUTR PR #212, reproduced: a loss over all-gathered embeddings, not scaled by the world size.

    tfpar compare examples/wild/declutr-all-gather-scale/case.json --impls examples/wild/declutr-all-gather-scale/ddp.py:fixed,examples/wild/declutr-all-gather-scale/ddp.py:buggy

Origin (written anew, not copied): JohnGiorgi/DeCLUTR at 531c448^ (the parent of the fix 531c448, merged
as c16b520, PR #212), ``declutr/model.py``: the contrastive loss over the embeddings all-gathered from
every rank (``output_dict["loss"] += self._loss(embeddings, labels, indices_tuple)``). ``all_gather``
passes no gradient back to the other ranks' embeddings, so each rank's backward reaches only its own
rows, ``(n_r / B) d l_r``, and DDP's average leaves ``(1/N)`` of the gradient of the loss over the whole
batch. The fix multiplies the loss by ``dist.get_world_size()`` (the commit cites the blog post
"gradient backpropagation with torch.distributed.all_gather"). Here the "contrastive" loss is the
case's cross-entropy over the gathered logits, own rows put back with their graph (the blog's recipe).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, times_world_size: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()})
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        logits = model(torch.as_tensor(x))
        gathered = [torch.zeros_like(logits) for _ in range(run.world_size)]
        dist.all_gather(gathered, logits.detach(), group=run.group)   # no gradient flows back through these
        gathered[run.rank] = logits                                   # this rank's rows, with their graph
        labels = [torch.zeros_like(logits) for _ in range(run.world_size)]
        dist.all_gather(labels, torch.as_tensor(y), group=run.group)
        loss = F.binary_cross_entropy_with_logits(torch.cat(gathered), torch.cat(labels))   # over the whole batch
        (loss * run.world_size if times_world_size else loss).backward()                    # the fix
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        run.record(loss.detach(), params(), grads=grads, device_loss=loss.detach(), device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #212: the gathered loss backpropagated as it is."""
    _train(run, times_world_size=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #212: the gathered loss times the world size."""
    _train(run, times_world_size=True)
