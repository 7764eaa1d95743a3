"""torchref: the PyTorch reference (torch only, never TensorFlow).

``torchref.pool`` (the warm DDP worker pool), ``torchref.ddp`` (real
``DistributedDataParallel`` on a case), ``torchref.run`` (what the parity tool
calls) and ``torchref.plugin`` (decorators for users' own DDP code). The
submodules load on first use, so ``import torchref`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["plugin", "pool", "ddp", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
