"""The float64 run that rounds a mixed recipe's gradients to bfloat16, and nothing else (framework-free).

A ``mixed_bfloat16`` run of a built-in rounds to bfloat16, among others, two values that no perturbed rerun
re-samples (docs/error-rates.md, "the bfloat16 rule's pairs 432 and 896"; ``judging.bfloat16``, "The gradient
term"):

* the loss's gradient at the model output: the output is bfloat16 (the last dense layer's result) and the loss is
  computed in float32 from it, so the backward of that cast rounds ``dL/dout`` (float32) to bfloat16. Its value is
  ``s_r dl_r/dout``, at the scale ``s_r`` at which device ``r`` differentiates its loss (``torchref.ddp``: ``N w_r``
  under ``loss_mean``; ``tfpar.towers``: ``w_r``);
* each device's gradient of every parameter: the layers read the float32 parameters cast to bfloat16, so a device's
  gradient is a bfloat16 result, cast back to float32 before the float32 combine over the devices (one device's,
  for a one-device engine: its whole gradient).

The run of a case with ``Case.grads_bf16`` (payload key :data:`GRADS_BF16`) is the float64 run of that case with an
identity inserted at each of those places whose backward rounds the gradient passing through it to float32 and then
to bfloat16 (what the mixed run's float32 gradient meets there), per device and per micro-batch, as the mixed
recipe makes them. Not one other op of the run changes: its distance from the float64 run is what those roundings
alone do. Only a model of ``dense`` layers is run so (:func:`rounds_gradients`): for it both recipes return a
bfloat16 output and read every parameter as bfloat16 (``tfpar.models``, ``torchref.models``), so every place the
run rounds is one the mixed run rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from parity_tests.protocol.vocabulary import COMBINES

__all__ = ["GRADS_BF16", "rounds_gradients", "check_rounds_gradients"]

#: the payload key of a float64 run rounding the gradients to bfloat16 where the mixed recipe does (module docstring)
GRADS_BF16 = "grads_bf16"


def rounds_gradients(spec: Mapping[str, Any]) -> bool:
    """Whether a case's float64 run can round its gradients as its mixed recipe does (module docstring): a model of
    ``dense`` layers only, without per-example sample weights (a weighted TensorFlow run takes the lockstep tower
    path, whose towers read one shared parameter: no per-device place to round), combined by ``grad_mean`` or
    ``loss_mean`` (each device applying its own updates is another program: ``param_mean``, ``async``)."""
    layers = spec["model"]["layers"]
    return (bool(layers) and all(layer["type"] == "dense" for layer in layers) and not spec["data"].get("sample_weights")
            and spec["parallel"]["combine"] in COMBINES)


def check_rounds_gradients(payload: Mapping[str, Any], engine: str) -> bool:
    """Whether ``payload`` asks for the gradient-rounding float64 run; raises where it cannot be made.

    Raises:
        ValueError: the payload asks for it on a case that is not float64 or whose model
            :func:`rounds_gradients` does not cover (a programming error of the session, not bad input).
    """
    if not payload.get(GRADS_BF16):
        return False
    spec = payload["spec"]
    if spec["dtype"] != "float64" or not rounds_gradients(spec):
        raise ValueError(f"{engine}: {GRADS_BF16} asks for a float64 run of a model of dense layers without sample"
                         f" weights, got dtype {spec['dtype']!r} and layers"
                         f" {[layer['type'] for layer in spec['model']['layers']]}")
    return True
