"""Parameter names and shapes implied by a layer list: :mod:`parity_tests.protocol.specs`, re-exported.

The engines name their parameters by these rules, so the rules live in ``protocol`` (the one part of
``parity_tests`` that ``tfpar`` and ``torchref`` import); the judge's side keeps importing them from here.
"""

from __future__ import annotations

from parity_tests.protocol.specs import (
    STATE_KINDS,
    ParamSpec,
    axis_paddings,
    layer_shapes,
    nested_inputs,
    nested_layers,
    output_shape,
    param_specs,
    reshape_target,
    same_padding,
    spatial_output,
)

__all__ = [
    "ParamSpec",
    "param_specs",
    "output_shape",
    "layer_shapes",
    "nested_inputs",
    "nested_layers",
    "spatial_output",
    "same_padding",
    "axis_paddings",
    "reshape_target",
    "STATE_KINDS",
]
