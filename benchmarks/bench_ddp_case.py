"""Warm-pool DDP case against a fresh process group per case (issue 2's performance target).

    .venv/bin/python benchmarks/bench_ddp_case.py

Prints, for a small dense case (the 5-10-1 MLP, 5 steps) at 1, 2, 4 and 8
ranks: the median wall time of ``torch.ddp`` in a warm pool, the wall time of
the same case in a freshly started pool (spawn + process group + case +
teardown), and their ratio.
"""

from __future__ import annotations

import statistics
import time

from parity_tests.contract.case import case_from_dict
from torchref.pool import DDPPool
from torchref.run import run_case

CASE = {
    "name": "bench-mlp",
    "dtype": "float32",
    "model": {"input_shape": [5], "layers": [{"type": "dense", "units": 10, "activation": "relu"}, {"type": "dense", "units": 1}], "loss": "sigmoid_ce"},
    "init": {"seed": 1},
    "data": {"generator": "binary5", "seed": 2, "global_batch": 400},
    "optimizer": {"name": "sgd", "lr": 0.001},
    "parallel": {"devices": 8},
    "steps": 5,
}


def main() -> None:
    print(f"{'ranks':>5} {'warm pool (median of 10)':>26} {'fresh group':>12} {'ratio':>7}")
    with DDPPool(8) as pool:
        for n in (1, 2, 4, 8):
            payload = case_from_dict(dict(CASE, parallel={"devices": n})).payload()
            run_case(payload, "torch.ddp", pool=pool)  # first job at this size warms the subgroup
            times = []
            for _ in range(10):
                t = time.perf_counter()
                run_case(payload, "torch.ddp", pool=pool)
                times.append(time.perf_counter() - t)
            warm = statistics.median(times)
            t = time.perf_counter()
            with DDPPool(n) as fresh:
                run_case(payload, "torch.ddp", pool=fresh)
            cold = time.perf_counter() - t
            print(f"{n:>5} {warm * 1000:>23.1f} ms {cold:>10.2f} s {cold / warm:>6.0f}x")


if __name__ == "__main__":
    main()
