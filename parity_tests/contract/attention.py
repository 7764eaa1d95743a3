"""The ``attention`` layer in a case: its fields, where it sits, and its dropout masks (numpy only).

Self-attention on tokens ``[T, D]`` (``docs/layers.md``, "Attention"):

``num_heads``  H >= 1.
``key_dim``    per head, >= 1; the scale is ``1/sqrt(key_dim)``.
``value_dim``  per head [``key_dim``].
``use_bias``   [true]: ``q.bias [H, key_dim]``, ``k.bias``, ``v.bias [H, value_dim]``, ``o.bias [D]``.
``causal``     [false]: query ``i`` attends to keys ``j <= i`` (GPT).
``dropout``    [0]: on the attention weights, after the softmax; keep-masks ``[rows, H, T, T]``
               drawn in numpy from the case seed (:func:`attention_masks`), as dropout masks are.
``semantics``  [native]: ``tf`` or ``torch`` makes both sides use that framework's scale in float64
               (Keras rounds ``1/sqrt(key_dim)`` through float32; torch does not).

Masks: the only mask a case can express is ``causal`` on self-attention, where query ``i`` always
attends to key 0 (and to itself): no row is ever fully masked, so no case can reach the frameworks'
disagreeing fully-masked rows (Keras uniform or zero weights, torch NaN; docs/framework-differences.md,
"Attention masks"). Both engines still check the mask they build (:func:`fully_masked_rows` is the rule)
and refuse such a row with one line rather than compute a NaN.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from parity_tests.contract.fields import choice, integer, need, no_extra, number
from parity_tests.contract.specs import layer_shapes, output_shape
from parity_tests.protocol.errors import CaseError

__all__ = ["validate_attention", "attention_layers", "attention_masks", "causal_mask", "fully_masked_rows",
           "path_seed", "ATTENTION_SEMANTICS"]

ATTENTION_SEMANTICS = ("native", "tf", "torch")
# seed words for the nested path parts (a repeat's repetitions are integers, below MAX_REPEAT)
_PART_SEED = {"body": 1_000_001, "shortcut": 1_000_002}


def _flag(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise CaseError(path, "true or false", v)
    return v


def validate_attention(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    """The normalised ``attention`` layer at field path ``p`` on per-example inputs ``shape`` (``[T, D]``)."""
    no_extra(layer, {"type", "num_heads", "key_dim", "value_dim", "use_bias", "causal", "dropout", "semantics"}, p)
    if len(shape) != 2:
        raise CaseError(p, f"a token input [tokens, width] for an attention layer (a reshape layer makes one); the"
                        f" input here has shape {list(shape)}")
    key_dim = integer(need(layer, "key_dim", p), f"{p}.key_dim", 1, 100_000)
    return {
        "type": "attention",
        "num_heads": integer(need(layer, "num_heads", p), f"{p}.num_heads", 1, 10_000),
        "key_dim": key_dim,
        "value_dim": integer(layer.get("value_dim", key_dim), f"{p}.value_dim", 1, 100_000),
        "use_bias": _flag(layer.get("use_bias", True), f"{p}.use_bias"),
        "causal": _flag(layer.get("causal", False), f"{p}.causal"),
        "dropout": number(layer.get("dropout", 0.0), f"{p}.dropout", lo=0.0, hi=1.0, hi_open=True),
        "semantics": choice(layer.get("semantics", "native"), f"{p}.semantics", ATTENTION_SEMANTICS),
    }


def attention_layers(input_shape: tuple[int, ...] | list[int], layers: list[dict],
                     prefix: str = "") -> Iterator[tuple[str, dict, tuple[int, ...]]]:
    """Every ``attention`` layer of a validated list, nested ones included, as ``(path, layer, input shape)``.

    ``path`` is the parameter path (``3``, ``3.body.1``, ``5.2.0``: repetition 2 of a repeat at 5).
    """
    # the shapes of the whole list at once: a top-level tied_logits needs the list to find its embedding
    shapes = layer_shapes(tuple(input_shape), layers)
    for i, layer in enumerate(layers):
        path = f"{prefix}{i}"
        shape = shapes[i]
        kind = layer["type"]
        if kind == "attention":
            yield path, layer, shape
        elif kind == "residual":
            yield from attention_layers(shape, layer["body"], f"{path}.body.")
            yield from attention_layers(shape, layer["shortcut"], f"{path}.shortcut.")
        elif kind == "repeat":
            h = shape
            for r in range(layer["count"]):
                yield from attention_layers(h, layer["body"], f"{path}.{r}.")
                h = output_shape(h, layer["body"])


def path_seed(seed: int, path: str) -> list[int]:
    """The numpy seed words of the masks of the layer at ``path``: ``[seed, 3]`` for layer 3 (as a dropout
    layer's), ``[seed, 3, 1000001, 1]`` for ``3.body.1``."""
    return [seed, *(int(part) if part.isdigit() else _PART_SEED[part] for part in path.split("."))]


def attention_masks(spec: dict) -> dict[str, np.ndarray]:
    """Keep-masks of every attention layer with ``dropout > 0``, for every data row, drawn once in numpy.

    Layer ``path``'s mask comes from ``np.random.default_rng(path_seed(seed, path))``:
    ``keep = U[0, 1) >= dropout``, as dropout masks are drawn (``generators.dropout_masks``);
    row ``j`` belongs to data row ``j``.

    Returns:
        path -> bool ``[steps * global_batch, H, T, T]`` (query ``i``, key ``j`` at ``[..., i, j]``).
    """
    model = spec["model"]
    if "layers" not in model or "input_shape" not in model:  # an external model: the plugins' own
        return {}
    rows = spec["steps"] * spec["data"]["global_batch"]
    out = {}
    for path, layer, shape in attention_layers(model["input_shape"], model["layers"]):
        if layer["dropout"] > 0.0:
            t = shape[0]
            rng = np.random.default_rng(path_seed(spec.get("seed", 0), path))
            out[path] = rng.random(size=(rows, layer["num_heads"], t, t)) >= layer["dropout"]
    return out


def causal_mask(t: int) -> np.ndarray:
    """``[T, T]`` bool, True where query ``i`` attends to key ``j`` (``j <= i``): Keras' sense."""
    return np.tril(np.ones((t, t), bool))


def fully_masked_rows(mask: np.ndarray) -> list[int]:
    """The query rows of a ``[T, S]`` attend-mask (True attends) that attend to no key."""
    return [int(i) for i in np.flatnonzero(~np.asarray(mask, bool).any(axis=-1))]
