"""karpathy/llm.c d05e848, reproduced: ``require_backward_grad_sync`` toggled after the forward pass.

    tfpar compare examples/wild/llmc-sync-toggle-after-forward/case.json --impls examples/wild/llmc-sync-toggle-after-forward/ddp.py:fixed,examples/wild/llmc-sync-toggle-after-forward/ddp.py:buggy

Origin (written anew, not copied): karpathy/llm.c at 5379b1d, ``train_gpt2.py`` L808-823: the micro-step's
forward (``_, loss = model(x, y, ...)``, L809), then ``model.require_backward_grad_sync = (micro_step ==
grad_accum_steps - 1)`` (L821), then ``loss.backward()`` (L823). DDP reads the flag in its *forward*
(``_post_forward`` prepares the reducer for a synchronising backward only when it is set), so the flag
set after the forward acts one micro-step late: micro-step 0 runs with the previous step's ``True`` and
all-reduces, the last micro-step does not, and each rank steps with its own accumulated gradient: the
same arithmetic as FunASR PR #3472. Fixed in d05e848 (2024-06-17, "forward needs to know about
backward_grad_sync"), which moves the line before the forward. Found by this tool: the first version of
``llmc-loss-not-reduced`` kept the line where 5379b1d has it, and its "fixed" run was not in sync.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _train(run, *, toggle_after_forward: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    grad_accum_steps = run.spec["parallel"].get("accumulate", 1)
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        lossf = torch.zeros((), dtype=run.torch_dtype)
        for micro_step, (xm, ym) in enumerate(zip(np.array_split(x, grad_accum_steps), np.array_split(y, grad_accum_steps),
                                                  strict=True)):
            last = micro_step == grad_accum_steps - 1
            if not toggle_after_forward:
                model.require_backward_grad_sync = last          # d05e848: before the forward
            loss = F.binary_cross_entropy_with_logits(model(torch.as_tensor(xm)), torch.as_tensor(ym))
            loss = loss / grad_accum_steps
            lossf += loss.detach()
            if toggle_after_forward:
                model.require_backward_grad_sync = last          # 5379b1d L821: DDP has already decided
            loss.backward()
        dist.all_reduce(lossf, group=run.group)
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        run.record(lossf / run.world_size, params(), grads=grads)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """As at 5379b1d: the flag set between the forward and the backward."""
    _train(run, toggle_after_forward=True)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """As since d05e848: the flag set before the forward."""
    _train(run, toggle_after_forward=False)
