"""Validation of the GPT input/output path: ``embedding``, ``tied_logits``, token inputs, per-token ``softmax_ce``.

Layers (``docs/case-format.md``, ``docs/layers.md``):

``embedding``    ``input_dim`` V, ``output_dim`` D, ``gradient`` (``native``: TensorFlow's sparse
                 ``IndexedSlices`` gradient reaches the optimizer as Keras' would; ``dense``: densified
                 first, ``tf.convert_to_tensor``). Parameter ``embeddings [V, D]``. Only as
                 ``model.layers[0]``: it reads the integer token ids of ``data.x`` (``[rows, *input_shape]``,
                 ids in ``[0, V)``) and gives ``[*input_shape, D]`` per example.
``tied_logits``  ``embedding``: the path of an embedding layer (``"0"``); logits ``h @ embeddings.T``,
                 ``[..., D] -> [..., V]``, no parameters of its own. Top level only.

A model takes token inputs exactly when its first layer is an ``embedding``
(:func:`takes_tokens`); its ``data.x`` is then int64, everywhere else float64.

Per-token ``softmax_ce``: logits ``[..., k]`` with integer labels shaped like the logits
without their last axis; the loss is the mean over every labelled position of a
shard. ``ignore_label`` (model level, default none) excludes the positions whose label
it is (torch's ``ignore_index``, Keras' ``ignore_class``). A shard with no labelled
position has no mean (torch gives NaN, Keras 0): the case is refused
(:func:`check_labelled`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity_tests.contract.fields import choice, integer, need, no_extra
from parity_tests.protocol.errors import CaseError
from parity_tests.protocol.shards import shard_rows

__all__ = ["EMBEDDING_GRADIENTS", "TOP_LEVEL_ONLY", "embedding", "tied_logits", "check_place", "loss_options",
           "takes_tokens", "token_ids", "check_labelled", "per_token", "MAX_VOCABULARY", "token_facts", "FACTS_KEY"]

#: ``spec["data"][FACTS_KEY]``: what theory needs to know of a token case's data (:func:`token_facts`)
FACTS_KEY = "token_facts"

EMBEDDING_GRADIENTS = ("native", "dense")
MAX_VOCABULARY = 10_000_000
#: layers refused inside a residual or repeat body, with the reason
TOP_LEVEL_ONLY = {
    "embedding": "a layer other than embedding inside a residual or repeat body (an embedding reads the integer"
                 " token ids of data.x: it is model.layers[0])",
    "tied_logits": "a layer other than tied_logits inside a residual or repeat body (put it at the top level)",
}


def embedding(layer: dict, shape: tuple[int, ...], p: str) -> dict:
    """``{"type": "embedding", "input_dim": V, "output_dim": D, "gradient": native|dense}``: ``shape -> shape + (D,)``."""
    no_extra(layer, {"type", "input_dim", "output_dim", "gradient"}, p)
    return {
        "type": "embedding",
        "input_dim": integer(need(layer, "input_dim", p), f"{p}.input_dim", 1, MAX_VOCABULARY),
        "output_dim": integer(need(layer, "output_dim", p), f"{p}.output_dim", 1, 100_000),
        "gradient": choice(layer.get("gradient", "native"), f"{p}.gradient", EMBEDDING_GRADIENTS),
    }


def check_place(kind: str, i: int, p: str) -> None:
    """An embedding only as the model's first layer (the only one that sees the token ids)."""
    if kind == "embedding" and i != 0:
        raise CaseError(f"{p}.type", "embedding only as model.layers[0] (it reads the integer token ids of data.x)", kind)


def _resolve(layers: list[dict], path: str) -> dict | None:
    """The top-level layer at ``path`` (``"0"``), or ``None``."""
    if not path.isdigit() or int(path) >= len(layers):
        return None
    return layers[int(path)]


def tied_logits(layer: dict, shape: tuple[int, ...], p: str, layers: list[dict] | None = None) -> dict:
    """``{"type": "tied_logits", "embedding": path}``; ``layers``: the layers before it (validated)."""
    no_extra(layer, {"type", "embedding"}, p)
    path = need(layer, "embedding", p)
    if isinstance(path, int) and not isinstance(path, bool):
        path = str(path)
    target = _resolve(layers or [], path) if isinstance(path, str) else None
    if target is None or target["type"] != "embedding":
        raise CaseError(f"{p}.embedding", "the path of an embedding layer before it (\"0\": model.layers[0])", path)
    if not shape or shape[-1] != target["output_dim"]:
        raise CaseError(p, f"an input whose last axis is the embedding's output_dim {target['output_dim']}"
                        f" (model.layers[{path}]); the input here has shape {list(shape)}")
    return {"type": "tied_logits", "embedding": path}


def tied_vocabulary(layers: list[dict], path: str) -> int:
    """V of the embedding layer a ``tied_logits`` names (the width of its logits)."""
    return _resolve(layers, path)["input_dim"]


def takes_tokens(model: dict) -> bool:
    """Whether the model's input is integer token ids (its first layer is an ``embedding``)."""
    layers = model.get("layers") or []
    return bool(layers) and layers[0]["type"] == "embedding"


def per_token(model: dict, out_shape: tuple[int, ...]) -> bool:
    """``softmax_ce`` over logits of rank > 1 per example (one label per token)."""
    return model["loss"] == "softmax_ce" and len(out_shape) > 1


def loss_options(m: dict, model: dict, out_shape: tuple[int, ...]) -> dict:
    """``ignore_label`` (kept only when given, so older cases keep their normalised spec)."""
    v = m.get("ignore_label")
    if v is None:
        return {}
    label = integer(v, "model.ignore_label", -(2**31), 2**31 - 1)
    if model["loss"] != "softmax_ce":
        raise CaseError("model.ignore_label", f"null for {model['loss']} (an ignored label applies to softmax_ce)", v)
    if model.get("class_weights") is not None or model.get("label_smoothing", 0.0):
        raise CaseError("model.ignore_label", "null together with model.class_weights or model.label_smoothing"
                        " (one weighting at a time)", v)
    return {"ignore_label": label}


def token_ids(x: np.ndarray, model: dict, path: str = "data.x") -> np.ndarray:
    """``x`` as int64 token ids in ``[0, V)`` of the model's embedding (whole-number floats accepted)."""
    if x.dtype.kind not in "iu" and not (x.dtype.kind == "f" and np.all(np.isfinite(x)) and np.all(x == np.round(x))):
        raise CaseError(path, "integer token ids (the model's first layer is an embedding)", f"array of dtype {x.dtype}")
    ids = x.astype(np.int64)
    v = model["layers"][0]["input_dim"]
    bad = (ids < 0) | (ids >= v)
    if bad.any():
        raise CaseError(path, f"token ids in [0, {v}) (model.layers[0].input_dim {v})", int(ids[bad][0]))
    return ids


def check_labelled(y: np.ndarray, model: dict, data: dict, parallel: dict, steps: int) -> None:
    """Every device's shard of every step holds a position whose label is not ``ignore_label``.

    The per-shard mean over labelled positions is 0/0 otherwise: torch's
    ``cross_entropy(ignore_index=)`` gives NaN, Keras' ``ignore_class`` 0 (divide_no_nan);
    neither is a mean, so the case is refused. One device reads the whole batch, so
    the check over N devices covers it.
    """
    label = model.get("ignore_label")
    if label is None:
        return
    if data.get("order", "split") != "split":
        raise CaseError("model.ignore_label", "null with data.order distributed_sampler (every shard must hold a"
                        " labelled position; checked for the split order only)", label)
    batch, n, shard = data["global_batch"], parallel["devices"], parallel["shard"]
    micro = parallel.get("accumulate", 1)  # each micro-batch's loss is its own mean (parallel.accumulate)
    for k in range(steps):
        for r in range(n):
            for j, part in enumerate(np.array_split(shard_rows(batch, n, r, shard), micro)):
                if np.all(y[k * batch + part] == label):
                    where = f"micro-batch {j + 1} of {micro} of " if micro > 1 else ""
                    raise CaseError("data.y", f"a label other than ignore_label {label} in every device's shard of every"
                                    f" step ({where}step {k + 1}, device {r} of {n} has none: its mean loss over labelled"
                                    " positions is 0/0, NaN in torch and 0 in Keras)")


def _has_repeat(ids: np.ndarray) -> bool:
    flat = ids.reshape(-1)
    return len(np.unique(flat)) < flat.size


def token_facts(x: np.ndarray, y: np.ndarray, model: dict, data: dict, parallel: dict, steps: int) -> dict | None:
    """What theory needs of the data (``judging.tokens``), derived at every validation, never read from a file.

    ``repeat_in_batch``: some step's global batch looks up one token id twice (Keras' sparse
    second moment is then not G^2 for an optimizer that sees the whole step, docs/layers.md);
    ``repeat_in_shard``: some device's shard does (what one device's own update sees under
    ``param_mean``/``async``). ``labelled_equal`` / ``labelled_by_size``: with ``ignore_label``,
    whether every step's shards hold equal numbers of labelled positions / numbers proportional to
    their rows (then the devices' mean of per-shard means is the full batch's mean under
    ``weighting`` equal / by_size). ``None`` for a model without token ids or ignored labels.
    ``data.order: distributed_sampler`` (no ignore_label there) reads rows in epoch orders
    the split below does not follow: both repeat facts are then whether any id repeats in
    the whole dataset (a superset: a prediction of a gap that may not appear is judged by
    size, never an unexpected parity; ``judging.tokens``).
    """
    tokens, label = takes_tokens(model), model.get("ignore_label")
    if not tokens and label is None:
        return None
    out: dict[str, Any] = {}
    batch, n, shard = data["global_batch"], parallel["devices"], parallel["shard"]
    if tokens:
        if data.get("order", "split") != "split":
            out["repeat_in_batch"] = out["repeat_in_shard"] = _has_repeat(x)
        else:
            out["repeat_in_batch"] = any(_has_repeat(x[k * batch:(k + 1) * batch]) for k in range(steps))
            out["repeat_in_shard"] = any(_has_repeat(x[k * batch + shard_rows(batch, n, r, shard)])
                                         for k in range(steps) for r in range(n))
    if label is not None:
        micro = parallel.get("accumulate", 1)
        steps_y = [y[k * batch:(k + 1) * batch] != label for k in range(steps)]
        out.update(labelled_equal=all(_one_device_weights(lab, n, shard, micro, "equal") for lab in steps_y),
                   labelled_by_size=all(_one_device_weights(lab, n, shard, micro, "by_size") for lab in steps_y))
    return out


def _one_device_weights(labelled: np.ndarray, n: int, shard: str, micro: int, weighting: str) -> bool:
    """Whether N devices weight every labelled position of one step as one device does.

    ``labelled``: ``[batch, ...]`` bool. Under N devices a labelled position of device r's micro-batch j
    (of ``micro``) weighs ``w_r / (micro c_rj)`` (``w_r``: 1/N, or ``n_r / B`` by size; ``c_rj``: the
    micro-batch's labelled positions); under one device ``1 / (micro C_j)`` with ``C_j`` the labelled
    positions of its own micro-batch j (the j-th contiguous part of the batch). Equal weights for every
    position is exactly when the two losses, and so their gradients, agree (for ``micro`` 1: equal counts
    under ``equal``, counts proportional to rows under ``by_size``).
    """
    batch = len(labelled)
    many, one = np.zeros(labelled.shape), np.zeros(labelled.shape)
    for r in range(n):
        rows = shard_rows(batch, n, r, shard)
        w = 1.0 / n if weighting == "equal" else len(rows) / batch
        for part in np.array_split(rows, micro):
            many[part] = np.where(labelled[part], w / (micro * np.sum(labelled[part])), 0.0)
    for part in np.array_split(np.arange(batch), micro):
        c = np.sum(labelled[part])
        if c == 0:  # one device's micro-batch without a label: not the same loss
            return False
        one[part] = np.where(labelled[part], 1.0 / (micro * c), 0.0)
    return bool(np.allclose(many, one, rtol=1e-12, atol=0.0))
