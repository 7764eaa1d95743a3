"""tfpar: TensorFlow multi-device (tower) data-parallel training, as the classic tower programs describe it (docs/implementations.md).

The library a TensorFlow user imports to train on several devices:
``make_parallel``, ``average_gradients``, :class:`TowerTrainer`; the classic tower programs'
own ``tf.compat.v1`` graph towers (``build_towers``, :mod:`tfpar.v1`) and a
``MirroredStrategy`` loop (:mod:`tfpar.mirrored`); and the runner the parity
tool calls (``run_case``). TensorFlow only: never imports torch. Names load on first use
(``tfpar.engines``, the engines' declarations, imports no TensorFlow).
"""

from __future__ import annotations

import importlib
from typing import Any

#: each public name -> the submodule that defines it (imported on first use: ``import tfpar`` and
#: ``tfpar.engines`` stay free of TensorFlow, so the judge can read the engines' declarations)
_WHERE = {
    "plugin": "plugin",
    "AsyncTrainer": "async_",
    "average_gradients": "combine",
    "combine_losses": "combine",
    "tower_weights": "combine",
    "DeviceError": "devices",
    "DeviceInfo": "devices",
    "available_devices": "devices",
    "configure_devices": "devices",
    "list_devices": "devices",
    "session_config": "devices",
    "tower_devices": "devices",
    "Unsupported": "errors",
    "LocalSGDTrainer": "local_sgd",
    "make_strategy": "mirrored",
    "make_optimizer": "optimizers",
    "IMPLS": "run",
    "run_case": "run",
    "shard_sizes": "sharding",
    "split_batch": "sharding",
    "TowerTrainer": "towers",
    "make_parallel": "towers",
    "ExactRuleOptimizer": "v1",
    "Towers": "v1",
    "build_towers": "v1",
    "make_v1_optimizer": "v1",
}

__all__ = sorted(_WHERE)  # the public names are the table's keys


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
        return module if _WHERE[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
