"""Canonical parameters in torch's layouts, by name: what ``run.to_torch(a, name=...)`` converts with.

The case contract fixes TensorFlow's layouts for every canonical parameter (docs/layers.md); a torch
program holds each in its own class's layout. By rank alone (``run.to_torch(a)``) a 2-D array is
transposed, which is right for a dense kernel and wrong for an embedding table; by name the layer the
parameter belongs to decides (docs/plugins.md, "Layouts"). :class:`NamedLayouts` gives both plugin
``Run`` classes (``tfpar.plugin``, ``torchref.plugin``) the two methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity_tests.contract.specs import nested_inputs, param_specs

__all__ = ["layout_of", "to_torch_named", "to_tf_named", "NamedLayouts"]

_HEAD_PARTS = ("q", "k", "v", "o")


def layout_of(spec: Mapping[str, Any], name: str) -> tuple[str, tuple[int, ...]]:
    """``(conversion, canonical shape)`` of the canonical parameter ``name`` of the case ``spec``.

    The conversion says how torch's own layer class holds it (docs/plugins.md, "Layouts"): ``dense``
    (``nn.Linear.weight [out, in]``), ``conv`` (``nn.Conv2d.weight [out, in, kh, kw]``), ``depthwise``
    (``nn.Conv2d(C, C*M, groups=C).weight [C*M, 1, kh, kw]``), ``heads_in`` (an attention q/k/v kernel
    ``[D, H, dk]`` as its block of ``in_proj_weight``, ``[H*dk, D]``), ``heads_out`` (``o.kernel
    [H, dv, D]`` as ``out_proj.weight [D, H*dv]``), ``heads_bias`` (``[H, dk]`` as its block of
    ``in_proj_bias``, ``[H*dk]``), ``none`` (embeddings, tokens, biases, gammas, moving statistics: the
    same array). Raises ``ValueError`` (one line) for a name the case does not have.
    """
    model = spec["model"]
    shapes = {p.name: tuple(p.shape) for p in param_specs(model["input_shape"], model["layers"])}
    if name not in shapes:
        some = ", ".join(list(shapes)[:3])
        raise ValueError(f"name: expected a canonical parameter name of this case ({some}, ...), got {name!r}")
    types = {path: layer["type"] for path, layer, _ in nested_inputs(model["input_shape"], model["layers"])}
    path, _, kind = name.rpartition(".")
    head = path.rpartition(".")[2] if path.rpartition(".")[2] in _HEAD_PARTS else None
    layer = types.get(path.rpartition(".")[0] if head else path)
    shape = shapes[name]
    if layer == "attention" and head is not None:
        if kind == "kernel":
            return ("heads_out" if head == "o" else "heads_in"), shape
        return ("heads_bias" if len(shape) == 2 else "none"), shape
    if kind == "kernel" and layer == "dense":
        return "dense", shape
    if kind == "kernel" and layer == "conv2d":
        return "conv", shape
    if kind == "kernel" and layer == "depthwise_conv2d":
        return "depthwise", shape
    return "none", shape


def _permute(a: Any, axes: tuple[int, ...]) -> Any:
    """numpy's ``transpose`` or torch's ``permute`` (this module imports neither framework)."""
    return a.permute(*axes) if hasattr(a, "permute") else a.transpose(axes)


def _own(a: Any) -> Any:
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a


def to_torch_named(a: Any, conversion: str, shape: tuple[int, ...]) -> Any:
    """``a`` (canonical layout ``shape``, numpy or a torch tensor) in the layout torch's class holds (:func:`layout_of`)."""
    if conversion == "dense":
        return _own(a.T)
    if conversion == "conv":
        return _own(_permute(a, (3, 2, 0, 1)))
    if conversion == "depthwise":  # output channel c*M + m is input channel c's filter m
        kh, kw, c, m = shape
        return _own(_permute(a, (2, 3, 0, 1)).reshape(c * m, 1, kh, kw))
    if conversion in ("heads_in", "heads_out"):
        return _own(a.reshape(shape[0], -1).T if conversion == "heads_in" else a.reshape(-1, shape[-1]).T)
    if conversion == "heads_bias":
        return _own(a.reshape(-1))
    return a


def to_tf_named(a: Any, conversion: str, shape: tuple[int, ...]) -> Any:
    """The inverse of :func:`to_torch_named`: torch's layout back to the canonical ``shape``."""
    if conversion == "dense":
        return _own(a.T)
    if conversion == "conv":
        return _own(_permute(a, (2, 3, 1, 0)))
    if conversion == "depthwise":
        kh, kw, c, m = shape
        return _own(_permute(a.reshape(c, m, kh, kw), (2, 3, 0, 1)))
    if conversion in ("heads_in", "heads_out", "heads_bias"):
        return _own((a.T if conversion != "heads_bias" else a).reshape(shape))
    return a


class NamedLayouts:
    """``to_torch`` / ``to_tf`` for a plugin's ``run``: by rank without ``name``, by layer with it.

    Needs ``self.spec`` (the case) and the by-rank conversions ``_rank_to_torch`` / ``_rank_to_tf``
    of the framework's ``Run`` (torch tensors as well as numpy arrays on the torch side).
    """

    spec: dict[str, Any]

    def to_torch(self, a: Any, name: str | None = None) -> Any:
        """TensorFlow layout -> torch layout. Without ``name`` by rank (2-D transposed, 4-D ``[kh, kw, in, out]`` ->
        ``[out, in, kh, kw]``, others as they are); with the canonical ``name`` (``"0.embeddings"``,
        ``"3.body.1.kernel"``, ``"1.q.kernel"``) as torch's own class for that layer holds it (:func:`layout_of`):
        an embedding table stays ``[V, D]``, a depthwise kernel becomes ``[C*M, 1, kh, kw]``, an attention
        kernel its ``in_proj``/``out_proj`` block."""
        if name is None:
            return self._rank_to_torch(a)
        return to_torch_named(a, *layout_of(self.spec, name))

    def to_tf(self, a: Any, name: str | None = None) -> Any:
        """torch layout -> TensorFlow layout: the inverse of :meth:`to_torch` (with the same ``name``)."""
        if name is None:
            return self._rank_to_tf(a)
        return to_tf_named(a, *layout_of(self.spec, name))

