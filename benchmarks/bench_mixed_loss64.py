""".venv/bin/python benchmarks/bench_mixed_loss64.py RESULTS.json [RESULTS.json ...] [--limit N] [--pairs a,b]

The float64 runs' logged loss of mixed_bfloat16 pairs of a TensorFlow side and a torch side (docs/mixed-precision.md,
"The loss"): their mixed runs' losses are different quantities (Keras rounds the logits twice, torch once:
``theory.reported_loss_differs``), but their float64 runs (``judging.bfloat16.float64_reference``) compute no
bfloat16 at all. This runs each picked hunt row's float64 runs on both sides and prints, per step, the relative
loss gap against the float64 rule's loss bound (``1e-10 + S x parameter gap of the step before``,
docs/tolerance.md) and the float64 rule's verdict with the loss judged.

Rows picked: the equivalent pairs of a hunt's results.json (``bench_error_rates.py --out``) whose case is
mixed_bfloat16 with a biased last dense layer and whose two sides are of different frameworks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _framework(name: str) -> str:
    return "torch" if "torch" in name.split("@")[-1] else "tf"


def picked(files: list[str], pairs: set[frozenset[str]] | None) -> list[tuple[str, int, dict]]:
    """``(file, index, row)`` of every equivalent mixed TF-vs-torch row whose last dense layer has a bias."""
    out = []
    for f in files:
        for i, r in enumerate(json.loads(Path(f).read_text())):
            last = r["raw"]["model"]["layers"][-1]
            if (r["kind"] == "equivalent" and r["dtype"] == "mixed_bfloat16"
                    and _framework(r["reference"]) != _framework(r["impl"])
                    and last["type"] == "dense" and last["use_bias"]
                    and (pairs is None or frozenset((r["reference"], r["impl"])) in pairs)):
                out.append((f, i, r))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--pairs", default=None, help="only these pairs, e.g. tf.towers,torch.ddp")
    args = ap.parse_args()
    want = None if args.pairs is None else {frozenset(args.pairs.split(","))}

    import numpy as np

    from parity_tests.judging.bfloat16 import float64_reference
    from parity_tests.judging.rules.float64_bound import judge_float64
    from parity_tests.running.backends import reserve_tf_devices
    from parity_tests.running.harness import run_impl
    from parity_tests.tests.hunt.corpus import Pair

    reserve_tf_devices(8)
    from torchref.pool import shutdown_pool

    worst = 0.0
    try:
        for f, i, r in picked(args.results, want)[: args.limit]:
            case = float64_reference(Pair(r["raw"], r["reference"], r["impl"]).case())
            a, b = run_impl(case, r["reference"]), run_impl(case, r["impl"])
            v = judge_float64(a, b, loss=True)
            gap, bound = v.per_step_loss_gap, v.per_step_loss_bound
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(np.isfinite(bound), gap / bound, np.nan)
            if np.isfinite(ratio).any():
                worst = max(worst, float(np.nanmax(ratio)))
            steps = " ".join(f"{g:.1e}/{c:.1e}" for g, c in zip(gap, bound, strict=True))
            print(f"{Path(f).parent.name}[{i}] {r['reference']} vs {r['impl']} ({r['summary']}; hunt said {r['status']}):"
                  f" float64 {v.status}; loss gap/bound per step: {steps}", flush=True)
    finally:
        shutdown_pool()
    print(f"greatest loss gap / bound: {worst:.3g}")


if __name__ == "__main__":
    main()
