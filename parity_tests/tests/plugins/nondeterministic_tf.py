"""TensorFlow plugins declared ``deterministic=False`` for the MLP case of ``tests/helpers.py``.

Each run of ``noisy`` records its parameters moved by ``+EPS`` or ``-EPS`` (alternating from one
run to the next, counted in the file ``$TFPAR_TEST_RUN_COUNTER``): a run-to-run spread of
``2 EPS`` with no difference in what is computed. ``noisy_and_wrong`` also steps with a learning
rate 1% too large, a difference far beyond that spread. ``noisy_declared_deterministic`` is
``noisy`` without the declaration (the premise: the same pair is a divergence then).
"""

from __future__ import annotations

import os

import tensorflow as tf
from tf_plugins import BOTH, _train

import tfpar

EPS = 1e-8  # relative to parameters of order 0.1-1: far above float64 rounding, far below a real bug


def _run_index() -> int:
    with open(os.environ["TFPAR_TEST_RUN_COUNTER"], "a+") as f:
        f.seek(0)
        index = len(f.read())
        f.write("x")
    return index


def _noisy(run, lr_scale: float = 1.0) -> None:
    sign = 1.0 if _run_index() % 2 == 0 else -1.0

    def change(k, loss, params):
        return loss, {n: v + sign * EPS * tf.ones_like(v) for n, v in params.items()}

    _train(run, change=change, lr_scale=lambda k: lr_scale)


@tfpar.plugin.tensorflow(dtypes=BOTH, deterministic=False)
def noisy(run):
    _noisy(run)


@tfpar.plugin.tensorflow(dtypes=BOTH, deterministic=False)
def noisy_and_wrong(run):
    _noisy(run, lr_scale=1.01)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def noisy_declared_deterministic(run):
    _noisy(run)


@tfpar.plugin.tensorflow(dtypes=BOTH)
def noisy_slightly_wrong_declared_deterministic(run):
    """A learning rate 0.1% too large, a gap beyond the spread but within what the float64
    conditioning check would call amplified rounding if it took the noise for conditioning."""
    _noisy(run, lr_scale=1.001)
