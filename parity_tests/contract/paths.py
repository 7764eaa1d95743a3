"""Layer paths of a nested model (docs/case-format.md), in the order the forward pass finishes them.

A path indexes the nesting: top-level layer ``3``; its ``residual`` body layer 1
``3.body.1``, shortcut layer 0 ``3.shortcut.0``; copy 2 of a ``repeat`` at index
5, body layer 0, ``5.2.0`` (a ``residual`` there: ``5.2.0.body.1``). A parameter
is ``<path>.<kind>`` (``5.2.0.body.1.gamma``). The forward stage of the
localisation (docs/localisation.md) records every layer's output under its path
(``act/5.2.0.body.1``) and reads them in execution order: a nesting layer
finishes after everything inside it (a residual's body, then its shortcut, then
the sum), so the first path whose output differs is the innermost, earliest
layer that computes something else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["layer_paths", "execution_key", "layer_of", "describe"]

_BRANCH = {"body": 0, "shortcut": 1}


def layer_paths(layers: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """Every layer at every depth as ``(path, layer)``, in the order the forward pass finishes them.

    A ``residual`` at ``p`` comes after ``p.body.*`` and ``p.shortcut.*``; a ``repeat`` at
    ``p`` after ``p.0.*``, ``p.1.*``, ...: the order :func:`execution_key` sorts paths in.
    """
    out: list[tuple[str, Mapping[str, Any]]] = []

    def walk(prefix: str, items: Sequence[Mapping[str, Any]]) -> None:
        for j, layer in enumerate(items):
            path = f"{prefix}{j}"
            if layer.get("type") == "residual":
                walk(f"{path}.body.", layer.get("body", ()))
                walk(f"{path}.shortcut.", layer.get("shortcut", ()))
            elif layer.get("type") == "repeat":
                for r in range(int(layer.get("count", 0))):
                    walk(f"{path}.{r}.", layer.get("body", ()))
            out.append((path, layer))

    walk("", layers)
    return out


def execution_key(path: str) -> tuple:
    """Sort key: paths in the order the forward pass finishes them (children before the layer that holds them).

    ``0 < 1.body.0 < 1.body.1 < 1.shortcut.0 < 1 < 2.0.0 < 2.1.0 < 2``. A key that is not a path
    (a plugin's hook layer ``hooks.3``, a name it chose) sorts after every path, by its text with
    its numbers in numeric order.
    """
    parts = path.split(".")
    key: list[tuple[int, int]] = []
    for part in parts:
        if part.isdigit():
            key.append((0, int(part)))
        elif part in _BRANCH and key:
            key.append((1, _BRANCH[part]))
        else:  # numbers in it in numeric order: hooks.2 before hooks.10
            return (1, tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", path) if t))
    return (0, tuple(key) + ((2, 0),))


def layer_of(name: str, layers: Sequence[Mapping[str, Any]]) -> str | None:
    """``"5.2.0.body.1 layer_norm"``: the layer (path and type) that a layer path or a parameter name belongs to.

    ``name``: a path (``5.2.0.body.1``) or a canonical parameter / state name
    (``5.2.0.body.1.gamma``, ``3.moving_mean``); ``None`` when it names no layer of ``layers``.
    """
    types = {path: layer.get("type") for path, layer in layer_paths(layers)}
    for path in (name, name.rsplit(".", 1)[0] if "." in name else None):
        if path is not None and path in types:
            return f"{path} {types[path]}"
    return None


def describe(name: str | None, spec: Mapping[str, Any] | None) -> str | None:
    """:func:`layer_of` for a case (``None`` for an external model, or a name that is no layer's)."""
    if name is None or spec is None:
        return None
    layers = (spec.get("model") or {}).get("layers")
    return layer_of(name, layers) if layers else None
