"""Cold start of ``tfpar compare`` against the time of ``import tensorflow`` alone (issue 11, point 2).

    .venv/bin/python benchmarks/bench_cold_start.py [--repeat 3] [CASE]

Runs, alternately and ``--repeat`` times each, ``python -c "import tensorflow"``
and ``tfpar compare CASE`` (default ``examples/seed003-mlp/case.json``: the
5-10-1 MLP, 25 steps, four implementations, float32 and float64) as fresh
processes, and prints every wall time, the medians and their ratio (target:
at most 2). Alternating makes both see the same load on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", nargs="?", default="examples/seed003-mlp/case.json")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    bindir = Path(sys.executable).parent
    imports, compares = [], []
    for _ in range(args.repeat):
        imports.append(_wall([sys.executable, "-c", "import tensorflow"]))
        compares.append(_wall([str(bindir / "tfpar"), "compare", args.case]))
    print("import tensorflow s: " + ", ".join(f"{t:.1f}" for t in imports))
    print("tfpar compare s:     " + ", ".join(f"{t:.1f}" for t in compares))
    mi, mc = statistics.median(imports), statistics.median(compares)
    print(f"median: import {mi:.1f} s, compare {mc:.1f} s, ratio {mc / mi:.2f} (target <= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
