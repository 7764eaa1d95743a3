""".venv/bin/python benchmarks/bench_pool.py

Times the torch worker pool (torchref.pool): start-up of an 8-rank pool, a trivial allreduce
job at 1, 2, 4 and 8 ranks in the warm pool (median of several), and a fresh 8-rank process
group for a single job (spawn + init + job + teardown), which is what the pool saves per case.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchref import _pool_testfns as fns  # noqa: E402
from torchref.pool import DDPPool  # noqa: E402

SIZE = 8
REPEATS = 20


def main() -> None:
    t0 = time.perf_counter()
    pool = DDPPool(SIZE, timeout=120.0)
    pool.start()
    print(f"pool start, {SIZE} ranks: {time.perf_counter() - t0:.2f} s")
    try:
        for n in (1, 2, 4, 8):
            pool.run(fns.allreduce_rank, None, n)  # warm-up
            times = []
            for _ in range(REPEATS):
                t = time.perf_counter()
                pool.run(fns.allreduce_rank, None, n)
                times.append(time.perf_counter() - t)
            print(f"warm allreduce job, {n} rank(s): median {statistics.median(times) * 1e3:.1f} ms"
                  f" (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    finally:
        t = time.perf_counter()
        pool.close()
        print(f"pool close: {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    with DDPPool(SIZE, timeout=120.0) as fresh:
        fresh.run(fns.allreduce_rank, None, SIZE)
    print(f"fresh {SIZE}-rank group for one job (spawn+init+job+teardown): "
          f"{time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
