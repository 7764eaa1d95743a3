"""PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_update_sensitivity.py [--reruns R]

How often does rule 3 (the perturbation floor, docs/tolerance.md) call the error-rate hunt's pair 251 a
divergence, with and without the gradients' carried gap (``judging.update_sensitivity``)? The pair is
``torch_side.py:ddp_f32`` against ``tf_side.py:concat_loss`` on the hunt's case (float32, 2 devices, Adam
``semantics: tf`` with ``beta2 = 0``, ``eps = 1e-3``, lr 1): equal updates in exact arithmetic, where one
element's gradient rounding, amplified about 1.6e3 times by the update, makes the parameters' gap.

Each side is run once as given and ``R + 1`` times from a perturbed case (the session's rerun, seeded by the
case seed, and ``R`` more seeded ``1000 ..``: each a fresh draw of the rounding, as another CPU would
draw it), then the pair is judged with every combination of one rerun per side, ``(R + 1)**2`` judgements,
by the rule as it is and by the rule without the carried term. Prints, per rule, how many combinations
were divergences and the greatest gap / bound; then each side's float32 error at the decisive element
against its float64 run, and the spread of its reruns there.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HUNT = ROOT / "parity_tests" / "tests" / "hunt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--reruns", type=int, default=6, help="perturbed reruns per side besides the session's (default 6)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from parity_tests.running.backends import reserve_tf_devices

    reserve_tf_devices(8)
    from parity_tests.contract.case import case_from_dict
    from parity_tests.judging.perturbation import judge_perturbation
    from parity_tests.running import registry
    from parity_tests.running.harness import run_impl
    from parity_tests.session.variants import perturbed_case
    from parity_tests.tests.test_update_sensitivity import PAIR_251
    from torchref.pool import shutdown_pool

    case = case_from_dict(copy.deepcopy(PAIR_251))
    sides = {"A": (f"{HUNT / 'torch_side.py'}:ddp_f32", f"{HUNT / 'torch_side.py'}:ddp"),
             "B": (f"{HUNT / 'tf_side.py'}:concat_loss", f"{HUNT / 'tf_side.py'}:concat_loss")}
    runs: dict[str, dict] = {}
    try:
        registry.resolve("tf.towers", "--impl")  # theory reads the built-ins' declarations when it makes the reruns
        seeds = [None] + [1000 + s for s in range(args.reruns)]
        for side, (name, name64) in sides.items():
            runs[side] = run_impl(case, name)
            runs[side + "64"] = run_impl(case.replace(dtype="float64"), name64)
            runs[side + "'"] = [run_impl(perturbed_case(case, seed), name) for seed in seeds]
    finally:
        shutdown_pool()
    counts = {True: [0, 0.0], False: [0, 0.0]}
    for ap_ in runs["A'"]:
        for bp in runs["B'"]:
            for carry in (True, False):
                v = judge_perturbation(runs["A"], runs["B"], a32p=ap_, b32p=bp, carry_gradients=carry)
                counts[carry][0] += v.status == "divergence"
                counts[carry][1] = max(counts[carry][1], v.gap / v.bound)
    n = len(runs["A'"]) * len(runs["B'"])
    for carry, label in ((False, "without the carried term"), (True, "with it (the rule)")):
        print(f"{label:26s}: divergence in {counts[carry][0]:3d} of {n} combinations; greatest gap / bound "
              f"{counts[carry][1]:.3g}")
    key = "param/2.kernel"
    a, b = (np.asarray(runs[s][key], dtype=np.float64) for s in "AB")
    row, idx = 2, np.unravel_index(int(np.argmax(np.abs(a[2] - b[2]))), a.shape[1:])  # step 2: where it diverged
    for s in "AB":
        x, x64 = np.asarray(runs[s][key][row], dtype=np.float64), np.asarray(runs[s + "64"][key][row])
        spread = [float(np.abs(np.asarray(r[key][row], dtype=np.float64) - x).max()) for r in runs[s + "'"]]
        print(f"side {s}: {key}{list(map(int, idx))} at step 2 off its float64 run by {x[idx] - x64[idx]:+.3g}; "
              f"its reruns spread the array by {min(spread):.2g} to {max(spread):.2g}")
    print(json.dumps({"combinations": n, "divergences_without": counts[False][0], "divergences_with": counts[True][0]}))


if __name__ == "__main__":
    main()
