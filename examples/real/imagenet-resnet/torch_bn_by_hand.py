"""tfpar compare examples/real/imagenet-resnet/case.json --impls examples/real/imagenet-resnet/torch_main.py:main_worker_ddp_mean_loss,examples/real/imagenet-resnet/torch_bn_by_hand.py:main_worker_ddp_mean_loss_bn_by_hand

A check, not a port: ``torch_main.py:main_worker_ddp_mean_loss`` with every batch norm computed
by hand (the same formula as ``nn.BatchNorm2d`` in training, in other operations, so rounded
differently). Two torch programs that compute the same thing: whatever separates them is
rounding, and its size says how much rounding this model amplifies. README.md ("At the
original size") uses it to show that a float64 divergence of the tower port at resnet18's size
on 4 devices is rounding: batch norm over the 2 values of a 1x1 feature map on 2 rows a rank.

No TensorFlow import here: every rank imports this file.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
from torch import nn

import torchref

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_main  # noqa: E402


def _batch_norm_by_hand(self: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    """``nn.BatchNorm2d`` in training: batch statistics (biased variance), running ones (unbiased), momentum 0.1."""
    channel = (None, slice(None), None, None)
    n = x.numel() // x.shape[1]
    mean = x.mean(dim=(0, 2, 3))
    var = ((x - mean[channel]) ** 2).mean(dim=(0, 2, 3))
    with torch.no_grad():
        self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
        self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
    return (x - mean[channel]) / torch.sqrt(var + self.eps)[channel] * self.weight[channel] + self.bias[channel]


def _model_by_hand(run) -> nn.Module:
    model = _original_model(run)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.forward = types.MethodType(_batch_norm_by_hand, module)
    return model


_original_model = torch_main._case_resnet18


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def main_worker_ddp_mean_loss_bn_by_hand(run):
    torch_main._case_resnet18 = _model_by_hand  # this rank's module only; put back below
    try:
        torch_main._main_worker(run, use_ddp=True, mean_loss=True)
    finally:
        torch_main._case_resnet18 = _original_model
