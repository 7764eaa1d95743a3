"""The case's names for the ResNet's weights and batch-norm statistics (shared by both plugins).

torch ``state_dict`` keys become TensorFlow-style names: a convolution's or the
classifier's ``weight`` is ``kernel``, a batch norm's ``weight``/``bias`` are
``gamma``/``beta``, its ``running_mean``/``running_var`` the state ``moving_mean``/
``moving_variance``; ``num_batches_tracked`` is not recorded. No framework import here.
"""

from __future__ import annotations

__all__ = ["BN_SUFFIXES", "case_name"]

#: torch batch-norm attribute -> the case's suffix
BN_SUFFIXES = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}


def case_name(key: str, is_bn: bool) -> str | None:
    """``layer2.0.downsample.1.running_var`` (a batch norm's) -> ``layer2.0.downsample.1.moving_variance``."""
    module, attr = key.rsplit(".", 1)
    if attr == "num_batches_tracked":
        return None
    if is_bn:
        return f"{module}.{BN_SUFFIXES[attr]}"
    return f"{module}.kernel" if attr == "weight" else key
