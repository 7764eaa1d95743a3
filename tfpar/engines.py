"""The TensorFlow engines, as each declares itself (framework-free: read without importing TensorFlow).

One entry per engine, beside the module that runs it (``entry``); the registry
(``parity_tests.running.builtins``) builds the built-in implementations from this
list and ``torchref.engines``', and ``run_case`` (:mod:`tfpar.run`) refuses what
an engine does not declare. Adding a TensorFlow engine: its module, and one entry here.
"""

from __future__ import annotations

from parity_tests.protocol.engine import EngineSpec
from parity_tests.protocol.optimizer_state import OPTIMIZERS
from parity_tests.protocol.vocabulary import ALL_COMBINES, COMBINES, LAYER_TYPES, ORDERS

__all__ = ["SPECS", "by_name"]

_DTYPES = ("float32", "float64")
_MIXED = (*_DTYPES, "mixed_bfloat16")

SPECS: tuple[EngineSpec, ...] = (
    EngineSpec("tf.towers", "builtin", "tf", parallel=True, dtypes=_MIXED, rounds_gradients=True, keras=True, captures=True, captures_in_place=True,
               description="the TF2 tower engine (tfpar.TowerTrainer): N towers on N logical devices, average_gradients,"
                           " one update",
               combines=ALL_COMBINES, orders=ORDERS, optimizers=OPTIMIZERS, layers=LAYER_TYPES, stepwise=True, stateful=True,
               optimizer_family="keras", sync_bn_gradient="own_loss", accumulate=True, entry="tfpar.towers:TowerTrainer"),
    EngineSpec("tf.single", "builtin", "tf", parallel=False, dtypes=_MIXED, rounds_gradients=True, keras=True, captures=True, captures_in_place=True,
               description="one TensorFlow device, the whole global batch",
               combines=ALL_COMBINES, orders=ORDERS, optimizers=OPTIMIZERS, layers=LAYER_TYPES, stepwise=True, stateful=True,
               optimizer_family="keras", accumulate=True, entry="tfpar.towers:TowerTrainer"),
    EngineSpec("tf.v1", "builtin", "tf", parallel=True, dtypes=_DTYPES, keras=True, captures=True,
               description="the classic tf.compat.v1 graph towers (variable_scope reuse, compute_gradients per tower,"
                           " average_gradients)",
               combines=COMBINES, orders=("split",), optimizers=("sgd", "momentum", "adam"), layers=LAYER_TYPES,
               optimizer_family="tf.compat.v1", accumulate=True, entry="tfpar.v1:run_v1"),
    EngineSpec("tf.mirrored", "builtin", "tf", parallel=True, dtypes=_DTYPES, keras=True, captures=True,
               description="tf.distribute.MirroredStrategy over the same logical devices, a custom training loop",
               combines=COMBINES, orders=("split",), optimizers=OPTIMIZERS, layers=LAYER_TYPES,
               optimizer_family="keras", accumulate=True, entry="tfpar.mirrored:run_mirrored"),
    EngineSpec("tf.multiworker", "builtin", "tf", parallel=True, dtypes=_DTYPES, keras=True,
               description="tf.distribute.MultiWorkerMirroredStrategy, one process per worker"
                           " (python -m parity_tests.launch.tf)",
               combines=COMBINES, orders=("split",), optimizers=OPTIMIZERS, layers=LAYER_TYPES,
               optimizer_family="keras", accumulate=True, entry="tfpar.multiworker:run_multiworker",
               in_process=False),
)


def by_name(name: str) -> EngineSpec:
    """The declaration of the TensorFlow engine ``name`` (``KeyError`` for another name)."""
    return {s.name: s for s in SPECS}[name]
