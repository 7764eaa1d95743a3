"""What torch says of the GPUs of this process: its CUDA build, the cuDNN it loaded, the device names.

Runs where torch lives (a pool rank, ``parity_tests.launch.torch``), as a pool job
(:func:`gpu_job`) from the main process, which never imports torch. Every field is
``None`` (or ``[]``) where there is nothing to report: a CPU build, no GPU.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gpu_facts", "gpu_job"]


def gpu_facts() -> dict[str, Any]:
    """``{"cuda": "12.8" | None, "cudnn": 91002 | None, "gpus": [name, ...]}``.

    ``cuda``: ``torch.version.cuda`` (the CUDA torch was built with; ``None`` for a CPU build);
    ``cudnn``: ``torch.backends.cudnn.version()`` (the cuDNN it loaded, e.g. ``91002`` for 9.10.2);
    ``gpus``: ``torch.cuda.get_device_name(i)`` for every visible device.
    """
    cudnn = None
    try:
        if torch.backends.cudnn.is_available():
            cudnn = torch.backends.cudnn.version()
    except Exception:  # a broken cuDNN install: nothing to report, never a failed manifest
        cudnn = None
    gpus: list[str] = []
    try:
        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        gpus = []
    return {"cuda": torch.version.cuda, "cudnn": cudnn, "gpus": gpus}


def gpu_job(ctx: Any, payload: Any) -> dict[str, Any]:
    """The pool job: :func:`gpu_facts` from one rank."""
    return gpu_facts()
