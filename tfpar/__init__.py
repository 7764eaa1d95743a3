"""tfpar: TensorFlow multi-device (tower) data-parallel training, as the classic tower programs describe it (docs/implementations.md).

The library a TensorFlow user imports to train on several devices:
``make_parallel``, ``average_gradients``, :class:`TowerTrainer`; the classic tower programs'
own ``tf.compat.v1`` graph towers (``build_towers``, :mod:`tfpar.v1`) and a
``MirroredStrategy`` loop (:mod:`tfpar.mirrored`); and the runner the parity
tool calls (``run_case``). TensorFlow only: never imports torch.
"""

from . import plugin
from .async_ import AsyncTrainer
from .combine import average_gradients, combine_losses, tower_weights
from .devices import (
    DeviceError,
    DeviceInfo,
    available_devices,
    configure_devices,
    list_devices,
    session_config,
    tower_devices,
)
from .errors import Unsupported
from .local_sgd import LocalSGDTrainer
from .mirrored import make_strategy
from .optimizers import make_optimizer
from .run import IMPLS, run_case
from .sharding import shard_sizes, split_batch
from .towers import TowerTrainer, make_parallel
from .v1 import ExactRuleOptimizer, Towers, build_towers, make_v1_optimizer

__all__ = [
    "plugin",
    "AsyncTrainer",
    "LocalSGDTrainer",
    "Unsupported",
    "IMPLS",
    "DeviceError",
    "DeviceInfo",
    "ExactRuleOptimizer",
    "TowerTrainer",
    "Towers",
    "available_devices",
    "average_gradients",
    "build_towers",
    "combine_losses",
    "configure_devices",
    "list_devices",
    "make_optimizer",
    "make_parallel",
    "make_strategy",
    "make_v1_optimizer",
    "run_case",
    "session_config",
    "shard_sizes",
    "split_batch",
    "tower_devices",
    "tower_weights",
]
