"""Writes ``data.npz`` and ``init.npz`` of this example (run from the repository root; numpy, torch).

Weights: the tiny ResNet of ``resnet_torch.py`` initialised as torchvision initialises
``resnet18`` (Kaiming-normal convolutions, fan-out, ReLU gain; batch norm 1 and 0; the
classifier's own ``nn.Linear`` initialisation), seeded, saved in TensorFlow layouts under
the names of ``names.py``, batch-norm statistics (0 and 1) included. Data: 16 MNIST-like
synthetic RGB images of 16x16 (the project's ``images`` generator, 10 classes) in [0, 1].
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from names import case_name  # noqa: E402
from resnet_torch import ResNet  # noqa: E402

from parity_tests.contract.generators import generate_data  # noqa: E402
from torchref.plugin import to_tf  # noqa: E402

WIDTHS, BLOCKS, SIZE, CLASSES = (4, 8, 8, 8), (1, 1, 1, 1), 16, 10
FULL = {"widths": (64, 128, 256, 512), "blocks": (2, 2, 2, 2), "size": 32}  # resnet18 (on 32x32 images)


def write(folder: Path, widths: tuple[int, ...] = WIDTHS, blocks: tuple[int, ...] = BLOCKS, size: int = SIZE,
          rows: int = 16) -> None:
    """``init.npz`` (the ResNet at ``widths``, ``blocks``) and ``data.npz`` (``rows`` images) in ``folder``."""
    torch.manual_seed(0)
    model = ResNet(widths, blocks, CLASSES, torch.float64)
    for m in model.modules():  # torchvision's ResNet.__init__
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    bn = {name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    init = {}
    for key, value in model.state_dict().items():
        name = case_name(key, key.rsplit(".", 1)[0] in bn)
        if name is not None:
            init[name] = to_tf(value.numpy())
    np.savez_compressed(folder / "init.npz", **init)
    x, y = generate_data("images", 3, rows, (size, size, 3), (CLASSES,), "softmax_ce")
    np.savez_compressed(folder / "data.npz", x=x, y=y)


if __name__ == "__main__":
    write(HERE)
