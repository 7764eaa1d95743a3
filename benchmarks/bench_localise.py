"""How well localisation names where a bug lives: the mutation corpus, stage by stage.

    .venv/bin/python benchmarks/bench_localise.py

For every mutant of ``parity_tests/tests/mutants`` (classic tower and DDP bugs
written as plugins), the stage where the bug lives (written here by hand, from
the bug's description: the chain ``inputs, forward, loss, device_grads,
combined_grads, clip, update, state, record`` of CONTRACT §6) beside the stage,
step and device that ``tfpar compare`` reports in ``report.json``'s
``localisation``, and the seconds localisation itself took. A mutant whose bug
lives in a per-device stage (``device_grads``, ``clip``) can only be named
there once implementations report per-device values; until then the nearest
recorded stage is reported and the row says so.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity_tests.judging.judge import compare_case  # noqa: E402
from parity_tests.judging.localise import localise  # noqa: E402
from parity_tests.running.registry import resolve  # noqa: E402
from parity_tests.tests.mutants.table import ROWS, cached_runner, case_of  # noqa: E402

# where each bug lives, and the device when it lives in one
WHERE = {
    "unshared_towers": ("combined_grads", None),  # no average: each copy takes its own tower's gradient
    "grads_summed": ("combined_grads", None),
    "extra_one_over_n": ("combined_grads", None),
    "lr_schedule_per_tower": ("update", None),  # the schedule's step count
    "bn_stats_last_tower": ("state", None),
    "bn_stats_all_towers": ("state", None),
    "bn_stats_none": ("state", None),
    "equal_weights_uneven": ("combined_grads", None),  # the combine's weights
    "clip_per_tower": ("clip", None),
    "unscoped_loss_collection": ("loss", None),  # each tower's loss holds others' terms
    "extra_update_on_log_steps": ("update", None),
    "last_tower_loss": ("record", None),
    "loss_times_world_size": ("loss", None),  # every rank differentiates N times its loss
    "loss_not_averaged": ("record", None),
    "replica_skips_update": ("update", 3),
}
PER_DEVICE = ("forward", "device_grads", "clip")


def main() -> int:
    cache: dict = {}
    runner = cached_runner(cache)
    rows = [r for r in ROWS if r.channel is not None]
    print("| mutant | bug lives in | reported stage | step | device | name | right | localisation s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    right = 0
    for row in rows:
        for name in (row.reference, row.impl):
            resolve(name)
        result = compare_case(case_of(row.case), [row.reference, row.impl], runner=runner)
        pair = result.pairs[0]
        d = result.case.spec["dtype"]
        t0 = time.perf_counter()
        where = localise(result.trajectories[f"{row.reference}@{d}"], result.trajectories[f"{row.impl}@{d}"], pair.verdict)
        seconds = time.perf_counter() - t0
        stage, device = WHERE[row.name]
        ok = where["stage"] == stage and where["device"] == device
        note = "yes" if ok else ("no (per-device stage not recorded)" if stage in PER_DEVICE else "no")
        right += ok
        print(f"| {row.name} | {stage}{'' if device is None else f' (device {device})'} | {where['stage']} | "
              f"{where['first_bad_step']} | {where['device']} | {where['name']} | {note} | {seconds:.4f} |")
    print(f"\n{right} / {len(rows)} mutants localised to the stage (and device) where the bug lives")
    return 0


if __name__ == "__main__":
    sys.exit(main())
