"""The torch engines, as each declares itself (framework-free: read without importing torch).

One entry per engine, beside the module that runs it (``entry``); the registry
(``parity_tests.running.builtins``) builds the built-in implementations from this
list and ``tfpar.engines``'. Adding a torch engine: its module, and one entry here.
"""

from __future__ import annotations

from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.optimizer_state import OPTIMIZERS
from parity_tests.protocol.vocabulary import ALL_COMBINES, LAYER_TYPES, ORDERS

__all__ = ["SPECS", "by_name"]

_MIXED = ("float32", "float64", "mixed_bfloat16")

SPECS: tuple[EngineSpec, ...] = (
    EngineSpec("torch.ddp", "builtin", "torch", parallel=True, dtypes=_MIXED, rounds_gradients=True, captures=True, captures_in_place=True,
               description="real torch DistributedDataParallel on gloo, N ranks of the warm worker pool",
               combines=ALL_COMBINES, orders=ORDERS, optimizers=OPTIMIZERS, layers=LAYER_TYPES, stateful=True,
               optimizer_family="torch", accumulate=True, entry="torchref.ddp:train_rank"),
    EngineSpec("torch.single", "builtin", "torch", parallel=False, dtypes=_MIXED, rounds_gradients=True, captures=True, captures_in_place=True,
               description="one torch process, the whole global batch",
               combines=ALL_COMBINES, orders=ORDERS, optimizers=OPTIMIZERS, layers=LAYER_TYPES, stateful=True,
               optimizer_family="torch", accumulate=True, entry="torchref.ddp:train_single"),
)


def by_name(name: str) -> EngineSpec:
    """The declaration of the torch engine ``name`` (``KeyError`` for another name)."""
    return {s.name: s for s in SPECS}[name]
