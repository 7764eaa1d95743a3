"""How a ``tf.towers`` step's trace grows with the number of towers N.

    .venv/bin/python benchmarks/bench_tower_trace.py [--repeats 7]

For the MLP (5-10-1, sgd) and the softmax model (4-8-3, momentum), both ``grad_mean``, prints
the median wall time of a ``tfpar.run_case`` run of ``tf.towers`` that builds and traces its own
trainer (``tfpar.reuse.disabled()``; 4 steps, so the trace is most of it) at N = 1, 2, 4 and 8.
Since 2026-11-23 one trace of a tower serves all N (``TowerTrainer``); before, every tower was
traced anew and the time grew with N. To compare with an older checkout, run this file with
``PYTHONPATH=<that checkout>``.
"""

from __future__ import annotations

import argparse

from timing import median_seconds

import tfpar
from parity_tests.tests.helpers import MLP, SOFTMAX, make
from tfpar.reuse import disabled

DEVICES = (1, 2, 4, 8)
MODELS = {"MLP 5-10-1, sgd": MLP, "softmax 4-8-3, momentum": SOFTMAX}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure (the median is printed)")
    args = parser.parse_args(argv)
    tfpar.run_case(make(MLP).payload(), "tf.towers")  # starts TensorFlow and its devices
    print(f"{'model':<26}" + "".join(f"{f'N={n}':>9}" for n in DEVICES), flush=True)
    for name, base in MODELS.items():
        row = []
        for n in DEVICES:
            payload = make(base, parallel__devices=n, steps=4).payload()

            def traced(payload: dict = payload) -> None:
                with disabled():
                    tfpar.run_case(payload, "tf.towers")

            row.append(median_seconds(traced, args.repeats))
        print(f"{name:<26}" + "".join(f"{t:>8.3f}s" for t in row), flush=True)


if __name__ == "__main__":
    main()
