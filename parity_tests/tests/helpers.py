"""Small case builders shared by the tests."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Any

import numpy as np

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


_RUNS: OrderedDict[tuple[str, str], dict[str, np.ndarray]] = OrderedDict()
_MAX_RUNS = 32


def _case_key(case: Case) -> str:
    """Everything a run reads from ``case``: its spec, its input arrays (the manifest's digests of
    them: a replaced case carries arrays) and the step it captures."""
    from parity_tests.running.manifest import _inputs

    return json.dumps({"spec": case.spec, "inputs": _inputs(case), "capture": case.capture}, sort_keys=True, default=str)


def run_once(case: Case, impl: str) -> dict[str, np.ndarray]:
    """``run_impl(case, impl)``, made once per test worker for equal cases (the last 32 kept).

    For a run that two tests of a file both need (a reference, or a case with one option
    undone): a built-in implementation is deterministic, so the second test would only
    recompute the same bits (``test_reuse.py`` and ``tfpar replay`` check that). The arrays are
    read-only, so no test can change what another one is given. A test that patches what a
    run reads (``monkeypatch``) must call ``run_impl`` itself.
    """
    from parity_tests.running.harness import run_impl

    key = (impl, _case_key(case))
    if key in _RUNS:
        _RUNS.move_to_end(key)
        return _RUNS[key]
    traj = run_impl(case, impl)
    for a in traj.values():
        a.flags.writeable = False
    _RUNS[key] = traj
    while len(_RUNS) > _MAX_RUNS:
        _RUNS.popitem(last=False)
    return traj
