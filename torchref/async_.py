"""``async`` on the torch side: a parameter server on rank 0, gradients computed by the ranks that own them.

The schedule is the one ``tfpar.async_`` defines (its docstring is the
definition; ``docs/combine-rules.md`` compares it with the other rules): step
k is N applications in the order ``orders[k]`` (``numpy.random.default_rng(
order_seed).permutation(N)``, drawn once per step), and the device at position
j computes its gradient on the step's version ``max(0, j - s)``.

How the job runs it, over the pool's gloo group (``ctx.group``), and why:
every device is a real rank that computes its own gradient in its own process
on the parameters it was sent, and one rank applies the updates, as an
asynchronous parameter server does; only the *timing* is replaced by the
schedule, so the run is deterministic and comparable update for update. (One
process replaying the schedule would compute the same numbers, but would not
exercise the communication an asynchronous job has.)

* rank 0 is the server: it holds the parameters, the one optimizer (and its
  learning-rate schedule: one ``optimizer.step()`` per application) and is
  also device 0;
* when version i of step k becomes current, and some device reads it, the
  server broadcasts the flat parameters (``dist.broadcast``); every device
  that reads version i computes ``l_r`` and ``g_r`` then (clipped with
  ``parallel.clip`` per_device, scaled by ``N w_r`` for ``by_size``);
* application i: device ``orders[k][i]`` sends its gradient to the server
  (``dist.send`` / ``dist.recv``; device 0 hands it over in place), which
  sets ``.grad`` and calls ``optimizer.step()``;
* at the end of the step an allreduce gives ``loss = sum_r w_r l_r``.

No DDP: nothing is averaged. Rank 0 returns
``{"loss": [steps], "param/<name>": [steps+1, ...]}``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from parity_tests.protocol.recorder import Recorder
from parity_tests.protocol.rows import set_spill_threshold, spill_threshold
from parity_tests.protocol.shards import application_orders, read_position, shard_rows

from .ddp import _arrays, _masks, _shard_loss
from .models import CaseModel
from .optimizers import clip_grads, make_optimizer, make_scheduler
from .pool import RankContext

__all__ = ["train_rank_async"]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def train_rank_async(ctx: RankContext, payload: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """One rank of an ``async`` job (rank 0: server and device 0); rank 0 returns the trajectory."""
    spec = payload["spec"]
    set_spill_threshold(int(payload.get("spill_bytes", spill_threshold())))  # the parent's, in this worker
    par, model_spec = spec["parallel"], spec["model"]
    n, r, group = ctx.world_size, ctx.rank, ctx.group
    if par["devices"] != n:
        raise ValueError(f"case asks for {par['devices']} devices but the job has {n} ranks")
    s = par["staleness"]
    dtype, x, y = _arrays(payload)
    masks = _masks(payload)
    model = CaseModel(model_spec["layers"], payload["init"], dtype)
    named = model.canonical()
    params = list(named.values())
    server = r == 0
    opt = make_optimizer(spec["optimizer"], params, named) if server else None
    sched = make_scheduler(spec["optimizer"], opt) if server else None
    clip = par.get("clip")  # validated: per_device only
    batch = spec["data"]["global_batch"]
    rows = [shard_rows(batch, n, q, par["shard"]) for q in range(n)]
    w = [1.0 / n] * n if par["weighting"] == "equal" else [len(ix) / batch for ix in rows]
    orders = application_orders(n, spec["steps"], par["order_seed"])
    numel = sum(p.numel() for p in params)
    rec = Recorder(((k, p.detach().numpy().copy()) for k, p in named.items()), grads=False)  # rows spill when large
    for k in range(spec["steps"]):
        ctx.beat()  # progress: the parent's timeout counts from the last step (torchref.pool)
        order = [int(d) for d in orders[k]]
        my_read = read_position(order.index(r), s)
        mine: torch.Tensor | None = None  # this device's gradient, flat, once computed
        l_r = torch.zeros((), dtype=dtype)
        for i in range(n):
            # version theta_{k,i} is current on the server; version 0 is always read, and
            # version i > 0 by the device at position i + s, if there is one
            if i == 0 or i + s < n:
                flat = _flat(params) if server else torch.empty(numel, dtype=dtype)
                dist.broadcast(flat, group=group, group_src=0)
                if not server:
                    torch.nn.utils.vector_to_parameters(flat, params)
            if my_read == i:
                loss = _shard_loss(model, model_spec, x, y, masks, torch.as_tensor(k * batch + rows[r]))
                for p in params:
                    p.grad = None
                loss.backward()
                if clip is not None:
                    clip_grads(params, clip["global_norm"], spec["optimizer"]["semantics"])
                mine = _flat([p.grad for p in params])
                if par["weighting"] == "by_size":
                    mine = mine * (n * w[r])
                l_r = loss.detach()
            d = order[i]  # application i: device d's gradient reaches the server
            if d == r and not server:
                dist.send(mine, group=group, group_dst=0)
            if server:
                if d == 0:
                    g = mine
                else:
                    g = torch.empty(numel, dtype=dtype)
                    dist.recv(g, group=group, group_src=d)
                offset = 0
                for p in params:
                    p.grad = g[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                opt.step()
                if sched is not None:
                    sched.step()
        loss_value = l_r * w[r]
        dist.all_reduce(loss_value, op=dist.ReduceOp.SUM, group=group)
        if server:
            rec.loss(loss_value.numpy().copy())
            for name, p in named.items():
                rec.param(name, p.detach().numpy().copy())
    if not server:
        return None
    return rec.finish()
