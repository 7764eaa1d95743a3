"""torch plugins for the MLP case that check the determinism setting their declaration asks for. No TensorFlow here."""

from __future__ import annotations

import torch
from torch_plugins import BOTH, _train

import torchref


def _expect(on: bool) -> None:
    if torch.are_deterministic_algorithms_enabled() != on:
        raise AssertionError(f"deterministic algorithms {'off' if on else 'on'} in this run")


@torchref.plugin.distributed(dtypes=BOTH, deterministic=False)
def declared_off(run):
    _expect(False)
    _train(run)


@torchref.plugin.distributed(dtypes=BOTH)
def declared_on(run):
    _expect(True)
    _train(run)
