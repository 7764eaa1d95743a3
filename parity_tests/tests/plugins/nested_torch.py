"""A torch DDP port of a nested case (a residual block repeated) built from ``torchref.models.CaseModel``, with
one layer computing something else (``test_paths.py``): the forward stage must name that block's layer.

``planted_epsilon``: the layer norm of repeat copy 2's residual body (path ``1.2.0.body.1``) uses Keras'
default epsilon 1e-3 where the case says torch's 1e-5, the mistake a port makes in one block. ``good``:
the case as it is. Both pass their layer outputs by path (``CaseModel.trace``) as ``activations=``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref
from torchref.losses import model_loss
from torchref.models import CaseModel

PLANTED = "1.2.0.body.1"


def _train(run, planted: str | None) -> None:
    model = CaseModel(run.spec["model"]["layers"], run.initial, run.torch_dtype)
    layer = model._layer

    def _layer(path, spec, h):  # noqa: ANN001, ANN202
        return layer(path, {**spec, "epsilon": 1e-3} if path == planted else spec, h)

    model._layer = _layer
    ddp = DDP(model, process_group=run.group)
    params = model.canonical()  # canonical names and layouts already: no run.to_tf
    opt = torch.optim.SGD(ddp.parameters(), lr=run.spec["optimizer"]["lr"])
    run.layer_hooks = False
    run.begin({k: p.detach().numpy().copy() for k, p in params.items()})
    for step, (x, y) in enumerate(run.batches(), start=run.first_step):
        model.trace = {} if step == run.capture_step else None
        opt.zero_grad()
        loss = model_loss(run.spec["model"], ddp(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()  # equal shards: the mean of the ranks' losses is the global loss
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, {k: p.detach().numpy().copy() for k, p in params.items()},
                   activations=model.trace, device_loss=loss, device_inputs=x)
        model.trace = None


@torchref.plugin.distributed(dtypes=("float64",))
def good(run) -> None:
    _train(run, None)


@torchref.plugin.distributed(dtypes=("float64",))
def planted_epsilon(run) -> None:
    _train(run, PLANTED)
