"""Which kernels round or accumulate in bfloat16 here: a probe of every op a mixed-precision recipe runs.

A ``mixed_bfloat16`` run's distance from its float64 run depends on how each kernel sums:
a kernel that accumulates its bfloat16 products in float32 and rounds the result once is
off by at most one bfloat16 rounding, while one that rounds its partial sums to bfloat16
is off by many (measured: TensorFlow's Eigen ``Conv2DBackpropFilter`` and ``BiasAddGrad``,
which run where TensorFlow does not hand bfloat16 to oneDNN). Which kernel runs depends
on the CPU and the settings (:mod:`parity_tests.running.cpu`), so it is measured where
the runs run: TensorFlow's ops in this process (:mod:`tfpar.kernel_probe`), torch's in a
rank of the worker pool (:mod:`torchref.kernel_probe`), never both in one process.

The probe (:func:`probe_inputs`, :func:`measure`): every op gets positive inputs in
``[1, 2)`` that are exact in bfloat16 (so no input rounding) and sums :data:`PROBE_TERMS`
of their products per output element; with no cancellation the exact result's relative
error measures the rounding alone::

    rho = max over outputs of |out - exact| / (u_b * |exact|),   u_b = 2**-8

(``exact``: float64 on the same inputs; ``u_b``: bfloat16's unit roundoff, 8 significant
bits). A kernel that accumulates in float32 and rounds once has ``rho <= 1 + 2**-4``: one
bfloat16 rounding (``<= u_b``) plus float32's summation error for ``n = 2**12`` positive
terms (``<= n * 2**-24 = 2**-4 * u_b``; the products of two bfloat16 numbers are exact in
float32). Anything above rounds partial sums to bfloat16: ``rho`` says how many roundings'
worth (measured on this CPU with oneDNN: every op of both recipes ``<= 0.9``; with
``TF_ENABLE_ONEDNN_OPTS=0`` TensorFlow's conv filter gradient 30, ``BiasAddGrad`` 235).
``rho`` depends on the length and shape of the sum; the probe's 4096 terms are more than
any reduction of the matrix's mixed cases (the CNN's filter gradient: 1536 per device).

The probe costs about 0.3 s per framework (traced functions on small arrays), runs once
per process (:func:`probe`, cached) and only when a ``mixed_bfloat16`` case is judged or
recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity_tests.judging.theory import BIAS_ADD_OPS, keras_adds_bias

__all__ = ["PROBE_TERMS", "ONE_ROUNDING", "OPS", "TF_ONLY", "probe_inputs", "exact_results", "measure",
           "probe", "case_ops", "side_factor", "describe"]

#: terms per output element of every probed sum
PROBE_TERMS = 4096
#: the largest ``rho`` of a kernel that sums in float32 and rounds once (module docstring)
ONE_ROUNDING = 1.0 + 2.0**-4
_U_B = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits, round to nearest
_C = 455  # conv channels: 9 * 455 = 4095 terms per output (the forward conv and the input gradient)
_SIDE = 64  # conv image side: 64 * 64 = 4096 positions per filter-gradient and bias-gradient sum

#: op -> what it computes, on the probe's inputs (each framework's probe runs its recipe's kernel for it)
OPS: dict[str, str] = {
    "matmul": "a [4, n] @ b [n, 8] (a dense layer's forward)",
    "matmul weight gradient": "x^T g, x [n, 4], g [n, 8] (a dense kernel's gradient: a sum over the batch)",
    "matmul input gradient": "g w^T, g [4, n], w [8, n] (the gradient a dense layer passes back)",
    "dense bias gradient": "sum of g [n, 8] over rows (Keras: bfloat16 h + bias; torch: float32 h + bias)",
    "dense bias_add gradient": "the same with x [n, 4] @ w and the bias added with tf.nn.bias_add: TensorFlow only",
    "conv2d": "3x3 VALID conv of x [1, 3, 3, 455] with k [3, 3, 455, 8]: one output, 4095 terms",
    "conv2d filter gradient": "3x3 SAME conv on [1, 64, 64, 4] -> 8 channels: the centre tap's gradient, 4096 positions",
    "conv2d input gradient": "3x3 SAME conv of [1, 3, 3, 8] to 455 channels: the centre pixel's gradient, 4095 terms",
    "conv2d bias gradient": "the same conv's bias gradient (Keras: ops.add; torch: the bias inside conv2d)",
    "conv2d bias_add gradient": "the same conv's bias added with tf.nn.bias_add (BiasAddGrad): TensorFlow only",
    "sum": "a bfloat16 tensor [n, 8] summed over rows (reduce_sum / Tensor.sum)",
    "batch matmul": "a [2, 4, n] @ b [2, n, 8] (attention's q k^T and weights @ v, and their gradients)",
    "softmax": "softmax over n bfloat16 logits [2, n] (attention's weights on Keras' explicit path)",
    "depthwise conv2d": "64x64 VALID depthwise conv of x [1, 64, 64, 2] with k [64, 64, 2, 1]: 4096 terms an output",
    "depthwise conv2d filter gradient": "3x3 SAME depthwise conv on [1, 64, 64, 4]: the centre tap's gradient, 4096 positions",
}
#: ops only one framework has
TF_ONLY = ("dense bias_add gradient", "conv2d bias_add gradient")

_lock = threading.Lock()
_cache: dict[str, dict[str, Any]] = {}


def _bf16_exact(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Uniform in [1, 2), truncated to bfloat16's 8 significant bits (exact in bfloat16), float32."""
    a = rng.uniform(1.0, 2.0, size=shape).astype(np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def probe_inputs() -> dict[str, dict[str, np.ndarray]]:
    """The probe's inputs per op (NHWC images, HWIO kernels), seeded: the same on every machine."""
    rng = np.random.default_rng(0xBF16)
    n = PROBE_TERMS
    return {
        "matmul": {"a": _bf16_exact(rng, 4, n), "b": _bf16_exact(rng, n, 8)},
        "matmul weight gradient": {"x": _bf16_exact(rng, n, 4), "g": _bf16_exact(rng, n, 8)},
        "matmul input gradient": {"g": _bf16_exact(rng, 4, n), "w": _bf16_exact(rng, 8, n)},
        "dense bias gradient": {"g": _bf16_exact(rng, n, 8)},
        "conv2d": {"x": _bf16_exact(rng, 1, 3, 3, _C), "k": _bf16_exact(rng, 3, 3, _C, 8)},
        "conv2d filter gradient": {"x": _bf16_exact(rng, 1, _SIDE, _SIDE, 4), "g": _bf16_exact(rng, 1, _SIDE, _SIDE, 8)},
        "conv2d input gradient": {"k": _bf16_exact(rng, 3, 3, 8, _C), "g": _bf16_exact(rng, 1, 3, 3, _C)},
        "sum": {"g": _bf16_exact(rng, n, 8)},
        "batch matmul": {"a": _bf16_exact(rng, 2, 4, n), "b": _bf16_exact(rng, 2, n, 8)},
        "softmax": {"x": _bf16_exact(rng, 2, n)},
        "depthwise conv2d": {"x": _bf16_exact(rng, 1, _SIDE, _SIDE, 2), "k": _bf16_exact(rng, _SIDE, _SIDE, 2, 1)},
        "depthwise conv2d filter gradient": {"x": _bf16_exact(rng, 1, _SIDE, _SIDE, 4),
                                             "g": _bf16_exact(rng, 1, _SIDE, _SIDE, 4)},
    }


def exact_results(inputs: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """What each op computes in exact arithmetic (float64 on the bfloat16-exact inputs; the shapes the probes return)."""
    f = {op: {k: np.asarray(v, np.float64) for k, v in arrays.items()} for op, arrays in inputs.items()}
    conv_g = f["conv2d filter gradient"]
    ig = f["conv2d input gradient"]
    # input gradient of a 3x3 SAME cross-correlation at the centre of a 3x3 image: output p reaches it
    # through tap 2 - p, for all 9 output positions p and every output channel
    centre = sum(np.einsum("c,ic->i", ig["g"][0, i, j], ig["k"][2 - i, 2 - j]) for i in range(3) for j in range(3))
    return {
        "matmul": f["matmul"]["a"] @ f["matmul"]["b"],
        "matmul weight gradient": f["matmul weight gradient"]["x"].T @ f["matmul weight gradient"]["g"],
        "matmul input gradient": f["matmul input gradient"]["g"] @ f["matmul input gradient"]["w"].T,
        "dense bias gradient": f["dense bias gradient"]["g"].sum(0),
        "dense bias_add gradient": f["dense bias gradient"]["g"].sum(0),
        "conv2d": np.einsum("hwc,hwco->o", f["conv2d"]["x"][0], f["conv2d"]["k"]),
        "conv2d filter gradient": np.einsum("hwc,hwo->co", conv_g["x"][0], conv_g["g"][0]),
        "conv2d input gradient": centre,
        "conv2d bias gradient": conv_g["g"][0].sum((0, 1)),
        "conv2d bias_add gradient": conv_g["g"][0].sum((0, 1)),
        "sum": f["sum"]["g"].sum(0),
        "batch matmul": f["batch matmul"]["a"] @ f["batch matmul"]["b"],
        "softmax": _softmax(f["softmax"]["x"]),
        "depthwise conv2d": np.einsum("hwc,hwc->c", f["depthwise conv2d"]["x"][0], f["depthwise conv2d"]["k"][..., 0]),
        "depthwise conv2d filter gradient": np.einsum("hwc,hwc->c", f["depthwise conv2d filter gradient"]["x"][0],
                                                      f["depthwise conv2d filter gradient"]["g"][0]),
    }


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def measure(outputs: Mapping[str, Any], exact: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per op: ``rho`` (module docstring) and ``accumulates``: ``float32`` (rounds once) or ``bfloat16``."""
    out: dict[str, dict[str, Any]] = {}
    for op, got in outputs.items():
        want = np.asarray(exact[op], np.float64)
        got = np.asarray(got, np.float64).reshape(want.shape)
        rho = float(np.max(np.abs(got - want) / (_U_B * np.abs(want))))
        out[op] = {"rho": round(rho, 4), "accumulates": "float32" if rho <= ONE_ROUNDING else "bfloat16"}
    return out


def _tf_outputs(inputs: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    from parity_tests.running.backends import tf_module

    tf_module()  # TensorFlow started as the runs start it (its tower devices are fixed at start-up)
    from tfpar.kernel_probe import run_probe

    return run_probe(inputs)


def _torch_outputs(inputs: dict[str, dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import sys

    if "tensorflow" in sys.modules or "torch" not in sys.modules:  # torch's ops run where torch lives: a pool rank
        from parity_tests.running.backends import run_torch_job
        from torchref.jobs import JobRef

        (result,) = run_torch_job("torch kernel probe", JobRef("torchref.kernel_probe", "probe_job"), inputs, 1)
        return result["outputs"], result["torch"]
    from torchref.kernel_probe import (  # a torch-only process (a rank, parity_tests.launch.torch)
        run_probe,
        torch_facts,
    )

    return run_probe(inputs), torch_facts()


def probe(framework: str) -> dict[str, Any]:
    """``{"ops": {op: {"rho", "accumulates"}}, ...}`` for ``"tf"`` or ``"torch"``, measured once per process.

    torch's entry also has ``"torch"``: what torch says of the CPU (its ATen capability,
    oneDNN's availability and bfloat16 support, the native-bfloat16 and AMX checks).
    """
    if framework not in ("tf", "torch"):
        raise ValueError(f"framework must be 'tf' or 'torch', got {framework!r}")
    with _lock:
        if framework not in _cache:
            inputs = probe_inputs()
            exact = exact_results(inputs)
            if framework == "tf":
                _cache[framework] = {"ops": measure(_tf_outputs(inputs), exact)}
            else:
                outputs, facts = _torch_outputs(inputs)
                _cache[framework] = {"ops": measure(outputs, exact), "torch": facts}
        return _cache[framework]


#: layers with trainable parameters: a layer after one has its input gradient computed
_TRAINED = ("dense", "conv2d", "batch_norm", "attention", "depthwise_conv2d", "layer_norm", "rms_norm", "embedding",
            "position_embedding", "class_token")
#: the probed op that sums a layer's bias gradient added with a broadcasting add or as torch's float32 bias (a
#: ``sum``); Keras' ``tf.nn.bias_add`` (``BiasAddGrad``) is ``theory.BIAS_ADD_OPS``
_BIAS_SUM = {"dense": "dense bias gradient", "attention": "dense bias gradient",
             "conv2d": "conv2d bias gradient", "depthwise_conv2d": "conv2d bias gradient"}


def case_ops(layers: Sequence[Mapping[str, Any]], framework: str, bias_add: bool = False) -> list[str]:
    """The probed ops a mixed-precision run of ``layers`` (nested ones included) executes on ``framework``'s recipe.

    A layer's input gradient is computed only when a layer before it has parameters (nothing asks
    for the gradient of the data). ``bias_add``: count TensorFlow's ``BiasAddGrad`` for the biases
    Keras adds with ``tf.nn.bias_add`` (native semantics). The judge passes it for a pair of two
    TensorFlow sides, which both run it; against torch it is a predicted difference instead
    (``judging.theory.bias_add_differences``), which a bound widened by it would hide.
    """
    from parity_tests.contract.model import nested_layers

    ops: list[str] = []
    trained_before = False
    for _, layer in nested_layers(list(layers)):
        kind = layer["type"]
        if kind in ("dense", "conv2d", "attention", "tied_logits"):
            prefix = "conv2d" if kind == "conv2d" else "matmul"
            ops += [prefix, f"{prefix} {'filter' if kind == 'conv2d' else 'weight'} gradient"]
            if trained_before or kind in ("attention", "tied_logits"):
                ops.append(f"{prefix} input gradient")
        if kind == "attention":
            ops.append("batch matmul")
            if layer["dropout"] > 0:
                ops.append("softmax")
        if kind == "depthwise_conv2d":
            ops += ["depthwise conv2d", "depthwise conv2d filter gradient"]
        if kind in _BIAS_SUM and layer.get("use_bias", True):
            keras = framework == "tf" and bias_add and keras_adds_bias(layer)
            ops.append(BIAS_ADD_OPS[kind] if keras else _BIAS_SUM[kind])
        trained_before = trained_before or kind in _TRAINED
    return list(dict.fromkeys(ops))


def side_factor(layers: Sequence[Mapping[str, Any]], framework: str, bias_add: bool = False,
                bias_terms: int | None = None) -> tuple[float, str]:
    """``(rho_X, what it is)``: the largest ``rho`` of the ops this side's recipe runs here, at least 1.

    How many bfloat16 roundings' worth of error the side's worst kernel leaves where the
    one-rounding premise of the sampled floor allows one (``judging.bfloat16``, "The bound").
    ``bias_add``: as :func:`case_ops`. ``bias_terms``: the most values a ``bias_add`` gradient element
    of the case sums (``theory.keras_bias_add_layers``); a bfloat16 sum of ``n`` positive terms, the
    probe's kind, rounds ``n - 1`` times, each by at most ``u_b`` of a partial sum no larger than the
    total, so its ``rho`` is at most ``n - 1`` whatever the probe's 4096-term sum shows.
    """
    ops = dict(probe(framework)["ops"])
    capped = ""
    for op in ("dense bias_add gradient", "conv2d bias_add gradient"):
        if bias_terms is not None and op in ops and ops[op]["rho"] > max(bias_terms - 1, 1):
            ops[op] = {**ops[op], "rho": float(max(bias_terms - 1, 1))}
            capped = f" (bias_add: {bias_terms} values an element, so at most {max(bias_terms - 1, 1)} roundings)"
    used = [op for op in case_ops(layers, framework, bias_add) if op in ops]
    worst = max(used, key=lambda op: ops[op]["rho"], default=None)
    if worst is None or ops[worst]["rho"] <= ONE_ROUNDING:
        return 1.0, f"{framework}: every kernel of the recipe sums in float32 and rounds once here"
    over = [f"{op} rho {ops[op]['rho']:.3g}" for op in used if ops[op]["rho"] > ONE_ROUNDING]
    return (float(ops[worst]["rho"]),
            f"{framework}: kernels that round partial sums to bfloat16 here: {', '.join(over)}{capped if 'bias_add' in worst else ''}")


def describe(framework: str) -> str:
    """One line: each probed op of ``framework`` and how it sums here."""
    ops = probe(framework)["ops"]
    return f"{framework}: " + ", ".join(f"{op} {v['accumulates']} (rho {v['rho']:.3g})" for op, v in ops.items())
