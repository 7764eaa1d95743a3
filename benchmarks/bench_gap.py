"""What the judge's gap costs on a GPT's parameters (issue 38): ``judging.compare.relative_gap``, CPU seconds.

    .venv/bin/python benchmarks/bench_gap.py                       # GPT-2 small's shapes, 2 rows each, float64
    .venv/bin/python benchmarks/bench_gap.py --model gpt-29m --rows 5

Every rule reads a pair's per-step gap ``max |a_k - b_k| / max |b_k|`` of every parameter (a float64
verdict, its mapped residual, the float32 floors, the stand-in's leg, the localisation): on GPT-2
small, 124 M parameters a row, the compare spent 89.5 s with no run in flight, most of it there
(docs/benchmarks.md). This script makes two trajectories of the model's parameter shapes
(``bench_recorder.shapes``; the second the first moved by 1e-12 relative) in memory and prints the
CPU seconds of one ``relative_gap`` over every parameter, the median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_recorder import shapes  # this folder is first on sys.path when run as a script

from parity_tests.judging.compare import relative_gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--rows", type=int, default=2, help="steps recorded (default 2)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = [rng.standard_normal((args.rows, *s)) for s in shapes(args.model)]
    b = [x * (1.0 + 1e-12) for x in a]
    n = sum(x.size for x in a) // args.rows
    times = []
    for _ in range(args.repeat):
        t0 = time.process_time()
        gaps = [relative_gap(x, y) for x, y in zip(a, b, strict=True)]
        times.append(time.process_time() - t0)
    worst = max(float(g.max()) for g in gaps)
    print(f"{args.model}: {n / 1e6:.1f} M parameters x {args.rows} rows, float64: relative_gap over every parameter"
          f" {statistics.median(times):.2f} CPU seconds (median of {args.repeat}; {', '.join(f'{t:.2f}' for t in times)});"
          f" greatest gap {worst:.3g}")


if __name__ == "__main__":
    main()
