"""torch loops for the error-rate hunt: DDP, a hand all-reduce, one process, and seeded bugs (no TensorFlow here).

One loop, :func:`_train`, honours the case it is given within
:data:`parity_tests.tests.hunt.corpus.TORCH_SUPPORTS` (the same set as
``tf_side.py``): an ``nn.Sequential`` of ``Linear`` layers and activation
modules; ``mse`` / ``sigmoid_ce`` / ``softmax_ce`` through ``torch.nn.functional``
with the case's reduction; ``float32`` or ``float64``; ``sgd``, ``momentum`` or
``adam`` under ``semantics`` ``torch``/``native`` (``torch.optim.SGD`` and
``torch.optim.Adam`` themselves) or ``tf`` (Keras' rules written out in torch
ops, see ``tf_side.py``); a constant rate or the contract's ``warmup_cosine``
(:func:`_scheduler`: torch's own ``SequentialLR(LinearLR, CosineAnnealingLR,
ConstantLR)`` under ``native`` in :func:`ddp` and :func:`single`, a ``LambdaLR`` of
the contract's formula otherwise, the formula itself in Keras' written-out rule:
step ``t`` at ``f(t)`` in every case, torch's schedulers within rounding of it);
``weighting`` ``by_size`` by scaling a rank's loss by
``N n_r / B`` before DDP's mean; a global-norm clip after the all-reduce or per
device (before it: the rank's own gradient clipped under ``no_sync``, then
all-reduced by hand), by the semantics' rule (``clip_grad_norm_``, which adds
1e-6 to the norm, or TensorFlow's ``c / max(n, c)``). The logged loss is the
weighted mean of the ranks' losses (an all-reduce); the applied gradient is
recorded (``grads=``).

Rewrites: :func:`ddp` (``DistributedDataParallel``), :func:`hand_allreduce` (no DDP
wrapper: each gradient ``all_reduce``d and divided by hand), :func:`single`
(``@torchref.plugin.single``: one process, the whole batch) and :func:`ddp_f32`
(float32 only). Every other plugin is :func:`ddp` (or :func:`hand_allreduce`)
with one seeded bug, marked in :func:`_train` with its name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref
from parity_tests.tests.hunt.schedule import curve, drawn

__all__: list[str] = []

DTYPES = ("float32", "float64")
_ACT = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "sigmoid": torch.nn.Sigmoid}


def _build(run) -> tuple[torch.nn.Module, dict]:
    """The case's dense model, loaded from ``run.initial``; canonical -> torch names."""
    mods, names = [], {}
    width = run.spec["model"]["input_shape"][0]
    for i, layer in enumerate(run.spec["model"]["layers"]):
        j = len(mods)
        bias = layer.get("use_bias", True)
        mods.append(torch.nn.Linear(width, layer["units"], bias=bias))
        names[f"{i}.kernel"] = f"{j}.weight"
        if bias:
            names[f"{i}.bias"] = f"{j}.bias"
        width = layer["units"]
        act = _ACT.get(layer.get("activation", "none"))
        if act is not None:
            mods.append(act())
    net = torch.nn.Sequential(*mods).to(run.torch_dtype)
    net.load_state_dict({tn: torch.as_tensor(run.to_torch(run.initial[cn])) for cn, tn in names.items()})
    return net, names


def _loss(out: torch.Tensor, y, loss: str, reduction: str) -> torch.Tensor:
    y = torch.as_tensor(y)
    if loss == "softmax_ce":
        return F.cross_entropy(out, y, reduction=reduction)
    if loss == "sigmoid_ce":
        return F.binary_cross_entropy_with_logits(out, y, reduction=reduction)
    return F.mse_loss(out, y, reduction=reduction)


def _clip(params: list, c: float, rule: str) -> None:
    """Global-norm clip in place: ``torch`` (``clip_grad_norm_``) or ``tf`` (``g c / max(n, c)``)."""
    if rule == "torch":
        torch.nn.utils.clip_grad_norm_(params, c)
        return
    norm = torch.sqrt(sum((p.grad * p.grad).sum() for p in params))
    scale = c * torch.minimum(1.0 / norm, torch.tensor(1.0 / c, dtype=norm.dtype))
    for p in params:
        p.grad.mul_(scale)


class _KerasRule:
    """Keras' SGD / momentum / Adam update written out in torch ops (``semantics: tf``)."""

    def __init__(self, params: list, opt: dict) -> None:
        self.params, self.opt, self.t = params, opt, 0
        self.schedule = drawn(opt)
        self.a = [torch.zeros_like(p) for p in params]
        self.b = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        o, t = self.opt, self.t
        lr = o["lr"] if self.schedule is None else curve(self.schedule, o["lr"], t)
        for p, a, b in zip(self.params, self.a, self.b, strict=True):
            g = p.grad
            if o["name"] == "sgd":
                p.sub_(lr * g)
            elif o["name"] == "momentum":
                a.copy_(o["momentum"] * a - lr * g)
                p.add_(a)
            else:
                b1, b2, eps = o["beta1"], o["beta2"], o["epsilon"]
                a.copy_(b1 * a + (1.0 - b1) * g)
                b.copy_(b2 * b + (1.0 - b2) * g * g)
                one = torch.ones((), dtype=p.dtype)
                alpha = lr * torch.sqrt(one - torch.tensor(b2, dtype=p.dtype) ** t) / (
                    one - torch.tensor(b1, dtype=p.dtype) ** t)
                p.sub_(alpha * a / (torch.sqrt(b) + eps))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _optimizer(params: list, opt: dict):
    if opt["semantics"] == "tf":
        return _KerasRule(params, opt)
    if opt["name"] == "adam":
        return torch.optim.Adam(params, lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["epsilon"])
    return torch.optim.SGD(params, lr=opt["lr"], momentum=opt.get("momentum", 0.0))


def _scheduler(optimizer, opt: dict, how: str):
    """The case's ``warmup_cosine`` as torch schedulers (stepped once after each step), ``None`` where there is none.

    Keras' written-out rule (``semantics: tf``) reads the formula itself. Under ``native`` in
    :func:`ddp` / :func:`single`: torch's own classes as a user chains them, ``LinearLR`` from
    ``lr / k`` to ``lr`` over steps 1..k (left out for ``k = 1``), ``CosineAnnealingLR(T_max=d,
    eta_min=m)`` from step ``k``, ``ConstantLR(factor=m / lr)`` from step ``k + d`` (the cosine alone
    climbs back after ``T_max``); elsewhere a ``LambdaLR`` whose factor after ``e`` steps is
    ``f(e + 1) / lr``.
    """
    sched = drawn(opt)
    if sched is None or opt["semantics"] == "tf":
        return None
    lr = opt["lr"]
    lrs = torch.optim.lr_scheduler
    if opt["semantics"] == "native" and how != "hand_allreduce":
        k, d, m = sched["warmup_steps"], sched["decay_steps"], sched["min_lr"]
        parts, milestones = [], []
        if k > 1:
            parts.append(lrs.LinearLR(optimizer, start_factor=1.0 / k, end_factor=1.0, total_iters=k - 1))
            milestones.append(k - 1)
        parts.append(lrs.CosineAnnealingLR(optimizer, T_max=d, eta_min=m))
        milestones.append(k - 1 + d)
        parts.append(lrs.ConstantLR(optimizer, factor=m / lr, total_iters=2**62))  # held at m for good
        return lrs.SequentialLR(optimizer, parts, milestones)
    return lrs.LambdaLR(optimizer, lambda e: curve(sched, lr, e + 1) / lr)


def _shard_rows(batch: int, n: int, rank: int, how: str):
    import numpy as np

    if how == "strided":
        return np.arange(rank, batch, n)
    return np.array_split(np.arange(batch), n)[rank]


def _train(run, how: str = "ddp", bug: str | None = None, l2: float = 0.0) -> None:  # noqa: C901 (one loop, every mutation marked)
    spec = run.spec
    model, par, opt = spec["model"], spec["parallel"], spec["optimizer"]
    n, rank, batch = run.world_size, run.rank, spec["data"]["global_batch"]
    rule = "tf" if opt["semantics"] == "tf" else "torch"
    clip = par.get("clip")
    per_device = clip is not None and clip["where"] == "per_device" and how != "single"
    net, names = _build(run)
    params = list(net.parameters())
    wrapped = DDP(net, process_group=run.group) if how == "ddp" else net
    optimizer = _optimizer(params, opt)
    scheduler = _scheduler(optimizer, opt, how)
    named = dict(net.named_parameters())

    kernels = [named[v] for k, v in names.items() if k.endswith(".kernel")]

    def penalised(loss: torch.Tensor) -> torch.Tensor:
        """``loss + l2 sum ||W||^2`` over the kernels (Keras' ``regularizers.L2``): a term the case cannot express."""
        return loss + l2 * sum((k * k).sum() for k in kernels) if l2 else loss

    def current() -> dict:
        return {k: run.to_tf(named[v].detach()) for k, v in names.items()}

    run.begin(current())
    rows = _shard_rows(batch, n, 0 if bug == "same_shard" else rank, par["shard"]) if how != "single" else None
    size = len(run.shard()) if how != "single" else batch
    share = size / batch if par["weighting"] == "by_size" and bug != "by_size_ignored" else 1.0 / n
    for t, (xg, yg) in enumerate(run.global_batches(), start=1):
        x, y = (xg, yg) if rows is None else (xg[rows], yg[rows])
        optimizer.zero_grad()
        if per_device and how == "ddp":
            with wrapped.no_sync():  # DDP skips its all-reduce: the rank's own gradient, clipped, then combined by hand
                loss = penalised(_loss(wrapped(torch.as_tensor(x)), y, model["loss"], model["reduction"]))
                loss.backward()
        else:
            loss = penalised(_loss(wrapped(torch.as_tensor(x)), y, model["loss"], model["reduction"]))
            objective = loss * (n * share) if how == "ddp" else loss
            if bug == "loss_times_world_size":  # "DDP averages, I want the sum"
                objective = objective * n
            objective.backward()
        if per_device:
            _clip(params, clip["global_norm"], rule)
        if per_device or how == "hand_allreduce":
            for p in params:
                if bug == "no_allreduce":  # each rank steps on its own gradient
                    continue
                p.grad.mul_(n * share)  # the rank's weight times N: the sum over ranks / N is the weighted sum
                dist.all_reduce(p.grad, group=run.group)
                if bug != "allreduce_no_divide":  # the division by the world size forgotten
                    p.grad.div_(n)
        if clip is not None and not per_device:
            _clip(params, clip["global_norm"], rule)
        grads = {k: run.to_tf(named[v].grad.detach()) for k, v in names.items()}
        if not (bug == "replica_skips_update" and rank == n - 1 and t == 2):  # the last rank skips step 2
            optimizer.step()
        if scheduler is not None:  # stepped every step, also where the bug skipped the optimizer's
            scheduler.step()
        # ---- what is logged (the wrong-loss bugs record no grads=)
        if how == "single":
            run.record(loss.detach(), current(), grads=grads)
            continue
        logged = loss.detach() * share
        if bug == "rank0_loss":  # each rank logs its own shard's loss; rank 0's is what is reported
            run.record(loss.detach(), current())
        elif bug == "last_rank_loss":
            last = loss.detach().clone()
            dist.broadcast(last, src=n - 1, group=run.group)
            run.record(last, current())
        elif bug == "ranks_sum_loss":
            total = loss.detach().clone()
            dist.all_reduce(total, group=run.group)
            run.record(total, current())
        elif bug == "loss_after_update_torch":
            with torch.no_grad():
                again = _loss(net(torch.as_tensor(x)), y, model["loss"], model["reduction"]) * share
            dist.all_reduce(again, group=run.group)
            run.record(again, current())
        else:
            dist.all_reduce(logged, group=run.group)
            run.record(logged, current(), grads=grads)


# ------------------------------------------------------------------ equivalent rewrites


@torchref.plugin.distributed(dtypes=DTYPES)
def ddp(run):
    """``DistributedDataParallel``: the all-reduce mean of the ranks' gradients, one update on every rank."""
    _train(run, "ddp")


@torchref.plugin.distributed(dtypes=DTYPES)
def hand_allreduce(run):
    """No DDP wrapper: after ``backward()`` each gradient is weighted, ``all_reduce``d (sum) and divided by N."""
    _train(run, "hand_allreduce")


@torchref.plugin.single(dtypes=DTYPES)
def single(run):
    """One process, the whole global batch."""
    _train(run, "single")


@torchref.plugin.distributed(dtypes=DTYPES)
def ddp_l2(run):
    """:func:`ddp` with ``2^-10 sum ||W||^2`` over the kernels added to each rank's loss: the port of
    ``programs.keras_fit_l2`` (Keras' ``kernel_regularizer=L2(2**-10)``), a term the case cannot express."""
    _train(run, "ddp", l2=2.0**-10)


@torchref.plugin.distributed(dtypes=DTYPES)
def ddp_l2_user(run):
    """:func:`ddp` with ``1e-3 sum ||W||^2`` over the kernels: the port of ``programs.keras_fit_l2_user``
    (Keras' ``L2(1e-3)``, which Keras holds as float32(1e-3) in a float64 run; this port holds 1e-3)."""
    _train(run, "ddp", l2=1e-3)


@torchref.plugin.distributed(dtypes=("float32",))
def ddp_f32(run):
    """:func:`ddp` declaring float32 only: a pair with it is judged by the perturbation floor."""
    _train(run, "ddp")


# ------------------------------------------------------------------ seeded bugs


def _bug(name: str, how: str, doc: str):
    def plugin(run):
        _train(run, how, name)

    plugin.__name__ = plugin.__qualname__ = name
    plugin.__doc__ = doc
    return torchref.plugin.distributed(dtypes=DTYPES)(plugin)


loss_times_world_size = _bug("loss_times_world_size", "ddp", "The loss times the world size before backward().")
replica_skips_update = _bug("replica_skips_update", "ddp", "The last rank skips the optimizer step of step 2.")
same_shard = _bug("same_shard", "ddp", "Every rank reads rank 0's rows (a sampler without the rank).")
by_size_ignored = _bug("by_size_ignored", "ddp", "A plain mean over ranks where by_size (n_r / B) is asked.")
allreduce_no_divide = _bug("allreduce_no_divide", "hand_allreduce", "The hand all-reduce's division by N forgotten.")
no_allreduce = _bug("no_allreduce", "hand_allreduce", "No all-reduce: each rank applies its own gradient.")
rank0_loss = _bug("rank0_loss", "ddp", "Rank 0's own shard's loss logged as the step's (no grads=).")
last_rank_loss = _bug("last_rank_loss", "ddp", "The last rank's loss logged as the step's (no grads=).")
ranks_sum_loss = _bug("ranks_sum_loss", "ddp", "The ranks' losses summed, not averaged, in the log (no grads=).")
loss_after_update_torch = _bug("loss_after_update_torch", "ddp", "The loss logged is evaluated after the update (no grads=).")
