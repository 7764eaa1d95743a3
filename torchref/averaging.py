"""``param_mean`` on the torch side: local SGD with torch's own model averager, one model per rank.

Each rank of the job (``ctx.group``) trains its own ``CaseModel`` with its own
optimizer on its own shard (no DDP wrapper: DDP would average the gradients),
and the parameters are averaged across the ranks every ``period`` steps
(``tfpar.local_sgd`` states the rule; ``docs/combine-rules.md`` compares it
with the others).

``equal`` weighting uses ``torch.distributed.algorithms.model_averaging.
averagers.PeriodicModelAverager``, called after every ``optimizer.step()``.
Read from the installed source (torch 2.13):

* its counter ``step`` starts at 0 and is checked *before* it is incremented:
  call i (0-based) averages when ``i >= warmup_steps`` and
  ``(i - warmup_steps) % period == 0``. With ``warmup_steps=0`` it would
  average after steps 1, p+1, 2p+1, ...; ``warmup_steps = period - 1`` makes
  it average after steps p, 2p, ... (step k averages iff ``k % p == 0``),
  the rule of the case;
* it averages with ``flat /= world_size`` and an allreduce sum over the
  process group (``utils.average_parameters``), i.e. ``sum_r (theta_r / N)``,
  and only the parameters that have a ``.grad``; optimizer state is untouched;
* it has no weights: ``by_size`` (``sum_r w_r theta_r`` with w_r = n_r/B) is
  therefore done here with the same flatten / ``all_reduce`` / unflatten, each
  rank contributing ``w_r theta_r``.

Rank 0 records ``param/<name>[k] = sum_r w_r theta_r`` after step k (on an
averaging step its own, just averaged copy; otherwise an extra allreduce of
``w_r theta_r`` that only the recording needs) and ``loss[k-1] = sum_r w_r l_r``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.rows import set_spill_threshold, spill_threshold
from parity_tests.protocol.shards import shard_rows

from .ddp import _arrays, _masks, _shard_loss
from .models import CaseModel
from .optimizers import clip_grads, make_optimizer, make_scheduler
from .pool import RankContext

__all__ = ["weighted_average", "train_rank_param_mean"]


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def weighted_average(params: list[torch.Tensor], weight: float, group: dist.ProcessGroup, *,
                     assign: bool = True) -> torch.Tensor:
    """``sum_r w_r theta_r`` over the ranks of ``group`` (this rank contributes ``weight * theta``).

    Args:
        params: this rank's parameters (any shapes, one dtype).
        weight: this rank's ``w_r`` (the ranks' weights sum to 1).
        assign: write the average back into ``params`` (as the averager does).
    Returns:
        the flat average ``[sum of numels]``.
    """
    flat = _flat(params) * weight
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if assign:
        torch.nn.utils.vector_to_parameters(flat.clone(), params)
    return flat


def train_rank_param_mean(ctx: RankContext, payload: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """One rank of a ``param_mean`` job; rank 0 returns ``{"loss": [steps], "param/<name>": [steps+1, ...]}``."""
    spec = payload["spec"]
    set_spill_threshold(int(payload.get("spill_bytes", spill_threshold())))  # the parent's, in this worker
    par, model_spec = spec["parallel"], spec["model"]
    n, r = ctx.world_size, ctx.rank
    if par["devices"] != n:
        raise ValueError(f"case asks for {par['devices']} devices but the job has {n} ranks")
    period = par["period"]
    dtype, x, y = _arrays(payload)
    masks = _masks(payload)
    model = CaseModel(model_spec["layers"], payload["init"], dtype)
    opt = make_optimizer(spec["optimizer"], model.parameters(), model.canonical())
    sched = make_scheduler(spec["optimizer"], opt)
    clip = par.get("clip")  # validated: per_device only
    named = model.canonical()
    params = list(named.values())
    batch = spec["data"]["global_batch"]
    rows = [shard_rows(batch, n, q, par["shard"]) for q in range(n)]
    w = [1.0 / n] * n if par["weighting"] == "equal" else [len(ix) / batch for ix in rows]
    averager = None
    if par["weighting"] == "equal":
        with warnings.catch_warnings():
            # period 1 warns that DDP would be cheaper: true, and beside the point here
            warnings.simplefilter("ignore", UserWarning)
            averager = PeriodicModelAverager(period=period, warmup_steps=period - 1, process_group=ctx.group)
    rec = Recorder(((k, p.detach().numpy().copy()) for k, p in named.items()), grads=False)  # rows spill when large
    for k in range(spec["steps"]):
        ctx.beat()  # progress: the parent's timeout counts from the last step (torchref.pool)
        ix = torch.as_tensor(k * batch + rows[r])
        l_r = _shard_loss(model, model_spec, x, y, masks, ix)
        opt.zero_grad(set_to_none=True)
        l_r.backward()
        if clip is not None:
            clip_grads(model.parameters(), clip["global_norm"], spec["optimizer"]["semantics"])
        opt.step()
        if sched is not None:
            sched.step()
        averages = (k + 1) % period == 0  # what the averager decides too (module docstring)
        if averager is not None:
            averager.average_parameters(model.parameters())
        elif averages:
            weighted_average(params, w[r], ctx.group)
        loss_value = l_r.detach() * w[r]
        dist.all_reduce(loss_value, op=dist.ReduceOp.SUM, group=ctx.group)
        # the mean of the copies: after an average every copy holds it; otherwise gather it
        mean = _flat(params) if averages else weighted_average(params, w[r], ctx.group, assign=False)
        if r == 0:
            rec.loss(loss_value.numpy().copy())
            offset = 0
            for name, p in named.items():
                rec.param(name, mean[offset:offset + p.numel()].view_as(p).numpy().copy())
                offset += p.numel()
    if r != 0:
        return None
    return rec.finish()
