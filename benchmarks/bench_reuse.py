"""What reusing a built trainer saves (``tfpar.reuse``): a run that traces against one that does not.

    .venv/bin/python benchmarks/bench_reuse.py

For three cases, prints the median wall time (of 5) of a ``tfpar.run_case`` run of
``tf.towers`` that builds and traces its trainer (``TFPAR_TRACE_CACHE=0``) and of one that
reuses the trainer of an earlier run of the same structure from other seeds. One warm-up run
first starts TensorFlow. The difference is the trace and the build a reuse saves.
"""

from __future__ import annotations

from timing import median_seconds

import tfpar
from parity_tests.tests.helpers import CNN, MLP, SOFTMAX, make
from tfpar.reuse import CACHE, disabled

CASES = {
    "MLP 5-10-1, 4 devices, 4 steps, sgd": (MLP, {}),
    "softmax 4-8-3, 8 devices, 4 steps, momentum": (SOFTMAX, {"parallel__devices": 8}),
    "CNN + sync batch norm + dropout, 4 devices, 3 steps": (CNN, {"parallel__batch_norm": "sync"}),
}


def main() -> None:
    tfpar.run_case(make(MLP).payload(), "tf.towers")  # starts TensorFlow and its devices
    print(f"{'case':<52} {'traced':>9} {'reused':>9} {'saved':>7}")
    for name, (base, changes) in CASES.items():
        payloads = [make(base, **changes, init__seed=s, data__seed=s + 1).payload() for s in range(10, 16)]

        def traced(payload: dict = payloads[0]) -> None:
            with disabled():
                tfpar.run_case(payload, "tf.towers")

        CACHE.clear()
        tfpar.run_case(payloads[0], "tf.towers")  # the trainer the reused runs take
        runs = iter(payloads[1:])
        t_traced = median_seconds(traced, 5)
        t_reused = median_seconds(lambda runs=runs: tfpar.run_case(next(runs), "tf.towers"), 5)
        print(f"{name:<52} {t_traced:>8.3f}s {t_reused:>8.3f}s {1 - t_reused / t_traced:>6.0%}", flush=True)


if __name__ == "__main__":
    main()
