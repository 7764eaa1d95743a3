"""``parity_tests.reporting.stages``: the stage-chain figure draws every gap a localisation can hold."""

from __future__ import annotations

import warnings

import pytest

from parity_tests.reporting.stages import plot_stage_chain

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("chain", [
    [{"stage": "forward", "gap": 0.0, "bound": 1e-12}, {"stage": "loss", "gap": 3e-9, "bound": 1e-10}],
    [{"stage": "device_grads", "gap": float("inf"), "bound": 1e-7}],  # one side blew up
    [{"stage": "loss", "gap": float("nan"), "bound": 1e-7}, {"stage": "clip", "gap": None, "bound": None}],
    [{"stage": "combined_grads", "gap": 5.0, "bound": 1e-300}],  # gap / bound above any log axis
], ids=["finite", "inf", "nan-and-missing", "ratio-overflows"])
def test_a_stage_chain_is_drawn_without_a_warning(chain):
    """Non-finite gaps and huge ratios are drawn at the ceiling (1e30): matplotlib's log axis
    overflowed on the old 1e300 (warnings in every ``make report``, and a singular axis)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plot_stage_chain(chain, "tf.towers vs torch.ddp")
    assert png.startswith(PNG)
