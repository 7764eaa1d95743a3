"""Localisation at block granularity (issue 27 item 6): layer paths, their execution order, and the forward
stage naming the block's layer where a nested model computes something else.

The case: ``dense 6 -> repeat 3 x residual(dense 6, layer_norm) -> dense 1`` (sigmoid cross-entropy, 16 rows
over 2 devices, float64, 2 SGD steps). ``plugins/nested_torch.py:planted_epsilon`` is a DDP port of it whose
layer norm in repeat copy 2's residual body (``1.2.0.body.1``) uses epsilon 1e-3 where the case says 1e-5.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from parity_tests.contract.paths import describe, execution_key, layer_of, layer_paths
from parity_tests.judging.localise import _gap, stage_chain, with_layer
from parity_tests.reporting.report import _where_name
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

PLUGIN = Path(__file__).parent / "plugins" / "nested_torch.py"
BLOCK = {"type": "residual", "body": [{"type": "dense", "units": 6}, {"type": "layer_norm", "epsilon": 1e-5}]}
CASE = make(MLP, model__layers=[{"type": "dense", "units": 6, "activation": "tanh"},
                                {"type": "repeat", "count": 3, "body": [BLOCK]},
                                {"type": "dense", "units": 1}],
            data__global_batch=16, steps=2, parallel__devices=2, optimizer={"name": "sgd", "lr": 0.1})
# every layer at every depth, in the order the forward pass finishes them
PATHS = ["0", *(p for r in range(3) for p in (f"1.{r}.0.body.0", f"1.{r}.0.body.1", f"1.{r}.0")), "1", "2"]


def test_paths_come_in_execution_order_with_their_types():
    layers = CASE.spec["model"]["layers"]
    assert [p for p, _ in layer_paths(layers)] == PATHS
    assert sorted(reversed(PATHS), key=execution_key) == PATHS
    # a residual's body, then its shortcut, then the residual itself; copies in order; a name that is no path last
    assert sorted(["3", "3.shortcut.0", "3.body.1", "logits", "3.body.0", "2.1.0", "2.0.1"], key=execution_key) == \
        ["2.0.1", "2.1.0", "3.body.0", "3.body.1", "3.shortcut.0", "3", "logits"]
    assert layer_of("1.2.0.body.1.gamma", layers) == "1.2.0.body.1 layer_norm"
    assert layer_of("1.2.0.body.1", layers) == "1.2.0.body.1 layer_norm"
    assert layer_of("1.2.0", layers) == "1.2.0 residual" and layer_of("1", layers) == "1 repeat"
    assert layer_of("1.3.0.body.1.gamma", layers) is None and layer_of("9.kernel", layers) is None  # no such layer
    assert describe("0.kernel", {"model": {"external": "mine"}}) is None and describe(None, CASE.spec) is None


def _captured(acts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"device/sizes": np.array([2, 2]), **{f"device/act/{k}": v for k, v in acts.items()}}


def test_the_first_nested_layer_that_differs_is_named_with_path_and_type():
    """Synthetic captures: every later layer differs too (it computes from the bad one); the chain names the earliest
    in execution order, not the lowest top-level index or the first in text order."""
    rng = np.random.default_rng(0)
    a = {p: rng.normal(size=(4, 3)) for p in PATHS}
    b = {p: v + (1.0 if execution_key(p) >= execution_key("1.2.0.body.1") else 0.0) for p, v in a.items()}
    where = stage_chain(_captured(a), _captured(b), 1, 1e-10, CASE.spec)
    assert (where["stage"], where["name"], where["device"]) == ("forward", "layer 1.2.0.body.1 layer_norm", None)
    assert "the output of layer 1.2.0.body.1 (layer_norm) differs" in where["explanation"]
    assert "while layers up to 1.2.0.body.0 (dense) agree" in where["explanation"]
    assert with_layer(where, CASE.spec)["layer"] == "1.2.0.body.1 layer_norm"
    # nothing differs: the forward stage agrees through the last layer, named so
    same = stage_chain(_captured(a), _captured(a), 1, 1e-10, CASE.spec)
    assert same["stage"] is None and {"stage": "forward", "device": None, "name": "layer 2 dense", "gap": 0.0,
                                      "bound": 1e-10} in same["chain"]
    # without the case (an external model's plugin names) the key is the name
    assert stage_chain(_captured(a), _captured(b), 1, 1e-10)["name"] == "layer 1.2.0.body.1"


def test_parameter_names_carry_their_layer_in_the_report():
    where = {"name": "1.2.0.body.1.gamma", "stage": "update"}
    assert _where_name(with_layer(where, CASE.spec)) == "1.2.0.body.1.gamma (1.2.0.body.1 layer_norm)"
    assert "layer" not in with_layer({"name": None}, CASE.spec)
    assert _where_name(with_layer({"name": "layer 1.2.0 residual"}, CASE.spec)) == "layer 1.2.0 residual"


@pytest.mark.parametrize("impl", ["tf.towers", "tf.single", "tf.mirrored", "tf.v1", "torch.ddp", "torch.single"])
def test_builtins_record_every_nested_layer_by_path(pool, impl):
    """Every built-in against torch.ddp at the captured step: the same keys, every nested layer, and
    the same values to float64 rounding (~1e-16; a layer recorded under another path differs by O(1))."""
    captured = dataclasses.replace(CASE, capture=1)
    ref, got = run_impl(captured, "torch.ddp"), run_impl(captured, impl)
    keys = sorted(k[len("device/act/"):] for k in got if k.startswith("device/act/"))
    assert keys == sorted(PATHS)
    for p in PATHS:
        assert got[f"device/act/{p}"].shape == (16, 1 if p == "2" else 6), p
        assert _gap(ref[f"device/act/{p}"], got[f"device/act/{p}"]) < 1e-12, p


def test_a_wrong_epsilon_in_one_block_is_found_in_that_block(pool):
    """The planted layer norm changes its output by ~1e-3 relative (epsilon 1e-3 against 1e-5 at a variance
    near 1: 1/sqrt(1 + 1e-3) - 1/sqrt(1 + 1e-5) is 5e-4) while every layer before it agrees to rounding
    (~1e-16); the float64 bound is 1e-10. Named in the localisation, the report's name and the compare output."""
    result = compare_case(CASE, ["torch.ddp", f"{PLUGIN}:planted_epsilon"])
    where = result.pairs[0].localisation
    assert (where["first_bad_step"], where["stage"], where["device"]) == (1, "forward", None)
    assert where["name"] == "layer 1.2.0.body.1 layer_norm" and where["layer"] == "1.2.0.body.1 layer_norm"
    assert "while layers up to 1.2.0.body.0 (dense) agree" in where["explanation"]
    assert "where: forward at step 1, layer 1.2.0.body.1 layer_norm" in result.summary()
    assert "| layer 1.2.0.body.1 layer_norm |" in _report_md(result)
    # the same port without the mistake: parity, nothing to localise
    assert compare_case(CASE, ["torch.ddp", f"{PLUGIN}:good"]).pairs[0].verdict.status == "parity"


def _report_md(result) -> str:  # noqa: ANN001
    from parity_tests.reporting.report import render_markdown

    return render_markdown([result], "paths", {"versions": {}}, {})


def test_plugin_layer_hooks_name_the_block_by_the_modules_own_names(pool):
    """The same network as ``nn.Module`` blocks (``blocks[r].body = Sequential(Linear, LayerNorm)``, the add in
    ``forward``), no activations passed: the hooks number its layers ``hooks.<i>`` (a nested case does not line
    up with the hooks' flat numbering) and name them by the modules' qualified names, so copy 2's layer norm is
    found as ``blocks.2.body.1 LayerNorm`` (under DDP: ``module.blocks.2.body.1``)."""
    where = compare_case(CASE, [f"{PLUGIN}:modules_good", f"{PLUGIN}:modules_planted_epsilon"]).pairs[0].localisation
    assert (where["first_bad_step"], where["stage"], where["device"]) == (1, "forward", None)
    # layers: inp+tanh 0, then per block its Linear and its LayerNorm (1-2, 3-4, 5-6), head 7
    assert where["name"] == "layer hooks.6 (module.blocks.2.body.1 LayerNorm)", where
    assert "while layers up to hooks.5 agree" in where["explanation"]
    # the port without the mistake trains as the built-in does (the planted epsilon is the only difference)
    assert compare_case(CASE, ["torch.ddp", f"{PLUGIN}:modules_good"]).pairs[0].verdict.status == "parity"
