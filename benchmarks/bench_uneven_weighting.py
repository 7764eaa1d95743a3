""".venv/bin/python benchmarks/bench_uneven_weighting.py RESULTS.json [RESULTS.json ...] [--limit N]

How large the predicted "uneven shards with equal weighting" difference is in float64, on the cases a hunt drew.

``pair.resolve`` calls a mixed pair at parity whose float64 runs agree, their loss judged, ``unexpected_parity``
where theory predicts a *certain* difference (docs/tolerance.md, "Certain or not"). For uneven shards with equal
weighting, step 1's logged loss is ``sum_r m_r / N`` (equal) against ``sum_r n_r m_r / B`` (by size, the global
mean), ``m_r`` the mean loss of shard ``r``: they differ by ``sum_r (1/N - n_r/B) m_r``, a difference of the
shards' weights, not of rounding, which hides below the float64 bound (1e-10 relative) only where the shards'
mean losses agree to about that. This runs every case of the hunt's ``results.json`` (``bench_error_rates.py
--out``) that has the prediction with ``tf.towers`` in float64 (``judging.bfloat16.float64_reference`` for a mixed
case: the runs its pair is held against), once with ``weighting: equal`` and once with ``by_size``, and prints the
relative gap of step 1's loss and of the parameters after step 1 (the judge's normwise gap), smallest
first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WORDS = "uneven shards with equal weighting"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("results", nargs="+", type=Path, help="a hunt's results.json")
    ap.add_argument("--limit", type=int, default=0, help="at most this many distinct cases (0: all)")
    args = ap.parse_args()

    from parity_tests.running.backends import reserve_tf_devices

    reserve_tf_devices(8)
    import numpy as np

    from parity_tests.contract.case import case_from_dict
    from parity_tests.judging.bfloat16 import float64_reference
    from parity_tests.judging.bounds import SCALE_FLOOR
    from parity_tests.running.harness import run_impl

    seen, cases = set(), []
    for path in args.results:
        for row in json.loads(path.read_text()):
            if WORDS not in json.dumps(row.get("expected", [])) + (row.get("detail") or ""):
                continue
            key = json.dumps(row["raw"], sort_keys=True)
            if key not in seen:
                seen.add(key)
                cases.append((row["summary"], row["raw"]))
    cases = cases[: args.limit] if args.limit else cases
    out = []
    for summary, raw in cases:
        case = case_from_dict(json.loads(json.dumps(raw)))
        if case.spec["dtype"] != "float64":
            case = float64_reference(case)
        equal = run_impl(case.replace(**{"parallel.weighting": "equal"}), "tf.towers")
        sized = run_impl(case.replace(**{"parallel.weighting": "by_size"}), "tf.towers")
        def gap(x, y) -> float:  # the judge's normwise relative gap at one step (judging.gaps, SCALE_FLOOR)
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            return float(np.max(np.abs(x - y)) / max(np.max(np.abs(x)), np.max(np.abs(y)), SCALE_FLOOR))

        loss = gap(equal["loss"][0], sized["loss"][0])
        params = max(gap(equal[k][1], sized[k][1]) for k in equal if k.startswith("param/"))
        out.append((loss, params, summary))
    out.sort()
    print(f"{len(out)} cases with '{WORDS}' predicted; float64, tf.towers equal vs by_size, step 1")
    print(f"{'loss gap':>10} {'param gap':>10}  case")
    for loss, params, summary in out:
        print(f"{loss:10.3g} {params:10.3g}  {summary}")
    if out:
        print(f"smallest loss gap {out[0][0]:.3g} (float64 bound 1e-10: {out[0][0] / 1e-10:.3g} times it)")


if __name__ == "__main__":
    main()
