"""tfpar: TensorFlow multi-device (tower) data-parallel training, as the seeds describe it.

The library a TensorFlow user imports to train on several devices:
``make_parallel``, ``average_gradients``, :class:`TowerTrainer`; and the
runner the parity tool calls (``run_case``). TensorFlow only: never imports torch.
"""

from .combine import average_gradients, combine_losses, tower_weights
from .devices import DeviceError, available_devices, configure_devices, tower_devices
from .optimizers import make_optimizer
from .run import IMPLS, run_case
from .sharding import shard_sizes, split_batch
from .towers import TowerTrainer, make_parallel

__all__ = [
    "IMPLS",
    "DeviceError",
    "TowerTrainer",
    "available_devices",
    "average_gradients",
    "combine_losses",
    "configure_devices",
    "make_optimizer",
    "make_parallel",
    "run_case",
    "shard_sizes",
    "split_batch",
    "tower_devices",
    "tower_weights",
]
