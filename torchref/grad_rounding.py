"""The identity whose backward rounds the gradient to bfloat16: the float64 run of ``protocol.grad_rounding``.

``torch.ddp`` and ``torch.single`` (:mod:`torchref.ddp`) make it, in the float64 run a payload's ``grads_bf16``
asks for, where torch's CPU autocast recipe rounds (``torchref.models``, ``torchref.losses.model_loss``): on the
model output before the loss (the recipe's ``float()`` of a bfloat16 output: its backward rounds ``dL/dout``, at
the scale ``s_r`` the rank differentiates its loss), and on every parameter's gradient of each backward (the
recipe's ``F.linear`` reads the float32 parameter cast to bfloat16: the rank's gradient is a bfloat16 result, cast
back to float32 before DDP's float32 all-reduce). A hook on a leaf runs before its gradient is accumulated, so
before DDP's bucket all-reduce, once per backward (per micro-batch). The forward pass is the float64 run's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["bf16_round", "bf16_gradient", "round_parameter_gradients"]


def bf16_round(g: torch.Tensor) -> torch.Tensor:
    """``g`` rounded to float32 and then to bfloat16 (to nearest, ties to even), in ``g``'s dtype: what the mixed
    run's float32 gradient meets at its cast to bfloat16."""
    return g.to(torch.float32).to(torch.bfloat16).to(g.dtype)


class _BF16Gradient(torch.autograd.Function):
    """The identity forward; the gradient rounded by :func:`bf16_round` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001  (autograd's context)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return bf16_round(g)


def bf16_gradient(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, whose gradient is rounded to bfloat16 on its way back (module docstring)."""
    return _BF16Gradient.apply(x)


def round_parameter_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Round every gradient each backward computes for ``params`` to bfloat16 before it is accumulated."""
    for p in params:
        p.register_hook(bf16_round)
