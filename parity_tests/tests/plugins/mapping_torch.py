"""torch plugins for the judge's mapping tests (``test_mapping.py``): DDP ports of ``mapping_tf.py``.

No TensorFlow here: every rank of the pool imports this file. The MLP case of
``parity_tests/tests/helpers.py``, each rank's shard as ``run.batches()`` deals it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import torchref

BOTH = ("float32", "float64")
NAMES = {"0.kernel": "l0.weight", "0.bias": "l0.bias", "1.kernel": "l1.weight", "1.bias": "l1.bias"}
L2 = 1e-2  # mapping_tf.L2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(5, 10)
        self.l1 = torch.nn.Linear(10, 1)

    def forward(self, x):
        return self.l1(torch.relu(self.l0(x)))


def _train(run, make_opt, *, l2: float = 0.0, wrap: bool = True, decay: float = 0.0, after: bool = False,
           reduction: str | None = None, weighted: bool = False, by_size_only: bool = False) -> None:
    if by_size_only and run.spec["parallel"]["weighting"] != "by_size":  # a program written for one set-up
        raise ValueError(f"only by_size weighting is supported, not {run.spec['parallel']['weighting']}")
    net = Net().to(run.torch_dtype)
    net.load_state_dict({NAMES[k]: torch.as_tensor(run.to_torch(v)) for k, v in run.initial.items()})
    model = DDP(net, process_group=run.group) if wrap and run.group is not None else net
    opt = make_opt(model.parameters(), run.spec["optimizer"])
    named = dict(net.named_parameters())
    if isinstance(opt, torch.optim.Optimizer):  # --lockstep hands it the reference's state (else nothing happens)
        run.use_optimizer(opt, {k: named[v] for k, v in NAMES.items()})

    def params():
        return {k: run.to_tf(named[v]) for k, v in NAMES.items()}

    run.begin(params())
    # each rank's loss over its shard, as the case reduces it (DDP averages the ranks' gradients); ``reduction``: a bug
    reduction = reduction or run.spec["model"]["reduction"]
    # ``weighted``: the case's weighting read and honoured (by_size: a rank's loss scaled by N n_r / B before DDP's
    # mean); otherwise the plain mean over ranks, whatever the case says
    share = (run.world_size * len(run.shard()) / run.spec["data"]["global_batch"]
             if weighted and run.group is not None and run.spec["parallel"]["weighting"] == "by_size" else 1.0)
    for x, y in run.batches():
        opt.zero_grad()
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        loss = F.binary_cross_entropy_with_logits(model(x), y, reduction=reduction)
        loss = loss * share  # (the ranks' mean of it is the by_size-weighted loss)
        if l2:  # the L2 term of every rank's loss: DDP averages its gradient to itself
            loss = loss + l2 * (net.l0.weight.pow(2).sum() + net.l1.weight.pow(2).sum())
        loss.backward()
        applied = {k: run.to_tf(named[v].grad) for k, v in NAMES.items()}
        opt.step()
        if decay:  # a seeded bug: decoupled weight decay on every parameter, after the step
            with torch.no_grad():
                for p in net.parameters():
                    p.mul_(1 - run.spec["optimizer"]["lr"] * decay)
        logged = loss.detach().clone()
        if after:  # a seeded bug: the loss logged is the batch's loss after the update, not the one trained on
            with torch.no_grad():
                logged = F.binary_cross_entropy_with_logits(net(x), y, reduction=reduction)
        if run.group is not None:
            dist.all_reduce(logged, group=run.group)
            logged /= run.world_size
        run.record(logged, params(), grads=applied)


def _adam(params, o):
    return torch.optim.Adam(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["epsilon"])


def _adamw(params, o):
    return torch.optim.AdamW(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["epsilon"],
                             weight_decay=o["weight_decay"])


@torchref.plugin.distributed(dtypes=BOTH)
def adam_l2(run):
    """The faithful port of ``mapping_tf.keras_l2``: torch's Adam, the same L2 term in the loss."""
    _train(run, _adam, l2=L2)


@torchref.plugin.distributed(dtypes=BOTH)
def adam_l2_doubled(run):
    """``adam_l2`` with a seeded bug: the L2 factor doubled."""
    _train(run, _adam, l2=2 * L2)


@torchref.plugin.distributed(dtypes=BOTH)
def adamw(run):
    """DDP with torch's AdamW."""
    _train(run, _adamw)


@torchref.plugin.distributed(dtypes=BOTH)
def adamw_unwrapped(run):
    """As a public graph-network trainer did at one commit: the model is unwrapped before training, so no
    gradient is ever all-reduced and each rank trains on its own shard."""
    _train(run, _adamw, wrap=False)


class KerasAdamByHand:
    """Keras 3's Adam written out, as a port of a Keras program does it (no ``torch.optim`` class)::

        alpha = lr sqrt(1 - beta2^t) / (1 - beta1^t)
        m += (g - m)(1 - beta1);  v += (g^2 - v)(1 - beta2)
        p -= m alpha / (sqrt(v) + eps)                 # eps outside the bias correction (torch: inside)

    with the case's numbers exact (no float32 roundings of Keras' own class).
    """

    def __init__(self, params, o) -> None:
        self.params, self.o, self.t = list(params), o, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2, eps = self.o["beta1"], self.o["beta2"], self.o["epsilon"]
        alpha = self.o["lr"] * (1 - b2 ** self.t) ** 0.5 / (1 - b1 ** self.t)
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            m.add_((p.grad - m) * (1 - b1))
            v.add_((p.grad * p.grad - v) * (1 - b2))
            p.sub_(m * alpha / (v.sqrt() + eps))


@torchref.plugin.distributed(dtypes=BOTH)
def keras_adam_by_hand(run):
    """DDP with Keras' Adam rule written out (:class:`KerasAdamByHand`): a port of a Keras program."""
    _train(run, KerasAdamByHand)


@torchref.plugin.distributed(dtypes=BOTH)
def adam_default_eps(run):
    """DDP with ``torch.optim.Adam`` made without the case's epsilon (torch's default 1e-8): a port's bug."""
    _train(run, lambda params, o: torch.optim.Adam(params, lr=o["lr"], betas=(o["beta1"], o["beta2"])))


@torchref.plugin.distributed(dtypes=BOTH)
def adam(run):
    """DDP with torch's Adam at the case's values."""
    _train(run, _adam)


@torchref.plugin.distributed(dtypes=BOTH)
def adam_decayed(run):
    """``adam`` with a seeded optimizer bug: every parameter also decays by ``lr 1e-2`` after each step."""
    _train(run, _adam, decay=1e-2)


@torchref.plugin.distributed(dtypes=BOTH)
def adam_l2_default_eps(run):
    """``adam_l2`` with ``adam_default_eps``'s bug: the L2 term right, torch's default epsilon 1e-8."""
    _train(run, lambda params, o: torch.optim.Adam(params, lr=o["lr"], betas=(o["beta1"], o["beta2"])), l2=L2)


@torchref.plugin.distributed(dtypes=BOTH)
def adam_loss_after_update(run):
    """``adam`` with a seeded logging bug: the loss it logs is its batch's loss after the update (its parameters,
    and the gradients it records, are ``adam``'s)."""
    _train(run, _adam, after=True)


def _sgd(params, o):
    return torch.optim.SGD(params, lr=o["lr"])


@torchref.plugin.distributed(dtypes=BOTH)
def sgd(run):
    """DDP with ``torch.optim.SGD``, each rank's loss reduced as the case says."""
    _train(run, _sgd)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_shard_mean(run):
    """DDP with ``torch.optim.SGD`` and a seeded porting bug: each rank's loss is its shard's mean whatever the case
    says (the hunt's ``reduction_flipped``): under ``reduction: sum`` its gradient is 1/B of the full-batch sum on even
    shards, not the 1/N theory predicts for a correct DDP port."""
    _train(run, _sgd, reduction="mean")


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_l2(run):
    """The port of ``mapping_tf.keras_regularized``: ``torch.optim.SGD``, the same L2 term in every rank's loss
    (``1e-2 * w.pow(2).sum()``: the factor exact in float64, float32(1e-2) in float32, as torch multiplies)."""
    _train(run, _sgd, l2=L2)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_l2_off(run):
    """``sgd_l2`` with a seeded bug: the L2 factor 1% too large (the loss 4e-4 relative apart: far above the
    float32 noise, so a float32 constant on the other side must not hide it)."""
    _train(run, _sgd, l2=1.01 * L2)


@torchref.plugin.single(dtypes=BOTH)
def sgd_l2_single(run):
    """One process, the whole batch: ``torch.optim.SGD`` on the loss plus the L2 term no case field expresses."""
    _train(run, _sgd, l2=L2)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_l2_weighted(run):
    """DDP port of :func:`sgd_l2_single` that reads the case's ``parallel.weighting`` and honours it."""
    _train(run, _sgd, l2=L2, weighted=True)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_l2_weighted_shard_sum(run):
    """:func:`sgd_l2_weighted` with a seeded porting bug: each rank's loss is its shard's sum whatever the case says
    (the hunt's ``reduction_flipped`` under ``reduction: mean``)."""
    _train(run, _sgd, l2=L2, weighted=True, reduction="sum")


@torchref.plugin.single(dtypes=BOTH)
def sgd_single(run):
    """One process, the whole batch: ``torch.optim.SGD`` on the case's loss (a plugin that computes the case)."""
    _train(run, _sgd)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_weighted(run):
    """:func:`sgd` that reads the case's ``parallel.weighting`` and honours it (by_size: each rank's loss times
    N n_r / B before DDP's mean of the ranks' gradients)."""
    _train(run, _sgd, weighted=True)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_shard_mean_weighted(run):
    """``sgd_shard_mean`` honouring ``parallel.weighting`` (``by_size``: a rank's loss scaled by N n_r / B)."""
    _train(run, _sgd, reduction="mean", weighted=True)


@torchref.plugin.distributed(dtypes=BOTH)
def sgd_shard_mean_by_size_only(run):
    """``sgd_shard_mean_weighted`` that raises on any weighting but ``by_size`` (a program written for one set-up):
    the judge's rerun of it with ``weighting: equal`` (``session.scale_rerun``) fails, and the compare must not."""
    _train(run, _sgd, reduction="mean", weighted=True, by_size_only=True)
