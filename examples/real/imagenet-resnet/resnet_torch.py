"""A small ResNet with torchvision's ``resnet18`` structure, for the ``imagenet-resnet`` example.

torchvision cannot be installed beside this project's torch 2.13 (PyPI's torchvision fails to
import next to it), so the model ``imagenet/main.py`` builds by default,
``torchvision.models.resnet18()``, is written out here: the architecture of
``torchvision/models/resnet.py`` (https://github.com/pytorch/vision, read at commit
054e54c573ba46e5b9c63f1eea3ad4d103afbea2): a 7x7 stride-2 convolution (padding 3, no
bias), batch norm, ReLU, a 3x3 stride-2 max pool (padding 1), four stages of
``BasicBlock`` (3x3 conv, BN, ReLU, 3x3 conv, BN, plus the input or, where the stage
changes stride or width, a 1x1 stride-s conv and BN of it, then ReLU), global average
pooling and a linear classifier. Written anew, not copied; two things are parameters
here that torchvision fixes: the stage widths (64, 128, 256, 512) and the blocks per
stage ([2, 2, 2, 2]), so that the test runs a tiny one.

No TensorFlow import here: every rank imports this file (through ``torch_main.py``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "ResNet"]


def _conv(cin: int, cout: int, k: int, stride: int, dtype: torch.dtype) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False, dtype=dtype)


class BasicBlock(nn.Module):
    """``x [n, cin, h, w]`` -> ``[n, cout, h / stride, w / stride]``."""

    def __init__(self, cin: int, cout: int, stride: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv1 = _conv(cin, cout, 3, stride, dtype)
        self.bn1 = nn.BatchNorm2d(cout, dtype=dtype)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(cout, cout, 3, 1, dtype)
        self.bn2 = nn.BatchNorm2d(cout, dtype=dtype)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride, dtype), nn.BatchNorm2d(cout, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """``x [n, 3, h, w]`` -> logits ``[n, num_classes]``; ``widths`` of the stem and the four stages."""

    def __init__(self, widths: tuple[int, int, int, int], blocks: tuple[int, int, int, int], num_classes: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.conv1 = _conv(3, widths[0], 7, 2, dtype)
        self.bn1 = nn.BatchNorm2d(widths[0], dtype=dtype)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin, stages = widths[0], []
        for i, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            stride = 1 if i == 0 else 2
            stage = []
            for j in range(count):
                stage.append(BasicBlock(cin, width, stride if j == 0 else 1, dtype))
                cin = width
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
