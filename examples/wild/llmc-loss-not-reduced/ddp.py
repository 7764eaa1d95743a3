"""karpathy/llm.c PR #551, reproduced: the PyTorch reference logs rank 0's loss, never reduced over the ranks.

    tfpar compare examples/wild/llmc-loss-not-reduced/case.json --impls examples/wild/llmc-loss-not-reduced/ddp.py:fixed,examples/wild/llmc-loss-not-reduced/ddp.py:buggy

Origin (written anew, not copied): karpathy/llm.c at 5379b1d (the parent of the merge 894ada5 of PR #551),
``train_gpt2.py``: L800 ``lossf = 0.0``, L814-815 ``loss = loss / grad_accum_steps`` and ``lossf +=
loss.item()`` per micro-step, L844 ``print0(... train loss {lossf:.6f} ...)``: rank 0 prints its own
shard's mean. The C code
reduced its loss before printing, so the two looked apart ("caused us to think we have a divergence between
implementations"). The fix all-reduces ``lossf`` (``ReduceOp.AVG``) before printing. The training itself is
right in both: the tool must say ``record`` (what was logged), not a computation.
"""

from __future__ import annotations

import numpy as np
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
    grad_accum_steps = run.spec["parallel"].get("accumulate", 1)
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        lossf = torch.zeros((), dtype=run.torch_dtype)
        for micro_step, (xm, ym) in enumerate(zip(np.array_split(x, grad_accum_steps), np.array_split(y, grad_accum_steps),
                                                  strict=True)):
            # before the forward, as llm.c has it since d05e848 (at 5379b1d it came after the forward, a second
            # bug: examples/wild/llmc-sync-toggle-after-forward; here only the logging differs)
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
            loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(xm)), torch.as_tensor(ym))
            loss = loss / grad_accum_steps
            lossf += loss.detach()                                   # L815
            loss.backward()
        local = lossf.clone()
        if reduce_logged:                                            # the fix: all_reduce(lossf, AVG)
            dist.all_reduce(lossf, group=run.group)
            lossf /= run.world_size
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        # the logged loss: rank 0's print0 (every rank records; the trajectory the tool reads is rank 0's)
        run.record(lossf, params(), grads=grads, device_loss=local, device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #551: ``lossf += loss.item()``, printed by rank 0 as it is."""
    _train(run, reduce_logged=False)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #551: ``dist.all_reduce(lossf, op=AVG)`` before printing."""
    _train(run, reduce_logged=True)
