"""How close correct mixed_bfloat16 pairs come to the bfloat16 rule's bound (parity_tests.judging.bfloat16).

    .venv/bin/python benchmarks/bench_bfloat16_bound.py [--quick]
    TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python benchmarks/bench_bfloat16_bound.py   (TensorFlow's Eigen kernels)

Runs the matrix's mixed rows and a grid of dense cases nobody tuned (activations, losses,
optimizers, learning rates, 1/2/4 devices) as ``tf.towers`` against ``torch.ddp`` and
``tf.single``, and prints per side the largest ``(e_X - T_X) / (rho_X S)`` over the steps (its
distance from float64 less the storage term, over the sampled spread: judging.bfloat16):
the safety factor ``F`` must exceed every one of them once the storage term ``T`` (the float64
run from the inputs and weights rounded to bfloat16) is taken off. Ends with the largest and the
verdicts that were not parity. A TensorFlow side of a pair where theory predicts Keras' bias
gradient summed in bfloat16 (``theory.bias_add_differences``) is printed but not counted: its
distance is that predicted difference, not rounding.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

IMPLS = ["tf.towers", "torch.ddp", "tf.single"]
#: the storage term's factor in the bound (judging.bfloat16.BF16_STORAGE_FACTOR)
STORAGE = 2.0


def grid(quick: bool) -> list:
    from parity_tests.reporting.matrix import matrix_cases
    from parity_tests.tests.helpers import MLP, SOFTMAX, make

    cases = matrix_cases(devices=(1, 2, 4), dtypes=("mixed_bfloat16",), expected_rows=False)
    models = [
        ("relu-mlp", MLP, {}),
        ("tanh-softmax", SOFTMAX, {}),
        ("sigmoid-deep", MLP, {"model.layers": [{"type": "dense", "units": 8, "activation": "sigmoid"},
                                                {"type": "dense", "units": 8, "activation": "tanh"},
                                                {"type": "dense", "units": 1}]}),
    ]
    optimizers = [{"name": "sgd", "lr": 0.1}, {"name": "momentum", "lr": 0.05, "momentum": 0.9},
                  {"name": "adam", "lr": 0.01}]
    for (name, base, changes), opt, n in itertools.product(models, optimizers, (1, 2, 4)):
        if quick and n != 2:
            continue
        cases.append(make(base, name=f"{name}-{opt['name']}-n{n}", dtype="mixed_bfloat16", steps=8,
                          optimizer=opt, parallel__devices=n, **{k.replace(".", "__"): v for k, v in changes.items()}))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 devices only")
    args = ap.parse_args()
    import numpy as np

    from parity_tests.judging.bfloat16 import _errors, _storage
    from parity_tests.judging.gaps import _gaps, _judged_keys, _row_max, _scales
    from parity_tests.judging.perturbation import _spread
    from parity_tests.session import comparison as judge

    t0 = time.perf_counter()
    worst, odd = (0.0, ""), []
    worst_predicted = (0.0, "none")
    for case in grid(args.quick):
        r = judge.compare_case(case, IMPLS, stages=False)
        t = r.trajectories
        keys = _judged_keys([t[f"{IMPLS[0]}@mixed_bfloat16"]], None)
        for p in r.pairs:
            pair = (p.reference, p.impl)
            sc = _scales(t[f"{pair[0]}@float64"], t[f"{pair[1]}@float64"], keys)
            spread = _spread(np.fmax.reduce([
                _row_max(_gaps(_errors(t[f"{s}@mixed_bfloat16"], t[f"{s}@float64"], keys),
                               _errors(t[f"{s}@{k}"], t[f"{s}@{k64}"], keys), keys, sc))[0]
                for s in pair for k, k64 in zip(judge.BF16_RERUN_KEYS, judge.BF16_RERUN64_KEYS, strict=True)]))
            # as the judge: two TensorFlow sides count Keras' bias_add kernel in rho; against torch it is the
            # predicted bias-gradient difference instead, and a side over the factor there is that difference
            both_tf = all(x.startswith("tf.") for x in pair)
            predicted = any(x.startswith("bias gradient summed in bfloat16") for x in p.prediction.expected)
            for s in pair:
                rho = judge._bf16_side(case, s, t, bias_add=both_tf).rho
                e = _spread(_row_max(_gaps(t[f"{s}@mixed_bfloat16"], t[f"{s}@float64"], keys, sc))[0])
                storage = _storage(judge._bf16_side(case, s, t), keys, sc, spread)
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = float(np.nanmax(np.where(spread[1:] > 0, (e[1:] - STORAGE * storage[1:]) / (rho * spread[1:]),
                                                     0.0)))
                print(f"{case.name:40s} {pair[0]} vs {pair[1]:12s} side {s:12s} rho {rho:.3g}  max (e - {STORAGE:g} T)/(rho S)"
                      f" {ratio:.3f}  (greatest e {np.nanmax(e):.2e}, T {np.nanmax(storage):.2e}, S {np.nanmax(spread):.2e})"
                      + ("  (bias gradient predicted: not counted)" if predicted and s.startswith("tf.") else ""),
                      flush=True)
                if not (predicted and s.startswith("tf.")):
                    worst = max(worst, (ratio, f"{case.name} {s} in {pair[0]} vs {pair[1]}"))
                else:
                    worst_predicted = max(worst_predicted, (ratio, f"{case.name} {s} in {pair[0]} vs {pair[1]}"))
            if p.verdict.status != "parity":
                odd.append(f"{case.name} {pair[0]} vs {pair[1]}: {p.verdict.status} ({p.verdict.rule})")
    print(f"largest (e - {STORAGE:g} T)/(rho S): {worst[0]:.3f} ({worst[1]}); {time.perf_counter() - t0:.0f} s")
    print(f"largest for a TensorFlow side with the bias-gradient difference predicted: {worst_predicted[0]:.3f}"
          f" ({worst_predicted[1]})")
    print("not parity:", "; ".join(odd) if odd else "none")


if __name__ == "__main__":
    main()
