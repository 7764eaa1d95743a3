"""tfpar compare examples/real/ddp-tutorial-multigpu/case.json --impls examples/real/ddp-tutorial-multigpu/torch_multigpu.py:multigpu,examples/real/ddp-tutorial-multigpu/tf_towers.py:towers

A port of pytorch/examples ``distributed/ddp-tutorial-series/multigpu.py``
(https://github.com/pytorch/examples, commit a308b4e97459b07c1b356642b2a8b4206c6d6de1,
the last commit to touch that file; snapshot HEAD 77f55b912142e11fcfdf5b530231fb9c52f181e8)
as a tfpar torch plugin. Original line numbers are those of that commit.

The program (lines 24-88): ``load_train_objs`` builds ``torch.nn.Linear(20, 1)`` and
``torch.optim.SGD(model.parameters(), lr=1e-3)``; ``Trainer`` wraps the model in
``DDP(model, device_ids=[gpu_id])``; ``_run_batch`` (lines 40-45) is ``zero_grad``,
forward, ``F.cross_entropy(output, targets)``, ``backward``, ``step``; ``_run_epoch``
feeds the batches of a ``DataLoader`` over ``DistributedSampler(dataset)`` (shuffled,
seed 0, ``set_epoch(epoch)``), ``batch_size`` rows per rank.

What differs from the original, and why (the training step itself is unchanged):

* the process group: the tool's (gloo on CPU, the default group while the plugin runs)
  instead of ``ddp_setup``'s NCCL group on ``cuda:rank``: ``DDP(model)`` without
  ``device_ids=[gpu_id]``;
* the model is built in the case dtype and loaded with the case's initial weights
  (``init.npz``; torch's own ``Linear`` initialisation drawn once in numpy) so that
  both sides start from the same numbers;
* the data: the case's rows (``MyTrainDataset``'s kind, ``rand(20)``, ``rand(1)``) in
  the order the program's ``DistributedSampler`` reads them in epoch 0; ``run.batches()``
  stands for the ``DataLoader`` (``make_case.py`` says how the order was reproduced);
* the program logs no loss; the glue records each step's loss as the mean over ranks
  (what a tower program logs) and the gradient DDP applied;
* no checkpoint is saved (``_save_checkpoint``), nothing is printed.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref


# --------------------------------------------------------------------------------------------
# The program (multigpu.py lines 24-45 and 69-73), rewritten; changed lines marked "tfpar:".
# --------------------------------------------------------------------------------------------
class Trainer:
    """The original's ``Trainer``: the DDP model and its optimizer; one batch per ``_run_batch``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = DDP(model)                       # tfpar: changed (device_ids=[gpu_id]: a CPU rank)
        self.optimizer = optimizer

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        output = self.model(source)                   # [n, 1]
        loss = F.cross_entropy(output, targets)       # targets [n, 1] float: class probabilities
        loss.backward()
        self.optimizer.step()
        return loss                                   # tfpar: changed (returned, for the record)


def load_train_objs(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(20, 1, dtype=dtype)       # tfpar: changed (dtype= the case's)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, optimizer


# --------------------------------------------------------------------------------------------
# Glue: the case's weights in, the case's batches through, every step recorded.
# --------------------------------------------------------------------------------------------
@torchref.plugin.distributed(dtypes=("float32", "float64"))
def multigpu(run):
    model, optimizer = load_train_objs(run.torch_dtype)
    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(run.to_torch(run.initial["weight"], layout="dense")))
        model.bias.copy_(torch.as_tensor(run.initial["bias"]))
    trainer = Trainer(model, optimizer)

    def params():
        return {"weight": run.to_tf(model.weight.detach(), layout="dense"), "bias": model.bias.detach()}

    run.begin(params())
    for source, targets in run.batches():
        loss = trainer._run_batch(torch.as_tensor(source), torch.as_tensor(targets))
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        run.record(logged / run.world_size, params(),
                   grads={"weight": run.to_tf(model.weight.grad, layout="dense"), "bias": model.bias.grad})
