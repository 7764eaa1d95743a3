"""nice .venv/bin/python benchmarks/bench_perturbation_floor.py [--quick | --mutants]

Does the perturbation floor (judging without float64, docs/tolerance.md rule 3)
give the same verdicts as the float64-based noise floor (rule 2) on the built-in
matrix? Every float32 case of ``tfpar matrix`` (the three seed scenarios x 1, 2,
4, 8 devices x both combine rules, and the CNN with synchronized and local batch
norm) is run once per implementation in float32, in float64 and in float32 from
the perturbed case (``judge.perturbed_case``: weights, inputs and hyperparameters
moved by one ulp, each device's shard reordered), and each pair (``tf.towers``
against the five others) is judged both ways by ``compare_case(floor=...)`` from
the same runs.

Prints one row per pair (case, pair, the float64-rule verdict, the perturbation
verdict, the float32 gap, both bounds at the decisive step), then the count of
agreements and, per rule, the greatest gap/bound over the pairs at parity and
the smallest over the pairs that diverged. ``--quick``: 2 devices only (8 cases).
``--mutants``: instead, the mutant corpus of docs/mutants.md run in float32 and judged
by rule 3 alone (every mutant must be a divergence, every control at parity).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.reporting.matrix import IMPLS, matrix_cases
from parity_tests.running.harness import run_impl
from parity_tests.session.comparison import CaseResult, compare_case

Traj = dict[str, np.ndarray]


def caching_runner() -> Callable[[Case, str], Traj]:
    """``run_impl`` remembered by (implementation, spec, initial weights): each run is made once."""
    done: dict[tuple[str, str, str], Traj] = {}

    def run(case: Case, impl: str) -> Traj:
        weights = hashlib.sha256(b"".join(np.ascontiguousarray(case.init[k]).tobytes() for k in sorted(case.init)))
        key = (impl, json.dumps(case.spec, sort_keys=True), weights.hexdigest())
        if key not in done:
            done[key] = run_impl(case, impl)
        return done[key]

    return run


def _ratio(gap: float, bound: float) -> float:
    return gap / bound if bound > 0 else float("inf")


def judge_both(case: Case) -> list[tuple[str, str, object, object]]:
    """(case, impl, float64-rule verdict, perturbation verdict) for each judged pair of ``case``."""
    runner = caching_runner()
    results: dict[str, CaseResult] = {
        floor: compare_case(case, IMPLS, runner=runner, skip_unsupported=True, floor=floor)
        for floor in ("float64", "perturbation")
    }
    rows = []
    for p64, pp in zip(results["float64"].pairs, results["perturbation"].pairs, strict=True):
        rows.append((case.name, p64.impl, p64.verdict, pp.verdict))
    return rows


def mutants() -> int:
    """The mutant corpus (docs/mutants.md) judged by the perturbation floor alone, in float32.

    Each row's case is run in float32 with ``floor="perturbation"`` (no float64 run), its
    plugin judged against the other framework's reference plugin (as in docs/mutants.md: no
    rerun is reordered, both sides are plugins) and against the other framework's built-in
    (``torch.ddp`` or ``tf.towers``, whose rerun is reordered). Every mutant must be a
    divergence both ways, every control at parity. Prints one row per plugin and the counts.
    """
    from parity_tests.running.registry import resolve
    from parity_tests.tests.mutants.table import ROWS, cached_runner, case_of, channel, replica_step
    from torchref.pool import shutdown_pool

    t0 = time.perf_counter()
    cache: dict = {}
    ok = {"plugin": 0, "built-in": 0}
    print(f"{'mutant':<26} {'side':<6} {'case':<15} {'expected':<13} {'vs reference plugin':<44} "
          f"{'vs built-in':<44}")
    try:
        for row in ROWS:
            builtin = "torch.ddp" if row.side == "tf" else "tf.towers"
            cells = []
            for label, ref in (("plugin", row.reference), ("built-in", builtin)):
                for name in (ref, row.impl):  # before compare_case: its theory only sees resolved plugins
                    resolve(name)
                case = case_of(row.case).replace(dtype="float32")
                v = compare_case(case, [ref, row.impl], runner=cached_runner(cache), floor="perturbation").pairs[0].verdict
                ch = channel(v)
                step = replica_step(v) if ch == "replicas" else v.first_step
                ok[label] += (v.status == "parity") if row.control else (v.status == "divergence")
                seen = "" if v.status == "parity" else f" {(ch if ch == 'replicas' else v.key)} @ {step}"
                cells.append(f"{v.status}{seen} ({v.gap:.2e}/{v.bound:.2e})")
            want = "parity" if row.control else f"{row.channel} @ {row.first_step}"
            print(f"{row.name:<26} {row.side:<6} {row.case:<15} {want:<13} {cells[0]:<44} {cells[1]:<44}", flush=True)
    finally:
        shutdown_pool()
    n_mut = sum(1 for r in ROWS if not r.control)
    print(f"\nrule 3 in float32 ({time.perf_counter() - t0:.0f} s): {len(ROWS)} rows ({n_mut} mutants, "
          f"{len(ROWS) - n_mut} controls) as expected: {ok['plugin']} against the reference plugin, "
          f"{ok['built-in']} against the built-in")
    return 0 if ok["plugin"] == ok["built-in"] == len(ROWS) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 devices only (8 cases)")
    parser.add_argument("--mutants", action="store_true",
                        help="instead: the mutant corpus (docs/mutants.md) in float32, judged by rule 3 alone")
    args = parser.parse_args(argv)
    if args.mutants:
        return mutants()
    devices = (2,) if args.quick else (1, 2, 4, 8)
    cases = matrix_cases(devices=devices, dtypes=("float32",), expected_rows=False)
    from torchref.pool import get_pool, shutdown_pool

    get_pool(max(c.devices for c in cases))
    t0 = time.perf_counter()
    print(f"{'case':<34} {'pair':<26} {'float64 rule':<20} {'gap':>9} {'bound':>9}  {'perturbation':<20} "
          f"{'gap':>9} {'bound':>9}  {'key (perturbation)':<20}")
    rows = []
    try:
        for case in cases:
            for name, impl, v64, vp in judge_both(case):
                rows.append((name, v64, vp))
                print(f"{name:<34} {'tf.towers vs ' + impl:<26} {v64.status:<20} {v64.gap:9.2e} {v64.bound:9.2e}  "
                      f"{vp.status:<20} {vp.gap:9.2e} {vp.bound:9.2e}  {vp.key or '-':<20}", flush=True)
    finally:
        shutdown_pool()
    agree = sum(v64.status == vp.status for _, v64, vp in rows)
    judged = [(name, v64, vp) for name, v64, vp in rows if v64.status != "unsupported"]
    print(f"\n{agree} / {len(rows)} verdicts agree ({len(judged)} judged pairs, "
          f"{len(rows) - len(judged)} unsupported) over {len(cases)} float32 cases in {time.perf_counter() - t0:.0f} s")
    for scenario in sorted({name.split(":")[0] for name, _, _ in judged}):
        mine = [(v64, vp) for name, v64, vp in judged if name.split(":")[0] == scenario]
        print(f"  {scenario:<18} {sum(a.status == b.status for a, b in mine):3d} / {len(mine)} agree")
    for label, pick in (("float64 rule", 1), ("perturbation", 2)):
        par = [_ratio(r[pick].gap, r[pick].bound) for r in judged if r[pick].status == "parity"]
        div = [_ratio(r[pick].gap, r[pick].bound) for r in judged if r[pick].diverged]
        print(f"{label}: {len(par)} parity, greatest gap/bound {max(par, default=float('nan')):.2f}; "
              f"{len(div)} differences, smallest gap/bound {min(div, default=float('nan')):.3g}")
    found = [_ratio(vp.gap, vp.bound) for _, v64, vp in judged if v64.diverged]
    print(f"differences the float64 rule finds: {len(found)}, found by the perturbation too: "
          f"{sum(r > 1 for r in found)} (smallest gap/bound {min(found, default=float('nan')):.3g})")
    return 0 if agree == len(rows) else 1

if __name__ == "__main__":
    sys.exit(main())
