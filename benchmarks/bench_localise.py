"""How well localisation names where a bug lives: the mutation corpus, stage by stage.

    .venv/bin/python benchmarks/bench_localise.py

For every mutant of ``parity_tests/tests/mutants`` (classic tower and DDP bugs
written as plugins), the stage where the bug lives (written here by hand, from
the bug's description: the chain ``inputs, forward, loss, device_grads,
combined_grads, clip, update, state, record`` of docs/localisation.md) beside the stage,
step and device that ``tfpar compare`` reports in ``report.json``'s
``localisation``, and the seconds localisation took: reading the recorded
channels, plus (for a first bad step inside the step) the capture runs of both
sides at that step and the stage chain. The mutants report their per-device
values as a user's plugin would (``run.record(..., device_grads=...,
device_losses=..., device_inputs=...)``; the DDP ones through
``run.hook_gradients``, a DDP communication hook).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity_tests.judging.localise import localise  # noqa: E402
from parity_tests.running.registry import resolve  # noqa: E402
from parity_tests.session.comparison import compare_case  # noqa: E402
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
    # every rank differentiates N times its loss: the losses it computes (and logs) agree, its gradient is N x
    "loss_times_world_size": ("device_grads", None),
    "loss_not_averaged": ("record", None),
    "replica_skips_update": ("update", 3),
}


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
        result = compare_case(case_of(row.case), [row.reference, row.impl], runner=runner, stages=False)
        pair = result.pairs[0]
        d = result.case.spec["dtype"]
        t0 = time.perf_counter()
        localise(result.trajectories[f"{row.reference}@{d}"], result.trajectories[f"{row.impl}@{d}"], pair.verdict)
        read = time.perf_counter() - t0
        t0 = time.perf_counter()
        where = compare_case(case_of(row.case), [row.reference, row.impl], runner=runner).pairs[0].localisation
        seconds = read + time.perf_counter() - t0  # the free runs are cached: this is the capture runs and the chain
        stage, device = WHERE[row.name]
        ok = where["stage"] == stage and where["device"] == device
        note = "yes" if ok else "no"
        right += ok
        print(f"| {row.name} | {stage}{'' if device is None else f' (device {device})'} | {where['stage']} | "
              f"{where['first_bad_step']} | {where['device']} | {where['name']} | {note} | {seconds:.4f} |")
    print(f"\n{right} / {len(rows)} mutants localised to the stage (and device) where the bug lives")
    builtin_cost()
    return 0


def builtin_cost() -> None:
    """What the stage chain costs on built-in pairs: ``compare_case`` with and without it (warm pool, median of 3)."""
    from parity_tests.tests.helpers import MLP, make

    sgd = {"name": "sgd", "lr": 0.05, "semantics": "tf"}
    cases = {
        "sum reduction, 4 devices": (make(MLP, model__reduction="sum", optimizer=sgd), ["tf.towers", "torch.ddp", "torch.single"]),
        "per-device clip, 4 devices": (make(MLP, parallel__clip={"global_norm": 0.05, "where": "per_device"}, optimizer=sgd),
                                       ["tf.towers", "tf.single", "torch.ddp"]),
    }
    print("\n| built-in case | pairs | stage found | compare s (no chain) | compare s (with chain) |")
    print("| --- | --- | --- | --- | --- |")
    for label, (case, impls) in cases.items():
        compare_case(case, impls)  # warm: the pool, TensorFlow's kernels
        times = {}
        for stages in (False, True):
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                result = compare_case(case, impls, stages=stages)
                runs.append(time.perf_counter() - t0)
            times[stages] = sorted(runs)[1]
        found = ", ".join(f"{p.impl}: {(p.localisation or {}).get('stage')}" for p in result.pairs)
        print(f"| {label} | {len(result.pairs)} | {found} | {times[False]:.2f} | {times[True]:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
