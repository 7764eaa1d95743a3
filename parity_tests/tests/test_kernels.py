"""The bfloat16 kernel probe (parity_tests.running.kernels): what it measures, where, and how the judge reads it."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.running import kernels
from parity_tests.running.kernels import (
    ONE_ROUNDING,
    OPS,
    PROBE_TERMS,
    TF_ONLY,
    case_ops,
    exact_results,
    measure,
    probe_inputs,
)
from parity_tests.tests.helpers import CNN, MLP

pytestmark = pytest.mark.usefixtures("pool")

U_B = 2.0**-8  # bfloat16's unit roundoff (8 significant bits)


def _round_bf16(a: np.ndarray) -> np.ndarray:
    """Round to nearest even on bfloat16's 8 significant bits (float64 in, float64 out), written out independently."""
    m, e = np.frexp(a)  # a = m 2^e, 0.5 <= |m| < 1: 8 significant bits are m * 2^8 rounded
    return np.ldexp(np.round(m * 2.0**8), e - 8)  # np.round: ties to even


def test_inputs_are_exact_in_bfloat16_positive_and_long():
    for op, arrays in probe_inputs().items():
        for name, a in arrays.items():
            assert a.dtype == np.float32 and np.all((a >= 1) & (a < 2)), (op, name)
            np.testing.assert_array_equal(_round_bf16(a.astype(np.float64)), a)  # no input rounding to measure
    exact = exact_results(probe_inputs())
    assert set(exact) == set(OPS)
    assert exact["dense bias gradient"].min() > PROBE_TERMS  # n terms of at least 1 each: no cancellation


def test_the_conv_input_gradient_is_the_transposed_conv():
    """The centre pixel's gradient, written as a sum over output positions and taps (loops, not the formula)."""
    arrays = probe_inputs()["conv2d input gradient"]
    k, g = arrays["k"].astype(np.float64), arrays["g"].astype(np.float64)
    want = np.zeros(k.shape[2])
    for p in np.ndindex(3, 3):  # output position; SAME: y[p] = sum_t x[p + t - 1] k[t]
        for t in np.ndindex(3, 3):
            if (p[0] + t[0] - 1, p[1] + t[1] - 1) == (1, 1):
                want += k[t[0], t[1]] @ g[0, p[0], p[1]]
    np.testing.assert_allclose(exact_results(probe_inputs())["conv2d input gradient"], want, rtol=1e-12)


def test_rho_reads_one_rounding_as_float32_and_more_as_bfloat16():
    exact = {"op": np.array([1000.0, 1500.0])}
    rounded = _round_bf16(exact["op"])
    assert measure({"op": rounded}, exact)["op"]["accumulates"] == "float32"
    edge = exact["op"] * (1 + ONE_ROUNDING * U_B)  # the largest error one rounding plus float32 summation leaves
    assert measure({"op": edge}, exact)["op"] == {"rho": round(ONE_ROUNDING, 4), "accumulates": "float32"}
    assert measure({"op": exact["op"] * (1 + 1.1 * ONE_ROUNDING * U_B)}, exact)["op"]["accumulates"] == "bfloat16"
    # a sequential bfloat16 sum of 4096 terms of [1, 2) stagnates: far more than one rounding
    terms = probe_inputs()["sum"]["g"][:, 0].astype(np.float64)
    acc = terms[0]
    for t in terms[1:]:
        acc = _round_bf16(np.float64(acc + t))
    got = measure({"sum": np.array([acc])}, {"sum": np.array([terms.sum()])})["sum"]
    assert got["accumulates"] == "bfloat16" and got["rho"] > 50


@pytest.mark.parametrize("framework", ["tf", "torch"])
def test_each_framework_probes_its_ops_where_it_runs(framework):
    found = kernels.probe(framework)
    want = set(OPS) if framework == "tf" else set(OPS) - set(TF_ONLY)
    assert set(found["ops"]) == want
    for op, v in found["ops"].items():  # whatever this CPU does, every sum is at least as good as sequential bfloat16
        assert 0 <= v["rho"] < 300 and v["accumulates"] == ("float32" if v["rho"] <= ONE_ROUNDING else "bfloat16"), op
    assert kernels.probe(framework) is found  # measured once per process
    if framework == "torch":
        assert {"cpu_capability", "mkldnn_bfloat16", "avx512_bf16", "amx_tile", "onednn"} <= set(found["torch"])
        if found["torch"]["mkldnn_available"]:  # oneDNN's own verbose line names the ISA it dispatches to
            assert found["torch"]["onednn"]["isa"], found["torch"]
    with pytest.raises(ValueError, match="framework"):
        kernels.probe("jax")


def test_the_ops_a_case_runs():
    mlp = case_ops(MLP["model"]["layers"], "tf")
    assert mlp == ["matmul", "matmul weight gradient", "dense bias gradient", "matmul input gradient"]
    cnn = case_ops(CNN["model"]["layers"], "torch")
    assert "conv2d filter gradient" in cnn and "conv2d input gradient" not in cnn  # the first layer: no input gradient
    assert "matmul input gradient" in cnn  # the dense layer after conv and batch norm passes its gradient back
    no_bias = case_ops([{"type": "dense", "units": 1, "use_bias": False}], "tf")
    assert no_bias == ["matmul", "matmul weight gradient"]


def test_side_factor_is_the_worst_kernel_of_the_recipe_and_at_least_1(monkeypatch):
    ops = {op: {"rho": 0.8, "accumulates": "float32"} for op in OPS}
    monkeypatch.setattr(kernels, "_cache", {"tf": {"ops": ops}})
    assert kernels.side_factor(MLP["model"]["layers"], "tf") == (1.0, "tf: every kernel of the recipe sums in float32 and rounds once here")
    ops["conv2d filter gradient"] = {"rho": 2.09, "accumulates": "bfloat16"}  # Eigen's, measured
    assert kernels.side_factor(MLP["model"]["layers"], "tf")[0] == 1.0  # the MLP runs no conv
    rho, why = kernels.side_factor(CNN["model"]["layers"], "tf")
    assert rho == 2.09 and "conv2d filter gradient rho 2.09" in why
    ops["conv2d bias_add gradient"] = {"rho": 235.0, "accumulates": "bfloat16"}  # not on the recipe's path
    assert kernels.side_factor(CNN["model"]["layers"], "tf")[0] == 2.09


def test_the_ops_an_architecture_runs_nested_ones_included():
    """Layers inside residual bodies count; attention runs batch matmuls (and a softmax where Keras' explicit
    path takes it in bfloat16), a depthwise conv its own kernels; Keras' bias_add only when asked (two
    TensorFlow sides) and only for a layer whose semantics is not torch's."""
    block = {"type": "residual", "body": [
        {"type": "layer_norm", "epsilon": 1e-5},
        {"type": "attention", "num_heads": 2, "key_dim": 4, "dropout": 0.0},
        {"type": "dense", "units": 8, "use_bias": True, "semantics": "torch"}]}
    ops = case_ops([block], "tf")
    assert "batch matmul" in ops and "softmax" not in ops and "matmul input gradient" in ops
    assert "dense bias_add gradient" not in ops and "dense bias gradient" in ops
    with_dropout = case_ops([{**block, "body": [{**block["body"][1], "dropout": 0.1}]}], "torch")
    assert "softmax" in with_dropout
    both_tf = case_ops([block], "tf", bias_add=True)
    assert "dense bias_add gradient" in both_tf  # the attention's output bias, Keras' bias_add
    assert "dense bias_add gradient" not in case_ops([block["body"][2]], "tf", bias_add=True)  # semantics torch
    assert "dense bias_add gradient" not in case_ops([block], "torch", bias_add=True)
    depthwise = case_ops([{"type": "depthwise_conv2d", "kernel_size": [3, 3], "use_bias": True}], "tf")
    assert depthwise[:2] == ["depthwise conv2d", "depthwise conv2d filter gradient"]


def test_side_factor_takes_bias_add_only_when_asked(monkeypatch):
    ops = {op: {"rho": 0.8, "accumulates": "float32"} for op in OPS}
    ops["dense bias_add gradient"] = {"rho": 235.0, "accumulates": "bfloat16"}  # this CPU's, measured
    monkeypatch.setattr(kernels, "_cache", {"tf": {"ops": ops}})
    assert kernels.side_factor(MLP["model"]["layers"], "tf")[0] == 1.0
    rho, why = kernels.side_factor(MLP["model"]["layers"], "tf", bias_add=True)
    assert rho == 235.0 and "dense bias_add gradient rho 235" in why
