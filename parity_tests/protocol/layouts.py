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

from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.specs import nested_inputs, param_specs

__all__ = ["layout_of", "to_torch_named", "to_tf_named", "NamedLayouts", "LAYOUTS", "LayoutError"]

#: what ``run.to_torch(a, layout=...)`` takes, with the rank each needs: how torch's own class holds the array
#: (``none``: as TensorFlow does)
LAYOUTS = {"dense": 2, "conv": 4, "none": None}


class LayoutError(CaseError):
    """A plugin asked ``run.to_torch`` / ``run.to_tf`` for what cannot be told (bad input, exit 2): a name the case
    does not have, an unknown layout, or an external model's array whose rank alone does not say its layout."""

    def line(self) -> str:
        """What the plugin's run reports as bad input (``<impl>: expected <this>``): the message without its field."""
        return str(self).split(": expected ", 1)[-1]

_HEAD_PARTS = ("q", "k", "v", "o")


def layout_of(spec: Mapping[str, Any], name: str) -> tuple[str, tuple[int, ...]]:
    """``(conversion, canonical shape)`` of the canonical parameter ``name`` of the case ``spec``.

    The conversion says how torch's own layer class holds it (docs/plugins.md, "Layouts"): ``dense``
    (``nn.Linear.weight [out, in]``), ``conv`` (``nn.Conv2d.weight [out, in, kh, kw]``), ``depthwise``
    (``nn.Conv2d(C, C*M, groups=C).weight [C*M, 1, kh, kw]``), ``heads_in`` (an attention q/k/v kernel
    ``[D, H, dk]`` as its block of ``in_proj_weight``, ``[H*dk, D]``), ``heads_out`` (``o.kernel
    [H, dv, D]`` as ``out_proj.weight [D, H*dv]``), ``heads_bias`` (``[H, dk]`` as its block of
    ``in_proj_bias``, ``[H*dk]``), ``none`` (embeddings, tokens, biases, gammas, moving statistics: the
    same array). Raises :class:`LayoutError` (one line) for a name the case does not have.
    """
    model = spec["model"]
    shapes = {p.name: tuple(p.shape) for p in param_specs(model["input_shape"], model["layers"])}
    if name not in shapes:
        some = ", ".join(list(shapes)[:3])
        raise LayoutError("name", f"a canonical parameter name of this case ({some}, ...)", name)
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


def _by_layout(a: Any, layout: Any, *, to: str) -> Any:
    """``a`` converted as ``layout`` (a key of :data:`LAYOUTS`) says, towards torch's layout (``to="torch"``) or back."""
    if layout not in LAYOUTS:
        raise LayoutError("layout", "one of " + ", ".join(repr(k) for k in LAYOUTS), layout)
    rank = LAYOUTS[layout]
    shape = list(getattr(a, "shape", np.shape(a)))
    if rank is not None and len(shape) != rank:
        raise LayoutError("layout", f"a {rank}-D array for layout {layout!r}", f"shape {shape}")
    if layout == "none":
        return a
    if to == "torch":
        return to_torch_named(a, layout, tuple(shape))
    return _own(a.T) if layout == "dense" else _own(_permute(a, (2, 3, 1, 0)))


def _external(spec: Mapping[str, Any]) -> bool:
    model = spec.get("model")
    return isinstance(model, Mapping) and "external" in model


def _ambiguous(a: Any, call: str) -> LayoutError:
    shape = list(getattr(a, "shape", np.shape(a)))
    return LayoutError("layout", f"run.{call}(a, layout=...) for an external model's {len(shape)}-D array: 'dense'"
                                 " (a dense kernel, TensorFlow [in, out] <-> torch [out, in]), 'conv' (TensorFlow"
                                 " [kh, kw, in, out] <-> torch [out, in, kh, kw]) or 'none' (held alike, e.g. an"
                                 " embedding table); its rank alone does not say which", f"shape {shape}")


class NamedLayouts:
    """``to_torch`` / ``to_tf`` for a plugin's ``run``: by rank without ``name``, by layer with it.

    Needs ``self.spec`` (the case) and the by-rank conversions ``_rank_to_torch`` / ``_rank_to_tf``
    of the framework's ``Run`` (torch tensors as well as numpy arrays on the torch side).
    """

    spec: dict[str, Any]

    def to_torch(self, a: Any, name: str | None = None, *, layout: str | None = None) -> Any:
        """TensorFlow layout -> torch layout.

        With the canonical ``name`` (``"0.embeddings"``, ``"3.body.1.kernel"``, ``"1.q.kernel"``): as torch's
        own class for that layer holds it (:func:`layout_of`): an embedding table stays ``[V, D]``, a depthwise
        kernel becomes ``[C*M, 1, kh, kw]``, an attention kernel its ``in_proj``/``out_proj`` block.
        With ``layout`` (:data:`LAYOUTS`): ``"dense"`` ``[in, out]`` -> ``[out, in]``, ``"conv"``
        ``[kh, kw, in, out]`` -> ``[out, in, kh, kw]``, ``"none"`` as it is: what an external model's arrays
        take. Without either, by rank (2-D transposed, 4-D as a conv kernel, others as they are): a case
        model's (the contract's rule, docs/plugins.md); for an external model's array of 2 or more dimensions, whose rank does
        not say whether it is a kernel or a table, :class:`LayoutError` (bad input, one line).
        """
        return self._convert(a, name, layout, "to_torch")

    def to_tf(self, a: Any, name: str | None = None, *, layout: str | None = None) -> Any:
        """torch layout -> TensorFlow layout: the inverse of :meth:`to_torch` (with the same ``name`` or ``layout``)."""
        return self._convert(a, name, layout, "to_tf")

    def _convert(self, a: Any, name: str | None, layout: str | None, call: str) -> Any:
        to = "torch" if call == "to_torch" else "tf"
        if name is not None and layout is not None:
            raise LayoutError("layout", f"run.{call}(a, name=...) or run.{call}(a, layout=...), not both", layout)
        if layout is not None:
            return _by_layout(a, layout, to=to)
        if name is not None:
            if _external(self.spec):
                raise LayoutError("name", f"a case model's parameter name; an external model's arrays take"
                                          f" run.{call}(a, layout='dense' | 'conv' | 'none')", name)
            try:
                conversion = layout_of(self.spec, name)
            except LayoutError as e:
                raise LayoutError("name", f"run.{call}(a, name=...) with {e.expected}", name) from None
            return (to_torch_named if to == "torch" else to_tf_named)(a, *conversion)
        if _external(self.spec) and len(getattr(a, "shape", np.shape(a))) >= 2:
            raise _ambiguous(a, call)
        return self._rank_to_torch(a) if to == "torch" else self._rank_to_tf(a)

