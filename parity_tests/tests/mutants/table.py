"""The mutation table: every mutant and control, its case, its reference and what the judge must say.

A TensorFlow mutant is judged against the correct DDP plugin (``torch_ddp.py:reference``),
a DDP mutant against the correct tower plugin (``tf_towers.py:reference``): the
question a user asks ("does my tower code compute what DDP computes", "does my
port reproduce the tower run"). Every case is float64 with 4 devices, a few
steps of a tiny model, so the float64 bound (1e-10) is the rule that decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parity_tests.contract.case import Case
from parity_tests.tests.helpers import MLP, make

__all__ = ["HERE", "TF", "TORCH", "CASES", "Row", "ROWS", "tf", "torch", "case_of", "row_id", "channel", "replica_step",
           "judge", "cached_runner"]

HERE = Path(__file__).resolve().parent
TF = HERE / "tf_towers.py"
TORCH = HERE / "torch_ddp.py"


def tf(fn: str) -> str:
    """The plugin name of a function in ``tf_towers.py`` (absolute path)."""
    return f"{TF}:{fn}"


def torch(fn: str) -> str:
    """The plugin name of a function in ``torch_ddp.py`` (absolute path)."""
    return f"{TORCH}:{fn}"


_BASE = {
    "dtype": "float64",
    "parallel__devices": 4,
    "data__global_batch": 16,
    "steps": 4,
    "optimizer": {"name": "sgd", "lr": 0.05, "semantics": "tf"},
}

#: case name -> (what it adds to the 5-10-1 MLP, the dotted changes)
CASES: dict[str, tuple[str, dict]] = {
    "mlp": ("4 towers, 16 rows (4 per tower), 4 steps of SGD at lr 0.05", {}),
    "step_schedule": ("a step schedule: lr 0.05 for steps 1-3, 0.01 after; 5 steps",
                      {"steps": 5, "optimizer": {"name": "sgd", "lr": 0.05, "semantics": "tf",
                                                 "schedule": {"kind": "step", "boundaries": [3], "values": [0.05, 0.01]}}}),
    "uneven_by_size": ("18 rows (shards 5, 5, 4, 4), weighting by_size",
                       {"data__global_batch": 18, "parallel__weighting": "by_size"}),
    "clip_after": ("global-norm clip 0.05 after the average (every step clips)",
                   {"parallel__clip": {"global_norm": 0.05, "where": "after_combine"}}),
    "batch_norm": ("dense(6, relu) -> batch_norm (local, torch's unbiased moving variance) -> dense(1)",
                   {"model__layers": [{"type": "dense", "units": 6, "activation": "relu"},
                                      {"type": "batch_norm", "momentum": 0.9, "semantics": "torch"},
                                      {"type": "dense", "units": 1}]}),
}


def case_of(name: str) -> Case:
    """The validated case ``name`` of :data:`CASES`."""
    return make(MLP, **{**_BASE, **CASES[name][1]}, name=f"mutants-{name.replace('_', '-')}")


@dataclass(frozen=True)
class Row:
    """One plugin under test.

    Attributes:
        name: the plugin's function name (the row's id).
        side: ``"tf"`` (in ``tf_towers.py``) or ``"torch"`` (in ``torch_ddp.py``).
        case: a key of :data:`CASES`.
        channel: the channel the judge must name (``loss``, ``param``, ``grad``, ``state``,
            ``replicas``: the DDP replicas-in-sync finding), or ``None`` for a control (parity).
        first_step: the first step the judge must name (``None`` for a control).
        why: one line: the bug, or why the rewrite is equivalent.
    """

    name: str
    side: str
    case: str
    channel: str | None
    first_step: int | None
    why: str

    @property
    def impl(self) -> str:
        return tf(self.name) if self.side == "tf" else torch(self.name)

    @property
    def reference(self) -> str:
        """The correct plugin of the other framework."""
        return torch("reference") if self.side == "tf" else tf("reference")

    @property
    def control(self) -> bool:
        return self.channel is None


ROWS: list[Row] = [
    # ---- mutants: TensorFlow towers
    Row("unshared_towers", "tf", "mlp", "param", 1, "each tower updates its own copy; tower 0's copy is recorded"),
    Row("grads_summed", "tf", "mlp", "param", 1, "the towers' gradients summed, not averaged (N times the step)"),
    Row("extra_one_over_n", "tf", "mlp", "param", 1, "the average divided by N again (1/N of the step)"),
    Row("lr_schedule_per_tower", "tf", "step_schedule", "param", 2,
        "the global step advances once per tower: the schedule's boundary is crossed N times too early"),
    Row("bn_stats_last_tower", "tf", "batch_norm", "state", 1, "moving statistics from the last tower, not tower 0"),
    Row("bn_stats_all_towers", "tf", "batch_norm", "state", 1, "every tower's moving-statistics update runs"),
    Row("bn_stats_none", "tf", "batch_norm", "state", 1, "the moving-statistics updates never run"),
    Row("equal_weights_uneven", "tf", "uneven_by_size", "loss", 1, "a plain mean over uneven shards where n_r/B weights are asked"),
    Row("clip_per_tower", "tf", "clip_after", "param", 1, "each tower's gradient clipped before the average"),
    Row("unscoped_loss_collection", "tf", "mlp", "loss", 1, "tower k's loss includes towers 0..k-1's losses"),
    Row("extra_update_on_log_steps", "tf", "mlp", "param", 3, "every third step applies its update twice"),
    Row("last_tower_loss", "tf", "mlp", "loss", 1, "the last tower's loss reported as the step's loss"),
    # ---- mutants: DDP
    Row("loss_times_world_size", "torch", "mlp", "param", 1, "the loss times the world size before backward"),
    Row("loss_not_averaged", "torch", "mlp", "loss", 1, "rank 0's shard loss logged, not the mean over ranks"),
    Row("replica_skips_update", "torch", "mlp", "replicas", 2, "the last rank skips the optimizer step at step 2"),
    # ---- controls (equivalent rewrites): parity
    Row("reference", "tf", "mlp", None, None, "the correct pair"),
    Row("reference", "tf", "step_schedule", None, None, "the correct pair, step schedule"),
    Row("reference", "tf", "uneven_by_size", None, None, "the correct pair, by_size on uneven shards"),
    Row("reference", "tf", "clip_after", None, None, "the correct pair, clip after the average"),
    Row("reference", "tf", "batch_norm", None, None, "the correct pair, local batch norm"),
    Row("loss_mean", "tf", "mlp", None, None, "the mean of the losses differentiated once = the mean of the gradients"),
    Row("loss_mean", "tf", "uneven_by_size", None, None, "the n_r/B-weighted loss differentiated once"),
    Row("loss_mean", "tf", "clip_after", None, None, "the mean loss differentiated once, then clipped"),
    Row("loss_mean", "tf", "batch_norm", None, None, "each tower's loss through its own batch statistics, one tape"),
    Row("stacked_reduce_mean", "tf", "mlp", None, None, "tf.reduce_mean(tf.stack(grads), 0) = add_n(grads) / N"),
    Row("scaled_before_sum", "tf", "mlp", None, None, "sum of g_k / N = (sum of g_k) / N (exactly: 1/4 is a power of two)"),
    Row("manual_allreduce", "torch", "mlp", None, None, "no DDP wrapper: all_reduce(sum) of each gradient, / N"),
]


def row_id(row: Row) -> str:
    """``tf-grads_summed@mlp``: the readable test id."""
    return f"{row.side}-{row.name}@{row.case}"




def channel(verdict) -> str | None:
    """The channel the verdict names: the group of ``verdict.key`` (``replicas`` for the DDP sync finding)."""
    from parity_tests.judging.pair import RULE_REPLICAS

    if verdict.rule == RULE_REPLICAS:
        return "replicas"
    return None if verdict.key is None else verdict.key.partition("/")[0]


def replica_step(verdict) -> int | None:
    """The step of the replicas-in-sync finding ("replicas diverged at step k: ..."), or ``None``."""
    import re

    m = re.search(r"replicas diverged at step (\d+)", verdict.detail)
    return int(m.group(1)) if m else None


def cached_runner(cache: dict) -> Callable:
    """``runner(case, impl)`` for ``compare_case`` that runs each (case, implementation) once."""
    from parity_tests.running.harness import run_impl

    def run(case: Case, impl: str) -> dict[str, np.ndarray]:
        key = (json.dumps(case.spec, sort_keys=True, default=str), impl, case.capture)
        if key not in cache:
            cache[key] = run_impl(case, impl)
        return cache[key]

    return run


def judge(row: Row, cache: dict | None = None):
    """The pair result of ``row`` (its plugin against the other framework's reference)."""
    from parity_tests.running.registry import resolve
    from parity_tests.session.comparison import compare_case

    for name in (row.reference, row.impl):  # before compare_case: its theory only sees resolved plugins
        resolve(name)
    runner = cached_runner(cache) if cache is not None else None
    return compare_case(case_of(row.case), [row.reference, row.impl], runner=runner).pairs[0]
