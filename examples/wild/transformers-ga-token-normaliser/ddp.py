"""huggingface/transformers PR #34191 (and #35438, #37766), reproduced: a token loss normalised per micro-batch.

    tfpar compare examples/wild/transformers-ga-token-normaliser/case.json --impls examples/wild/transformers-ga-token-normaliser/ddp.py:full_batch,examples/wild/transformers-ga-token-normaliser/ddp.py:fixed,examples/wild/transformers-ga-token-normaliser/ddp.py:buggy

Origin (written anew, not copied): ``src/transformers/trainer.py``, ``Trainer.training_step`` before
PR #34191 (v4.45): the model's own loss, a cross-entropy averaged over the labelled tokens of *one*
micro-batch, then ``loss = loss / self.args.gradient_accumulation_steps`` before ``backward``; the
ranks' gradients averaged by DDP. Gradient accumulation is then not the full batch: a micro-batch with few
labelled tokens weighs as much as one with many (huggingface/blog PR #2414, "gradient_accumulation.md",
has the arithmetic). The fix (PR #34191) counts ``num_items_in_batch``, the labelled tokens of all the
step's micro-batches, sums each micro-batch's token losses and divides by it; #35438 and
``average_tokens_across_devices`` made the count global over the ranks, which is the full-batch mean
written here (sum over the rank's labelled rows / labelled rows over every rank and micro-batch, times N to
cancel DDP's average). Lines: ``training_step`` at L3591 ff. of ``src/transformers/trainer.py`` as the base
of PR #34198's diff shows it (its review thread's hunk ``@@ -3591,20 +3631,23 @@ def training_step``, the
``self.accelerator.backward(loss)`` and ``return loss.detach() / self.args.gradient_accumulation_steps``
before the fix); the base commit itself was not read (the repository snapshot, 1.3 GB, is more than can be
brought here); the arithmetic is the PR's and the blog's.

A row is a token; a row whose first feature (an integer 0..9 in the case's data) is 5 or more carries the
ignore label (``-100``): it adds nothing to the loss and is not counted, so micro-batches hold different
numbers of labelled tokens. The logged loss is what each version's trainer reports.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

NAMES = {"0.kernel": "0.weight", "0.bias": "0.bias", "1.kernel": "2.weight", "1.bias": "2.bias"}


def _labelled(x: np.ndarray) -> torch.Tensor:
    """The rows that carry a label (not -100): those whose first feature is below 5.

    (4.5, not 5: the tool reruns every side from inputs moved by one ulp, and ``5 - ulp < 5`` would flip a row.)
    """
    return torch.as_tensor(x[:, 0] < 4.5).reshape(-1, 1)


def _train(run, *, per_micro_batch: bool) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    model = DDP(net, process_group=run.group)
    named = dict(net.named_parameters())
    run.hook_gradients(model, {c: named[v] for c, v in NAMES.items()})
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    k, n = run.spec["parallel"].get("accumulate", 1), run.world_size
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        num_items_in_batch = _labelled(x).sum().to(run.torch_dtype)
        dist.all_reduce(num_items_in_batch, group=run.group)      # labelled tokens of the step, every rank
        objective = []
        for j, (xm, ym) in enumerate(zip(np.array_split(x, k), np.array_split(y, k), strict=True)):
            mask = _labelled(xm).to(run.torch_dtype)
            with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                tok = F.binary_cross_entropy_with_logits(model(torch.as_tensor(xm)), torch.as_tensor(ym), reduction="none")
                if per_micro_batch:   # before #34191: the micro-batch's own token mean, / accumulation steps
                    loss = (tok * mask).sum() / mask.sum().clamp(min=1) / k
                else:                 # after: summed, / the step's labelled tokens (x N: DDP averages)
                    loss = (tok * mask).sum() / num_items_in_batch * n
                loss.backward()
            objective.append(loss.detach())
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        opt.zero_grad()
        local = torch.stack(objective).sum()                      # what this rank's trainer accumulated
        logged = local.clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / n, params(), grads=grads, device_loss=local, device_inputs=x)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def buggy(run):
    """Before PR #34191: each micro-batch's token mean divided by the accumulation steps."""
    _train(run, per_micro_batch=True)


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def fixed(run):
    """After PR #34191 / #35438: the token losses summed and divided by the labelled tokens of the whole step."""
    _train(run, per_micro_batch=False)


@torchref.plugin.single(dtypes=("float32", "float64"))
def full_batch(run):
    """The definition of right: one process, the whole global batch, the mean over its labelled tokens."""
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)).to(run.torch_dtype)
    net.load_state_dict({t: torch.as_tensor(run.to_torch(run.initial[c])) for c, t in NAMES.items()})
    named = dict(net.named_parameters())
    opt = torch.optim.SGD(net.parameters(), lr=run.spec["optimizer"]["lr"])
    params = lambda: {c: run.to_tf(named[v].detach()) for c, v in NAMES.items()}  # noqa: E731
    run.begin(params())
    for x, y in run.batches():
        mask = _labelled(x).to(run.torch_dtype)
        tok = F.binary_cross_entropy_with_logits(net(torch.as_tensor(x)), torch.as_tensor(y), reduction="none")
        loss = (tok * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        grads = {c: run.to_tf(named[v].grad) for c, v in NAMES.items()}
        opt.step()
        run.record(loss.detach(), params(), grads=grads)
