"""Where-lines for plugins as users write them (issue 35): micro-batches are rows read, and the layer hooks' layers
are the case's layers (plugins/localise_torch.py against the built-in ``tf.towers``).

Float64, SGD: a correct port is at parity with ``tf.towers`` to rounding (1e-16 against the 1e-10 bound), and a
seeded bug moves what it touches by O(0.1) or a factor of 2, so each expected stage holds far from the bound.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

PLUGIN = f"{Path(__file__).parent / 'plugins' / 'localise_torch.py'}"
SGD = {"name": "sgd", "lr": 0.1}
#: dense 10 relu -> dense 1 on 2 ranks, 8 rows each a step, cut into 2 micro-batches of 4
ACCUMULATE = make(MLP, parallel__devices=2, parallel__accumulate=2, data__global_batch=16, steps=2, optimizer=SGD)
#: flatten -> dense 6 relu -> dense 1 on [2, 3] inputs, 2 ranks
FLATTEN = make(MLP, model__input_shape=[2, 3], model__layers=[
    {"type": "flatten"}, {"type": "dense", "units": 6, "activation": "relu"}, {"type": "dense", "units": 1}],
    data={"generator": "gaussian", "seed": 4, "global_batch": 16}, parallel__devices=2, steps=2, optimizer=SGD)


def test_micro_batches_are_rows_read(pool):
    """A rank that accumulates 2 micro-batches read its 8 rows, as ``tf.towers`` with ``accumulate: 2`` says;
    the hooks kept the first micro-batch and the pair was placed at ``inputs`` ("8 rows in all, the
    reference's 16") whether the plugin was right or not. The correct port's captured rows and layer
    outputs are the towers' (the same numbers); a port that sums its micro-batch gradients is found where
    it is: the combined gradient, 2x."""
    captured = dataclasses.replace(ACCUMULATE, capture=1)
    mine, towers = run_impl(captured, f"{PLUGIN}:accumulate"), run_impl(captured, "tf.towers")
    assert list(mine["device/sizes"]) == [8, 8] == list(towers["device/sizes"])
    for layer in ("0", "1"):
        a, b = towers[f"device/act/{layer}"], mine[f"device/act/{layer}"]
        assert a.shape == b.shape == (16, 10 if layer == "0" else 1)
        assert np.abs(a - b).max() <= 1e-12 * np.abs(a).max()  # float64 rounding of one layer: ~1e-16 relative
    result = compare_case(ACCUMULATE, ["tf.towers", f"{PLUGIN}:accumulate", f"{PLUGIN}:accumulate_summed"])
    good, summed = result.pairs
    assert good.verdict.status == "parity", good.verdict.detail
    where = summed.localisation
    assert where["stage"] == "combined_grads" and "rows in all" not in where["explanation"], where["explanation"]


def test_hook_layers_are_named_as_the_cases_layers(pool):
    """A port that flattens in ``forward`` has no module for the case's ``flatten``: its first ``Linear`` is the
    case's layer 1, and a bug there is named ``layer 1 dense`` (the hooks' layer 0 was named ``layer 0 flatten``)."""
    result = compare_case(FLATTEN, ["tf.towers", f"{PLUGIN}:flatten_in_code", f"{PLUGIN}:flatten_in_code_tanh"])
    good, bad = result.pairs
    assert good.verdict.status == "parity", good.verdict.detail
    where = bad.localisation
    assert (where["stage"], where["name"].split(" (")[0]) == ("forward", "layer 1 dense"), where
    assert where["layer"] == "1 dense" and "flatten" not in where["name"], where
    assert "(the first layer both sides recorded)" in where["explanation"], where  # the port has no flatten module


def test_rows_dealt_otherwise_are_named_at_inputs_from_what_the_hooks_saw(pool):
    """The port reads rows r::N (``DistributedSampler``'s dealing) where ``tf.towers`` deals contiguous slices: the
    same 16 rows on other ranks. From the rows its first ``Linear`` received (flattened in torch's order) against the
    towers' input images, matched by content: stage ``inputs``, the dealing named, the forward pass the same on
    matching rows (it was "forward ..., layer 0 flatten ... differs on every device"). The captured step is judged
    against the float64 bound, 1e-10."""
    from parity_tests.judging.localise import stage_chain

    captured = dataclasses.replace(FLATTEN, capture=1)
    towers, strided = run_impl(captured, "tf.towers"), run_impl(captured, f"{PLUGIN}:flatten_in_code_strided")
    where = stage_chain(towers, strided, 1, 1e-10, FLATTEN.spec)
    text = where["explanation"]
    assert (where["stage"], where["device"]) == ("inputs", None), text
    assert "dealt contiguous slices (the reference) vs rows r, r+N, ... (the other, as DistributedSampler" in text, text
    assert "on matching rows the forward pass agrees" in text and "through layer 2 (dense)" in text, text
    assert "the gradient applied agrees" in text, text


def test_a_float32_count_in_a_float64_run_is_named_by_its_size(pool):
    """``1 / num_tokens`` with the count made a float32 tensor, in a float64 run: every gradient is off by
    ``fl32(1/6) * 6 - 1`` = 2^-25 relative (6 rows a rank), a gap no float64 arithmetic makes. The where-line
    says it is of float32 rounding size (issue 35: 2^-24-sized gaps with nothing saying float32)."""
    case = make(MLP, parallel__devices=2, data__global_batch=12, steps=2, optimizer=SGD)
    pair = compare_case(case, ["tf.towers", f"{PLUGIN}:count_in_float32"]).pairs[0]
    where = pair.localisation
    assert pair.verdict.status == "divergence" and where["gap"] < 2.0 ** -20, where
    assert "a gap of float32 rounding size" in where["explanation"] and "in a float64 run: something computes in" \
        " float32" in where["explanation"], where["explanation"]


def test_a_clip_of_a_loss_scaled_gradient_is_named_as_the_clip_that_acted(pool):
    """The port clips once after the all-reduce, as the case says, but the gradient of its loss times 128: its clip
    acts at 1/128 of the threshold. Named as one global-norm clip after the combination on both sides, the port's
    at a threshold 128x below the case's (issue 35: "each device scaled by its own factor: clipped per device?").
    ``tf.towers`` clips by TensorFlow's formula, the port by torch's (``c / (norm + 1e-6)``): the same threshold
    to 1e-6 relative at norms of order 1."""
    case = make(MLP, parallel__devices=2, data__global_batch=16, steps=2, optimizer={**SGD, "semantics": "tf"},
                parallel__clip={"global_norm": 0.05, "where": "after_combine"})
    where = compare_case(case, ["tf.towers", f"{PLUGIN}:clip_loss_scaled"]).pairs[0].localisation
    text = where["explanation"]
    assert where["stage"] == "clip" and "per device" not in text and "each device" not in text, text
    assert "the reference applied the equal mean (1/N each) of the device gradients clipped once after the" \
           " combination" in text and "= 0.05 / " in text, text
    assert "128x below the case's 0.05" in text and "loss scale" in text, text
