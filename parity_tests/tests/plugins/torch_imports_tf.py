"""A torch plugin whose module imports TensorFlow at its top level (refused: every rank would load it)."""

import tensorflow  # noqa: F401

import torchref


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    raise AssertionError("never reached")
