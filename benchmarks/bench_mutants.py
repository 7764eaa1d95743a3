""".venv/bin/python benchmarks/bench_mutants.py

Prints the mutation table of the judge on user code (issue 9, point 6): every
classic tower/DDP bug of ``parity_tests/tests/mutants/`` and every equivalent
rewrite, judged against the correct plugin of the other framework, with the
verdict, the first step, the channel the judge names and the gap (float64, 4
devices). The rows are ``parity_tests/tests/mutants/table.py``'s; the output is
the table in ``docs/mutants.md``. About a minute and a half on 2 cores (most of
it starting TensorFlow and the 8-rank DDP pool).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from parity_tests.tests.mutants.table import CASES, ROWS, channel, judge, replica_step  # noqa: E402


def main() -> None:
    from torchref.pool import shutdown_pool

    t0 = time.perf_counter()
    cache: dict = {}
    lines = [
        "| mutant | side | case | expected | verdict | first step | channel | gap | bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    wrong = []
    try:
        for row in ROWS:
            v = judge(row, cache).verdict
            ch = channel(v)
            step = replica_step(v) if ch == "replicas" else v.first_step
            named = ch if ch == "replicas" or v.key is None else v.key
            if v.status == "parity":
                named, step_text = "-", "-"
            else:
                step_text = str(step)
            want = "parity" if row.control else f"{row.channel} @ {row.first_step}"
            ok = v.status == "parity" if row.control else (v.status == "divergence" and ch == row.channel
                                                           and step == row.first_step)
            if not ok:
                wrong.append(row.name)
            lines.append(f"| `{row.name}` | {row.side} | {row.case} | {want} | {v.status} | {step_text} | {named} |"
                         f" {v.gap:.3g} | {v.bound:.3g} |")
    finally:
        shutdown_pool()
    print("\n".join(lines))
    print()
    for name, (what, _) in CASES.items():
        print(f"- `{name}`: {what}")
    mutants = sum(1 for r in ROWS if not r.control)
    print(f"\n{mutants} mutants, {len(ROWS) - mutants} controls; "
          f"{'all as expected' if not wrong else 'NOT as expected: ' + ', '.join(wrong)} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
