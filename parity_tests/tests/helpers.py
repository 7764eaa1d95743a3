"""Small case builders shared by the tests."""

from __future__ import annotations

import copy
from typing import Any

from parity_tests.contract.case import Case, case_from_dict

MLP: dict[str, Any] = {
    "schema": "parity-case/1",
    "name": "mlp",
    "dtype": "float64",
    "model": {
        "input_shape": [5],
        "layers": [{"type": "dense", "units": 10, "activation": "relu"}, {"type": "dense", "units": 1}],
        "loss": "sigmoid_ce",
        "reduction": "mean",
    },
    "init": {"seed": 3, "kind": "normal", "stddev": 0.5},
    "data": {"generator": "binary5", "seed": 4, "global_batch": 48},
    "optimizer": {"name": "sgd", "lr": 0.01},
    "parallel": {"devices": 4, "combine": "grad_mean", "shard": "contiguous", "weighting": "equal"},
    "steps": 4,
}

POLY: dict[str, Any] = {
    "schema": "parity-case/1",
    "name": "poly",
    "dtype": "float64",
    "model": {"input_shape": [], "layers": [{"type": "poly", "degree": 2}, {"type": "dense", "units": 1, "use_bias": False}], "loss": "mse"},
    "init": {"seed": 1, "kind": "normal", "stddev": 1.0},
    "data": {"generator": "poly", "seed": 2, "global_batch": 48},
    "optimizer": {"name": "adam", "lr": 0.05},
    "parallel": {"devices": 4},
    "steps": 4,
}

SOFTMAX: dict[str, Any] = {
    "schema": "parity-case/1",
    "name": "softmax",
    "dtype": "float64",
    "model": {"input_shape": [4], "layers": [{"type": "dense", "units": 8, "activation": "tanh"}, {"type": "dense", "units": 3}], "loss": "softmax_ce"},
    "init": {"seed": 5, "kind": "glorot_uniform"},
    "data": {"generator": "blobs", "seed": 6, "global_batch": 48},
    "optimizer": {"name": "momentum", "lr": 0.05, "momentum": 0.9},
    "parallel": {"devices": 4},
    "steps": 4,
}


def set_path(d: dict, dotted: str, value: Any) -> dict:
    """Return a deep copy of ``d`` with ``dotted`` set (``"parallel.devices"``); value ``...`` deletes."""
    out = copy.deepcopy(d)
    node = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is ...:
        node.pop(last, None)
    else:
        node[last] = value
    return out


def make(base: dict, **changes: Any) -> Case:
    """A validated case from ``base`` with dotted-path changes (``__`` stands for ``.``)."""
    raw = base
    for k, v in changes.items():
        raw = set_path(raw, k.replace("__", "."), v)
    return case_from_dict(raw)

# conv(same, relu) -> batch_norm -> max_pool -> dropout -> flatten -> dense (softmax_ce), on 8x8x1
# synthetic digits: small enough that a step at 8 devices takes milliseconds
CNN: dict[str, Any] = {
    "schema": "parity-case/1",
    "name": "cnn",
    "dtype": "float64",
    "seed": 7,
    "model": {
        "input_shape": [8, 8, 1],
        "layers": [
            {"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same", "activation": "relu"},
            {"type": "batch_norm", "momentum": 0.9},
            {"type": "max_pool2d", "pool_size": 2},
            {"type": "dropout", "rate": 0.25},
            {"type": "flatten"},
            {"type": "dense", "units": 3},
        ],
        "loss": "softmax_ce",
    },
    "init": {"seed": 8, "kind": "glorot_uniform"},
    "data": {"generator": "images", "seed": 9, "global_batch": 32},
    "optimizer": {"name": "sgd", "lr": 0.1, "semantics": "torch"},
    "parallel": {"devices": 4, "batch_norm": "sync"},
    "steps": 3,
}
