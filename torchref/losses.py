"""Per-rank losses, reduced over the elements of one rank's shard.

``semantics`` is the case's ``model.loss_semantics``: ``native`` and ``torch``
use torch's own loss functions, ``tf`` computes what Keras computes, in torch
ops. The formulas of both sides are in ``tfpar.losses`` and ``docs/layers.md``;
in short:

softmax_ce
    torch: ``F.cross_entropy(weight=cw, label_smoothing=s)``; ``mean`` divides by
    the sum of the targets' class weights. Keras divides by the number of
    examples and weights the whole smoothed example by its target's weight.
sigmoid_ce
    torch has no label smoothing for it: the labels are smoothed by hand as
    Keras does (``t = y (1 - s) + s / 2``), which is what a user porting the
    Keras loss writes. From probabilities: ``F.binary_cross_entropy`` (logs
    clamped at -100); Keras in the tower engine recovers the logits from the
    final sigmoid, so ``tf`` semantics uses ``F.binary_cross_entropy_with_logits``
    on the pre-sigmoid values.

.. warning:: with class weights, torch's ``mean`` and Keras' differ by the
   factor ``n / sum_i w_i``, per device: under DDP each rank divides by its own
   shard's weight sum, so even torch.ddp and torch.single differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .tokens import flatten_tokens, ignore_label_ce

__all__ = ["shard_loss", "model_loss"]


def _keras_softmax(out: torch.Tensor, y: torch.Tensor, reduction: str, smoothing: float, cw: torch.Tensor | None) -> torch.Tensor:
    """Keras' ``CategoricalCrossentropy(label_smoothing=s)`` with ``sample_weight = cw[y]``, in torch ops."""
    k = out.shape[-1]
    t = F.one_hot(y, k).to(out.dtype) * (1.0 - smoothing) + smoothing / k
    per = -(t * F.log_softmax(out, dim=-1)).sum(dim=-1)  # [n]
    if cw is not None:
        per = per * cw[y]
    return per.sum() / per.shape[0] if reduction == "mean" else per.sum()


def shard_loss(
    loss: str,
    reduction: str,
    out: torch.Tensor,
    y: torch.Tensor,
    *,
    from_logits: bool = True,
    label_smoothing: float = 0.0,
    class_weights: Sequence[float] | None = None,
    semantics: str = "native",
    logits: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
    ignore_label: int | None = None,
) -> torch.Tensor:
    """The loss of one shard.

    Args:
        loss: ``mse``, ``sigmoid_ce`` (logits, or probabilities when
            ``from_logits`` is false; labels like ``out``) or ``softmax_ce``
            (logits ``[n, k]``, int64 labels ``[n]``).
        reduction: ``mean`` or ``sum``.
        from_logits, label_smoothing, class_weights, semantics: the case's ``model`` options.
        logits: the pre-sigmoid values of ``out`` (needed for ``from_logits: false``
            with ``tf`` semantics, where Keras uses the logits).
        sample_weight: ``[n]`` per-example weights, or ``None``. torch has no
            ``sample_weight`` argument: the ``native``/``torch`` rule is the idiom
            ``(v * l).sum() / v.sum()`` (per element: divided by ``k sum v``);
            ``tf`` is Keras' ``sum_over_batch_size`` (divided by ``n k``).
            See ``tfpar.losses`` for the formulas.
        ignore_label: ``softmax_ce``'s excluded label (``ignore_index``), or ``None``. ``softmax_ce``
            also takes per-token logits ``[n, ..., k]`` with labels ``[n, ...]``.
    Returns:
        a scalar.
    """
    if sample_weight is not None:
        per = shard_loss(loss, "none", out, y, from_logits=from_logits, semantics=semantics, logits=logits)
        return _weighted(per, sample_weight, reduction, "tf" if semantics == "tf" else "torch")
    if loss == "mse":
        return F.mse_loss(out, y, reduction=reduction)
    if loss == "sigmoid_ce":
        t = y * (1.0 - label_smoothing) + 0.5 * label_smoothing if label_smoothing else y
        if from_logits:
            return F.binary_cross_entropy_with_logits(out, t, reduction=reduction)
        if semantics == "tf":
            if logits is None:
                raise ValueError("sigmoid_ce on probabilities with tf semantics needs the pre-sigmoid logits")
            return F.binary_cross_entropy_with_logits(logits, t, reduction=reduction)
        return F.binary_cross_entropy(out, t, reduction=reduction)
    if loss != "softmax_ce":
        raise ValueError(f"unknown loss {loss!r}")
    out, y = flatten_tokens(out, y)  # per-token logits [n, ..., k]: every position (torchref.tokens)
    if ignore_label is not None:
        return ignore_label_ce(out, y, ignore_label, reduction)
    cw = None if class_weights is None else torch.tensor(list(class_weights), dtype=out.dtype)
    if semantics == "tf" and (label_smoothing or cw is not None):
        return _keras_softmax(out, y, reduction, label_smoothing, cw)
    return F.cross_entropy(out, y, weight=cw, label_smoothing=label_smoothing, reduction=reduction)


def _weighted(per: torch.Tensor, v: torch.Tensor, reduction: str, rule: str) -> torch.Tensor:
    """Per-example weighted mean or sum of the elementwise losses ``per`` ``[n, ...]``."""
    vb = v.to(per.dtype).reshape(-1, *([1] * (per.dim() - 1)))
    total = (vb * per).sum()
    if reduction == "sum":
        return total
    if rule == "tf":  # Keras' sum_over_batch_size: divided by the number of elements
        return total / per.numel()
    return total / (vb.sum() * (per.numel() // per.shape[0]))


def model_loss(model: Mapping[str, Any], out: torch.Tensor, y: torch.Tensor, logits: torch.Tensor | None = None,
               sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`shard_loss` with every option read from a validated ``model`` section.

    Mixed precision: bfloat16 outputs (a last layer without a float32 bias, or a conv)
    are cast to float32 first, so the loss is float32 whatever the last op returned
    (torch's CPU autocast would run most losses in float32 anyway; this does not
    depend on the op list).
    """
    if out.dtype == torch.bfloat16:
        out = out.float()
    if logits is not None and logits.dtype == torch.bfloat16:
        logits = logits.float()
    return shard_loss(
        model["loss"], model["reduction"], out, y,
        from_logits=model.get("from_logits", True),
        label_smoothing=model.get("label_smoothing", 0.0),
        class_weights=model.get("class_weights"),
        semantics=model.get("loss_semantics", "native"),
        logits=logits,
        sample_weight=sample_weight,
        ignore_label=model.get("ignore_label"),
    )
