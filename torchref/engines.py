"""The torch engines, as each declares itself (framework-free: read without importing torch).

One entry per engine, beside the module that runs it (``entry``); the registry
(``parity_tests.running.builtins``) builds the built-in implementations from this
list and ``tfpar.engines``'. Adding a torch engine: its module, and one entry here.
"""

from __future__ import annotations

from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.optimizer_state import OPTIMIZERS

__all__ = ["SPECS", "by_name"]

_ALL_COMBINES = ("grad_mean", "loss_mean", "param_mean", "async")
_ORDERS = ("split", "distributed_sampler")
#: the layer vocabulary (docs/layers.md, docs/case-format.md) every engine here builds
_LAYERS = ("dense", "poly", "conv2d", "max_pool2d", "flatten", "batch_norm", "dropout", "activation", "layer_norm",
           "rms_norm", "residual", "repeat", "avg_pool2d", "global_avg_pool2d", "channel_pad", "reshape",
           "position_embedding", "class_token", "take_token", "depthwise_conv2d")
_MIXED = ("float32", "float64", "mixed_bfloat16")

SPECS: tuple[EngineSpec, ...] = (
    EngineSpec("torch.ddp", "builtin", "torch", parallel=True, dtypes=_MIXED, captures=True,
               description="real torch DistributedDataParallel on gloo, N ranks of the warm worker pool",
               combines=_ALL_COMBINES, orders=_ORDERS, optimizers=OPTIMIZERS, layers=_LAYERS, stateful=True,
               optimizer_family="torch", entry="torchref.ddp:train_rank"),
    EngineSpec("torch.single", "builtin", "torch", parallel=False, dtypes=_MIXED, captures=True,
               description="one torch process, the whole global batch",
               combines=_ALL_COMBINES, orders=_ORDERS, optimizers=OPTIMIZERS, layers=_LAYERS, stateful=True,
               optimizer_family="torch", entry="torchref.ddp:train_single"),
)


def by_name(name: str) -> EngineSpec:
    """The declaration of the torch engine ``name`` (``KeyError`` for another name)."""
    return {s.name: s for s in SPECS}[name]
