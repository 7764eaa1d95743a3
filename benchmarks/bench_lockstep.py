"""The cost of lockstep judging: a free ``compare`` against ``compare --lockstep`` (issue 10, point 7).

    .venv/bin/python benchmarks/bench_lockstep.py

For two cases, prints the median wall time (of 3, after one warm-up run that starts
TensorFlow and the worker pool) of ``compare_case`` (the free comparison) and of the
lockstep part of ``lockstep_compare`` (the free comparison excluded), with the number of
implementation runs each makes. ``tfpar compare --lockstep`` costs the sum of the two.
"""

from __future__ import annotations

from timing import median_seconds

from parity_tests.session.comparison import compare_case
from parity_tests.session.lockstep import lockstep_compare
from parity_tests.tests.helpers import MLP, POLY, make
from parity_tests.tests.test_lockstep import _chaotic

CASES = {
    # the chaotic float32 case of the tests: 50 steps, tanh MLP at lr 8, 2 devices
    "chaotic MLP f32, 50 steps, sgd": (lambda: _chaotic(), ["tf.towers", "torch.ddp"]),
    # a stateful float64 case at 4 devices against every built-in that loads optimizer state
    "poly f64, 20 steps, adam (torch), 4 devices": (
        lambda: make(POLY, steps=20, optimizer__semantics="torch"), ["tf.towers", "torch.ddp", "tf.single", "torch.single"]),
    "MLP f32, 25 steps, sgd, 4 devices": (lambda: make(MLP, steps=25, dtype="float32"), ["tf.towers", "torch.ddp"]),
}


def main() -> None:
    print(f"{'case':<46} {'impls':>5} {'free compare':>13} {'lockstep part':>14} {'ratio':>6}")
    for name, (build, impls) in CASES.items():
        case = build()
        lockstep_compare(case, impls)  # warm-up: TensorFlow, the pool, every trace
        free = median_seconds(lambda c=case, i=impls: compare_case(c, i), 3)
        lock = median_seconds(lambda c=case, i=impls: lockstep_compare(c, i, free=False), 3)
        print(f"{name:<46} {len(impls):>5} {free:>12.2f}s {lock:>13.2f}s {lock / free:>6.1f}")


if __name__ == "__main__":
    main()
