"""Models built from the case's layer list, in torch.

Parameters are stored in canonical (TensorFlow) layouts, dense kernel
``[in, out]``, so the forward pass is ``x @ kernel + bias`` and no layout
conversion is needed for dense layers; names are canonical with ``_`` for
``.`` inside the module (``0_kernel``), since torch reserves the dot.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["CaseModel"]

_ACT = {"none": lambda t: t, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


class CaseModel(nn.Module):
    """The case's model.

    Args:
        layers: validated ``model.layers``.
        init: canonical name -> initial value (numpy).
        dtype: ``torch.float32`` or ``torch.float64``.
    """

    def __init__(self, layers: list[dict], init: Mapping[str, np.ndarray], dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = layers
        self.params = nn.ParameterDict(
            {k.replace(".", "_"): nn.Parameter(torch.tensor(np.asarray(v), dtype=dtype)) for k, v in init.items()}
        )

    def canonical(self) -> dict[str, nn.Parameter]:
        """Canonical name -> parameter, in creation order."""
        return {k.replace("_", ".", 1): p for k, p in self.params.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, *input_shape]`` -> ``[batch, *output_shape]``."""
        h = x
        for i, layer in enumerate(self.layers):
            kind = layer["type"]
            if kind == "poly":
                d = layer["degree"]
                powers = torch.arange(d, -1, -1, dtype=h.dtype)
                h = torch.pow(h[:, None], powers)  # x^d ... x, 1
            elif kind == "dense":
                h = h @ self.params[f"{i}_kernel"]
                if layer["use_bias"]:
                    h = h + self.params[f"{i}_bias"]
                h = _ACT[layer["activation"]](h)
            else:
                raise ValueError(f"layer {i}: unknown type {kind!r}")
        return h
