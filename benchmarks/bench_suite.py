"""Ratios measured in one run on this machine (issue 6's benchmark).

    .venv/bin/python benchmarks/bench_suite.py

1. ``torch.ddp`` on a small dense case in a warm pool against a fresh process
   group per case, at 1, 2, 4 and 8 ranks;
2. one ``tf.towers`` step at N devices against ``tf.single`` on the same
   global batch (and against ``tf.mirrored`` / ``tf.v1`` where they exist),
   timed after the step function is traced;
3. the per-example cost of the property suite's main property (a generated
   dense case run on ``tf.towers`` and ``torch.ddp`` and judged).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from timing import median_seconds  # noqa: E402

from parity_tests.contract.case import case_from_dict  # noqa: E402
from parity_tests.running.backends import tf_module as _tf  # noqa: E402

MLP = {
    "name": "bench",
    "dtype": "float32",
    "model": {"input_shape": [32], "layers": [{"type": "dense", "units": 64, "activation": "relu"}, {"type": "dense", "units": 1}], "loss": "mse"},
    "init": {"seed": 1, "kind": "glorot_uniform"},
    "data": {"generator": "gaussian", "seed": 2, "global_batch": 512},
    "optimizer": {"name": "sgd", "lr": 0.01},
    "parallel": {"devices": 1},
    "steps": 30,
}


def ddp_ratios() -> None:
    from torchref.pool import DDPPool
    from torchref.run import run_case

    print("1. torch.ddp, small dense case (5 steps): warm pool vs fresh process group")
    print(f"   {'ranks':>5} {'warm':>10} {'fresh':>10} {'ratio':>7}")
    raw = dict(MLP, steps=5)
    with DDPPool(8) as pool:
        for n in (1, 2, 4, 8):
            payload = case_from_dict(dict(raw, parallel={"devices": n})).payload()
            run_case(payload, "torch.ddp", pool=pool)
            warm = median_seconds(lambda p=payload: run_case(p, "torch.ddp", pool=pool), 7)
            t = time.perf_counter()
            with DDPPool(n) as fresh:
                run_case(payload, "torch.ddp", pool=fresh)
            cold = time.perf_counter() - t
            print(f"   {n:>5} {warm * 1e3:>7.1f} ms {cold:>8.2f} s {cold / warm:>6.0f}x")


def tf_step_ratios() -> None:
    tfpar = _tf()
    impls = [i for i in ("tf.towers", "tf.mirrored", "tf.v1") if i in tfpar.IMPLS]
    print("2. one training step, global batch 512, MLP 32-64-1, float32 (median ms per step after tracing)")
    _step_ms(tfpar, case_from_dict(MLP), "tf.single")  # warm-up: the first run pays TensorFlow's lazy start
    single = _step_ms(tfpar, case_from_dict(MLP), "tf.single")
    print(f"   tf.single: {single:.2f} ms")
    print(f"   {'N':>3} " + " ".join(f"{i:>22}" for i in impls))
    for n in (1, 2, 4, 8):
        case = case_from_dict(dict(MLP, parallel={"devices": n}))
        cells = []
        for impl in impls:
            ms = _step_ms(tfpar, case, impl)
            cells.append(f"{ms:8.2f} ms ({ms / single:4.1f}x)")
        print(f"   {n:>3} " + " ".join(f"{c:>22}" for c in cells))


def _step_ms(tfpar, case, impl: str) -> float:
    """Median per-step time of a run, excluding the first (tracing) step."""
    stamps: list[float] = []
    tfpar.run_case(case.payload(), impl, progress=lambda k: stamps.append(time.perf_counter()))
    steps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.median(steps) * 1e3


def property_cost() -> None:
    from hypothesis import strategies as st  # noqa: F401

    from parity_tests.session.comparison import compare_case
    from parity_tests.testing.strategies import dense_cases

    strat = dense_cases(dtypes=["float64", "float32"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [strat.example() for _ in range(12)]
    compare_case(cases[0], ["tf.towers", "torch.ddp"])  # pool start-up out of the figure
    t = time.perf_counter()
    for c in cases:
        compare_case(c, ["tf.towers", "torch.ddp"])
    per = (time.perf_counter() - t) / len(cases)
    print(f"3. property 'tf.towers and torch.ddp compute the same trajectory': {per:.2f} s per example (12 generated cases)")


if __name__ == "__main__":
    ddp_ratios()
    tf_step_ratios()
    property_cost()
    from torchref.pool import shutdown_pool

    shutdown_pool()
