"""What the bfloat16 kernel probe costs at start-up (parity_tests.running.kernels), and what it finds here.

    .venv/bin/python benchmarks/bench_kernel_probe.py

Prints the CPU facts, then per framework the probe's wall time (TensorFlow in this process
after its import; torch in a rank of an already started pool) and each op's rho. The
probe runs once per process, only when a mixed_bfloat16 case is judged or recorded.
"""

from __future__ import annotations

import json
import time


def main() -> None:
    from parity_tests.running import kernels
    from parity_tests.running.backends import tf_module
    from parity_tests.running.cpu import cpu_facts
    from torchref.pool import get_pool, shutdown_pool

    print(json.dumps(cpu_facts()))
    tf_module()
    get_pool(1).start()
    try:
        for framework in ("tf", "torch"):
            t0 = time.perf_counter()
            found = kernels.probe(framework)
            print(f"{framework}: probe {time.perf_counter() - t0:.2f} s;",
                  ", ".join(f"{op} {v['rho']:.3g}" for op, v in found["ops"].items()))
    finally:
        shutdown_pool()


if __name__ == "__main__":
    main()
